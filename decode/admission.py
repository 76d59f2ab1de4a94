"""Which calls a busy decode replica takes: by class, continuations first and background work last.

A decode replica serves at most its pool's ``max_ongoing_requests`` calls at
once; Serve queues the next ones at the caller, up to the pool's
``max_queued_requests``, and answers the rest with 429. Of the replica's
slots, ``continuation_reserve`` (a share) is kept for continuations (a tool's
result coming back: the agent is mid-task and its session's KV is hot here),
and the same share again for interactive calls over background ones. A call's
class (``rayturn.engine.priority``) is the one it names, else by its kind: a
continuation when it continues a turn, interactive otherwise (a new user
message, or a call that says nothing of its place in a session)::

    call --continuation, running < max_ongoing_requests ---> admitted --ends--> released
         --interactive, running < new_turn_limit -----------> admitted --ends--> released
         --background, running < background_limit ----------> admitted --ends--> released
         --interactive or background past its limit -------> refused (ReplicaAtCapacity): the ingress tries the
                                                                replicas that have not refused it, then answers
                                                                429 / RESOURCE_EXHAUSTED

Under overload background calls are refused first, then new turns, and the
agents already working keep going. Background work is held to less than new
turns are, not just the same: a background batch that filled the new turns'
share would turn every user who starts a turn away. A continuation is never
refused here (Serve sends no more than ``max_ongoing_requests`` calls to a
replica, the caller's queue holds the rest), and neither is a call resumed
after its replica died: it was admitted once already. The engine's scheduler
keeps the same order among the calls it holds (``rayturn.engine.scheduler``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rayturn.engine.priority import Priority, resolve_priority
from rayturn.messages import Call, ReplicaAtCapacity
from rayturn.settings import check, check_at_least

_REFUSED_WORDS = {Priority.INTERACTIVE: "new turns", Priority.BACKGROUND: "background calls"}
_KEPT_FOR = {Priority.INTERACTIVE: "tool continuations", Priority.BACKGROUND: "new turns and tool continuations"}


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """A replica's call slots and the share of them kept for calls that continue a turn."""

    max_ongoing_requests: int = 64
    continuation_reserve: float = 0.25

    def __post_init__(self) -> None:
        check_at_least("max_ongoing_requests", self.max_ongoing_requests, 1)
        check(
            0.0 <= self.continuation_reserve < 1.0,
            "continuation_reserve",
            f"must lie in [0, 1) (the share of a replica's calls kept for tool continuations), "
            f"got {self.continuation_reserve}",
        )

    @property
    def num_reserved(self) -> int:
        """Slots kept for each class over the one below it."""
        return math.floor(self.max_ongoing_requests * self.continuation_reserve)

    @property
    def new_turn_limit(self) -> int:
        """Calls running from which an interactive call is refused (never below 1)."""
        return self.max_ongoing_requests - self.num_reserved

    @property
    def background_limit(self) -> int:
        """Calls running from which a background call is refused (never below 1)."""
        return max(self.new_turn_limit - self.num_reserved, 1)

    def limit(self, priority: Priority) -> int | None:
        """Calls running from which a call of ``priority`` is refused; None: never (continuations)."""
        if priority is Priority.INTERACTIVE:
            return self.new_turn_limit
        if priority is Priority.BACKGROUND:
            return self.background_limit
        return None


def call_class(call: Call) -> Priority:
    """The class a call runs in, here and in the engine (``rayturn.engine.priority.resolve_priority``)."""
    return resolve_priority(call.priority, call.continues_turn)


class Admission:
    """Counts a replica's running calls, refuses interactive and background calls past their share, and counts the
    calls it admitted by class (on the replica's event loop)."""

    def __init__(self, limits: AdmissionLimits, replica_id: str | None = None) -> None:
        self.limits = limits
        self.replica_id = replica_id
        self.num_running = 0
        self.num_refused = 0
        self.num_admitted = dict.fromkeys(Priority, 0)

    @contextmanager
    def admitted(self, priority: Priority, *, resumed: bool = False) -> Iterator[None]:
        """Hold a slot while the call runs; ``ReplicaAtCapacity`` when its class finds its share taken (never for a
        call ``resumed`` after its replica died)."""
        limit = self.limits.limit(priority)
        if not resumed and limit is not None and self.num_running >= limit:
            self.num_refused += 1
            raise ReplicaAtCapacity(
                f"the decode replica runs {self.num_running} calls, its limit for {_REFUSED_WORDS[priority]} "
                f"({limit} of {self.limits.max_ongoing_requests}; the rest wait for {_KEPT_FOR[priority]})",
                self.replica_id,
            )
        self.num_running += 1
        self.num_admitted[priority] += 1
        try:
            yield
        finally:
            self.num_running -= 1

    def calls_by_priority(self) -> dict[str, int]:
        """Calls admitted since the replica started, by class name."""
        return {priority.value: count for priority, count in self.num_admitted.items()}
