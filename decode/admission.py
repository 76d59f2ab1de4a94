"""Which calls a busy decode replica takes: calls that continue a turn before calls that start one.

A decode replica serves at most its pool's ``max_ongoing_requests`` calls at
once; Serve queues the next ones at the caller, up to the pool's
``max_queued_requests``, and answers the rest with 429. Of the replica's
slots, ``continuation_reserve`` (a share) is kept for calls that continue a
turn (a tool's result coming back: the agent is mid-task and its session's KV
is hot here). Any other call (a new user message, or a call that says nothing
of its place in a session) is taken only while fewer than ``new_turn_limit``
calls run::

    call --continuation, running < max_ongoing_requests---> admitted --ends--> released
         --other call, running < new_turn_limit ----------> admitted --ends--> released
         --other call, running >= new_turn_limit ---------> refused (ReplicaAtCapacity): the ingress tries the
                                                              replicas that have not refused it, then answers
                                                              429 / RESOURCE_EXHAUSTED

Under overload new turns are refused first, and the agents already working
keep going. A continuation is never refused here: Serve sends no more than
``max_ongoing_requests`` calls to a replica, the caller's queue holds the
rest. The engine's scheduler keeps the same order among the calls it holds
(``rayturn.engine.scheduler``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rayturn.messages import CallKind, ReplicaAtCapacity
from rayturn.settings import check, check_at_least


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
    def new_turn_limit(self) -> int:
        """Calls running from which a call that does not continue a turn is refused (never below 1)."""
        reserved = math.floor(self.max_ongoing_requests * self.continuation_reserve)
        return self.max_ongoing_requests - reserved


def continues_turn(kind: CallKind | None) -> bool:
    return kind == "tool_continuation"


class Admission:
    """Counts a replica's running calls and refuses new turns past their share (on the replica's event loop)."""

    def __init__(self, limits: AdmissionLimits, replica_id: str | None = None) -> None:
        self.limits = limits
        self.replica_id = replica_id
        self.num_running = 0
        self.num_refused = 0

    @contextmanager
    def admitted(self, kind: CallKind | None) -> Iterator[None]:
        """Hold a slot while the call runs; ``ReplicaAtCapacity`` when a new turn finds its share taken."""
        if not continues_turn(kind) and self.num_running >= self.limits.new_turn_limit:
            self.num_refused += 1
            raise ReplicaAtCapacity(
                f"the decode replica runs {self.num_running} calls, its limit for new turns "
                f"({self.limits.new_turn_limit} of {self.limits.max_ongoing_requests}; the rest wait for "
                "tool continuations)",
                self.replica_id,
            )
        self.num_running += 1
        try:
            yield
        finally:
            self.num_running -= 1
