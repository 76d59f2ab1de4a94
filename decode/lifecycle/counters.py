"""What the planner counts: every decision and its outcome, as ``SessionPlanner.stats()`` reports them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .session import Phase, SessionRecord


@dataclass(slots=True)
class LifecycleCounters:
    returns: int = 0  # calls that start a new turn of a known session
    idle_s: float = 0.0  # wall seconds between those turns
    off_device_s: float = 0.0  # of which the pages were off the device
    offloaded_returns: int = 0
    prewarm_hits: int = 0  # offloaded, and back on the device before the call
    early_returns: int = 0  # offloaded, and still (partly) off the device at the call
    announced_returns: int = 0  # returns the client announced beforehand (``composing``)
    composing_hints: int = 0  # announcements of a session this replica follows
    tool_returns: int = 0
    tool_holds: int = 0
    turn_holds: int = 0
    looks: int = 0
    offloads: int = 0
    offloaded_pages: int = 0
    prewarms: int = 0
    prewarmed_pages: int = 0
    replans: int = 0
    failed_moves: int = 0

    def count_return(self, session: SessionRecord, gap_s: float, off_s: float, announced: bool) -> None:
        """The user is back after ``gap_s`` wall seconds, ``off_s`` of them with the pages off the device."""
        self.returns += 1
        session.returns += 1
        if announced:
            self.announced_returns += 1
            session.announced_returns += 1
        self.idle_s += gap_s
        self.off_device_s += off_s
        if session.offloaded_this_gap:
            self.offloaded_returns += 1
            if session.phase is Phase.PREWARMED:
                self.prewarm_hits += 1
            else:
                self.early_returns += 1

    def announced_share(self, session: SessionRecord) -> float:
        """The chance that the session's next return comes announced: its own returns so far, with the
        replica's share of announced returns counting as one more (clients either announce or do not)."""
        replica_share = self.announced_returns / self.returns if self.returns else 0.0
        return (session.announced_returns + replica_share) / (session.returns + 1)

    def as_dict(self) -> dict[str, int | float]:
        return {counter.name: getattr(self, counter.name) for counter in fields(self)}
