"""What the planner keeps of each session: its phase, its current call and gap, and the table of sessions.

A session's ``epoch`` is bumped by every arrival and decision; a timer or a
move that was started in an older epoch has lost its turn and does nothing.
The phases are those of the planner's state diagram (``planner.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

from rayturn.messages import CallKind, NextStep
from rayturn.router.scoring import session_key

from .predictors import TurnEndFeatures

# Sessions one replica remembers (least recently seen dropped first).
MAX_SESSIONS = 100_000
# Sessions named in the routing stats (the most recently seen): enough for every session that may
# announce a return soon on a busy replica, small enough to broadcast every stats period.
MAX_REPORTED_SESSIONS = 4096


class Phase(str, Enum):
    NEW = "new"
    ACTIVE = "active"
    HELD = "held"
    RELEASED = "released"
    OFFLOADED = "offloaded"
    PREWARMING = "prewarming"
    PREWARMED = "prewarmed"


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    phase: Phase = Phase.NEW
    in_flight: int = 0
    after: NextStep = "user"
    last_end_s: float | None = None  # wall clock (monotonic) when the last call ended
    turn_start_s: float = 0.0
    calls_in_turn: int = 0
    turn_end: TurnEndFeatures | None = None
    offloaded_at_s: float | None = None
    off_device_s: float = 0.0  # this gap's time off the device, offload cycles before the current one
    offloaded_this_gap: bool = False
    composing_until_s: float = 0.0  # wall clock until which an announced call is waited for on the device
    seen_unix_s: float = 0.0  # when a call of the session last arrived or ended (epoch seconds, for routing)
    routing_key: str = ""  # ``session_key`` of the id, as the routing stats name it
    returns: int = 0
    announced_returns: int = 0
    num_pages: int = 0
    retry: bool = False  # the last call was abandoned: the next one retries it
    # Bumped by every arrival and decision: a timer or move from an older epoch lost its turn.
    epoch: int = 0
    timer: asyncio.TimerHandle | None = None

    def off_device_until_s(self, now: float) -> float:
        """This gap's time off the device up to ``now``; pages still off (or on their way back) count until now."""
        if self.offloaded_at_s is None:
            return self.off_device_s
        return self.off_device_s + (now - self.offloaded_at_s)

    def goes_off_device(self, now: float) -> None:
        self.phase = Phase.OFFLOADED
        self.offloaded_at_s = now
        self.offloaded_this_gap = True

    def back_on_device(self, now: float) -> None:
        """A prewarm has brought the pages back (or given up): their time off the device ends."""
        if self.offloaded_at_s is not None:
            self.off_device_s += now - self.offloaded_at_s
            self.offloaded_at_s = None

    def composing_left_s(self, now: float) -> float:
        """How much longer an announced call is waited for on the device."""
        return max(self.composing_until_s - now, 0.0)

    def start_call(self, kind: CallKind, now: float) -> None:
        """A call of the session begins (``kind``: as the planner reads it): its gap, if any, is over."""
        if kind == "user" or self.calls_in_turn == 0:
            self.turn_start_s = now
            self.calls_in_turn = 0
        self.calls_in_turn += 1
        self.in_flight += 1
        self.retry = False
        self.epoch += 1  # timers and moves of the gap that just ended lose their turn
        self.phase = Phase.ACTIVE
        self.offloaded_at_s = None
        self.off_device_s = 0.0
        self.offloaded_this_gap = False
        if kind == "user":  # the announced call is here (a tool result in between leaves the announcement)
            self.composing_until_s = 0.0

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class SessionTable:
    """The sessions one replica follows, least recently seen first, their calls in flight, and when each
    is next expected to need the device (a tool result, a prewarm, a predicted return)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self.in_flight = 0  # calls in flight, all sessions together
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()
        self._expected_s: dict[str, float] = {}  # session -> wall time it is next expected to need the device

    def __getitem__(self, session_id: str) -> SessionRecord:
        return self._sessions[session_id]

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    def seen(self, session_id: str) -> SessionRecord:
        """The session's record (new the first time), now the most recently seen; the least recently
        seen past ``max_sessions`` are dropped, their timers cancelled."""
        session = self._sessions.pop(session_id, None) or SessionRecord(session_id, routing_key=session_key(session_id))
        self._sessions[session_id] = session  # most recently seen last
        session.seen_unix_s = time.time()
        while len(self._sessions) > self.max_sessions:
            dropped_id, dropped = self._sessions.popitem(last=False)
            dropped.cancel_timer()
            self._expected_s.pop(dropped_id, None)
            self.in_flight -= dropped.in_flight
        return session

    def start_call(self, session: SessionRecord, kind: CallKind, now: float) -> None:
        session.start_call(kind, now)
        self.in_flight += 1
        self._expected_s.pop(session.session_id, None)

    def end_call(self, session: SessionRecord, now: float) -> bool:
        """Count a call of the session as ended; True when it was its last one in flight (which decides,
        in an epoch of its own)."""
        if session.in_flight:
            session.in_flight -= 1
            self.in_flight -= 1
        session.last_end_s = now
        if session.in_flight:
            return False
        session.epoch += 1
        return True

    def expect(self, session_id: str, when_s: float) -> None:
        self._expected_s[session_id] = when_s

    def expect_nothing(self, session_id: str) -> None:
        self._expected_s.pop(session_id, None)

    def next_expected_s(self) -> float:
        """The earliest wall time any session is expected back (``inf``: none is)."""
        return min(self._expected_s.values(), default=math.inf)

    def followed(self, limit: int = MAX_REPORTED_SESSIONS) -> dict[str, float]:
        """``session_key`` -> when a call was last seen (epoch seconds), for the ``limit`` sessions seen last."""
        recent = itertools.islice(reversed(self._sessions.values()), limit)
        return {session.routing_key: round(session.seen_unix_s, 3) for session in recent}

    def phases(self) -> dict[str, int]:
        """How many sessions are in each phase."""
        phases: dict[str, int] = {}
        for session in self._sessions.values():
            phases[session.phase.value] = phases.get(session.phase.value, 0) + 1
        return phases
