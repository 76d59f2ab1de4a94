"""The KV-residency planner: where a session's pages live between its calls.

An agent's turn is a burst of calls separated by tool runs (seconds); turns
are separated by the human reading and typing (minutes). The planner follows
each session on this decode replica and moves its pages accordingly; the
engine does the moving (``LLMEngine.hold_session`` / ``offload_session`` /
``prewarm_session``) and keeps a finished call's pages held until told
otherwise::

                 call arrives (any phase) ──> ACTIVE
                                                │ call ends
              ┌──── answer calls a tool ────────┴──── turn over ────┐
              v                                                     v
     HELD (tool, TTL = tool latency quantile)                      LOOK: predict the idle left
              │ TTL passes                        idle left > break-even, and the pages would
              └──> LOOK (no store: RELEASED,      stay off long enough to pay for the move?
                   cached and evictable)           ├─ no:  HELD (turn, turn_hold_s) ──> LOOK again
                                                   └─ yes: OFFLOADED (in the store, device pages free)
                                                              │ prewarm timer: predict again; later? move the timer
                                                              v
                                                          PREWARMING ──> PREWARMED (held) ──> LOOK again

A client may announce a return (``composing``: the user has started typing):
OFFLOADED pages start back at once, pages on the device stay until the call
or for ``composing_hold_s``. A session whose returns come announced needs no
guessing for a warm return, so its later gaps hold the pages on the device
less (the predictor's ``announced_share``).

A user back while the pages are OFFLOADED or PREWARMING is an early return:
the engine loads the missing pages on demand when the call arrives (commands
run in order on the engine thread, so a prewarm already queued lands first).
Without a KV store nothing can be offloaded: a turn end holds the pages for
``turn_hold_s`` once, then lets them age out.

The break-even time is the measured cost of moving the session out and back
(its bytes over the store bandwidth seen in earlier moves, seeded from
settings) plus a margin. Predictions come from an ``IdlePredictor``
(``rayturn.router.idle``) in users' seconds; ``time_scale`` converts them to
wall seconds (1 in production; a replay that compresses time sets its
factor). Every decision and its outcome is counted (``stats()``), and each
call's arrival reports the session's state (``arrive()``): how long it was
idle, how much of that its pages spent off the device, how many are resident.
Each decision also says when the session is next expected (a tool result
within its hold, a prewarm, the earliest predicted return), so
``next_activity_s`` tells deferred background work (``idle_work.py``) when
the replica's next idle window closes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, TypeVar

from rayturn.engine import LLMEngine, SessionMove
from rayturn.engine.async_engine import AsyncEngine
from rayturn.messages import CallKind, NextStep
from rayturn.router.idle import (
    PREDICTORS,
    IdleModelConfig,
    IdlePredictor,
    IdlePrior,
    TurnEndFeatures,
    min_off_s,
)
from rayturn.router.scoring import session_key
from rayturn.router.tool_latency import ToolLatencyModel

logger = logging.getLogger(__name__)

T = TypeVar("T")
# What a timer runs: a planner step given the session and the epoch the timer was set in.
_Action = Callable[["_Session", int], Coroutine[Any, Any, None]]

# Sessions this replica remembers (least recently seen dropped first).
MAX_SESSIONS = 100_000
# Bandwidth estimates move this far toward each new measurement.
BANDWIDTH_RATE = 0.2
# A held session's TTL outlasts the planner's next look by this factor, so the look comes first.
HOLD_SLACK = 1.5
# A moved prewarm timer must move at least this far (users' seconds), or it stays.
REPLAN_MIN_STEP_S = 1.0
# Most moves of a prewarm timer one look plans ahead.
MAX_REPLANS = 50
# A session away this long (users' seconds) is not planned for any more: its pages stay in the store.
MAX_IDLE_S = 24 * 3600.0
# Sessions named in the routing stats (the most recently seen): enough for every session that may
# announce a return soon on a busy replica, small enough to broadcast every stats period.
MAX_REPORTED_SESSIONS = 4096


@dataclass(frozen=True, slots=True)
class LifecycleSettings:
    """``lifecycle`` section of the cluster config (``rayturn.cluster.config.LifecycleSpec``)."""

    enabled: bool = True
    time_scale: float = 1.0
    tool_hold_min_s: float = 5.0
    tool_hold_max_s: float = 120.0
    turn_hold_s: float = 10.0
    break_even_margin_s: float = 5.0
    prewarm_lead_s: float = 0.5
    predictor: str = "hazard"
    warm_return_worth_s: float = 400.0
    store_bandwidth_bytes_s: float = 1e9
    composing_hold_s: float = 120.0

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any] | None) -> LifecycleSettings:
        known = {spec_field.name for spec_field in fields(cls)}
        unknown = sorted(set(settings or {}) - known)
        if unknown:
            raise ValueError(f"unknown lifecycle settings {unknown}; known: {sorted(known)}")
        return cls(**dict(settings or {}))

    def wall_s(self, user_s: float) -> float:
        return user_s * self.time_scale


class Phase(str, Enum):
    NEW = "new"
    ACTIVE = "active"
    HELD = "held"
    RELEASED = "released"
    OFFLOADED = "offloaded"
    PREWARMING = "prewarming"
    PREWARMED = "prewarmed"


@dataclass(slots=True)
class _Session:
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


@dataclass(slots=True)
class _Bandwidth:
    bytes_per_s: float
    measured: int = 0

    def update(self, move: SessionMove) -> None:
        if move.bytes_moved > 0 and move.seconds > 0:
            sample = move.bytes_moved / move.seconds
            # The first measurement replaces the configured guess; later ones move the average.
            rate = BANDWIDTH_RATE if self.measured else 1.0
            self.bytes_per_s += rate * (sample - self.bytes_per_s)
            self.measured += 1


@dataclass(slots=True)
class _Tasks:
    running: set[asyncio.Task[None]] = field(default_factory=set)

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.running.add(task)
        task.add_done_callback(self.running.discard)


class SessionPlanner:
    """Follows sessions on one decode replica and moves their KV pages (see the module docstring)."""

    def __init__(
        self,
        engine: AsyncEngine,
        settings: LifecycleSettings,
        bytes_per_page: int,
        has_store: bool,
        predictor: IdlePredictor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.bytes_per_page = bytes_per_page
        self.has_store = has_store
        if predictor is None:
            config = IdleModelConfig(warm_return_worth_s=settings.warm_return_worth_s)
            predictor = PREDICTORS[settings.predictor](IdlePrior(config=config))
        self.predictor = predictor
        self.tool_latency = ToolLatencyModel()
        self.clock = clock
        self.counters = LifecycleCounters()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._out = _Bandwidth(settings.store_bandwidth_bytes_s)
        self._in = _Bandwidth(settings.store_bandwidth_bytes_s)
        self._tasks = _Tasks()
        self._in_flight = 0
        self._expected_s: dict[str, float] = {}  # session -> wall time it is next expected to need the device

    # -- calls ------------------------------------------------------------

    def arrive(self, session_id: str, call: CallKind | None) -> dict[str, Any]:
        """A call of ``session_id`` arrives: account for the gap before it; returns the session's state report.

        ``call``: the client's hint; without one a session whose last answer
        called tools continues its turn and any other call starts one.
        """
        session = self._session(session_id)
        self._cancel_timer(session)
        now = self.clock()
        kind: CallKind = call or ("tool_continuation" if session.after == "tool" else "user")
        if session.retry and call is None:
            kind = "tool_continuation"  # a retry of an abandoned call goes on with its turn
        resident, recorded = self.engine.engine.session_residency(session_id)
        report: dict[str, Any] = {
            "call": "user" if kind == "user" else "tool",
            "state": session.phase.value,
            "idle_s": None,
            "off_device_s": None,
            "resident_pages": resident,
            "session_pages": recorded,
        }
        if session.last_end_s is not None and session.in_flight == 0 and not session.retry:
            gap_s = now - session.last_end_s
            if kind == "user":
                off_s = session.off_device_s
                if session.offloaded_at_s is not None:  # still off (or on its way back): off until now
                    off_s += now - session.offloaded_at_s
                report.update(idle_s=round(gap_s, 6), off_device_s=round(off_s, 6))
                # Announced in time: the announcement's hold still runs and the pages are back for it.
                announced = self._composing_left_s(session, now) > 0 and session.phase in (Phase.HELD, Phase.PREWARMED)
                self._count_return(session, gap_s, off_s, announced)
                if session.turn_end is not None:
                    self.predictor.observe_gap(session_id, session.turn_end, gap_s / self.settings.time_scale)
            else:
                self.counters.tool_returns += 1
                self.tool_latency.observe(session_id, gap_s / self.settings.time_scale)
        if kind == "user" or session.calls_in_turn == 0:
            session.turn_start_s = now
            session.calls_in_turn = 0
        session.calls_in_turn += 1
        session.in_flight += 1
        self._in_flight += 1
        self._expected_s.pop(session_id, None)
        session.retry = False
        session.epoch += 1  # timers and moves of the gap that just ended lose their turn
        session.phase = Phase.ACTIVE
        session.offloaded_at_s = None
        session.off_device_s = 0.0
        session.offloaded_this_gap = False
        if kind == "user":  # the announced call is here (a tool result in between leaves the announcement)
            session.composing_until_s = 0.0
        return report

    def _count_return(self, session: _Session, gap_s: float, off_s: float, announced: bool) -> None:
        counters = self.counters
        counters.returns += 1
        session.returns += 1
        if announced:
            counters.announced_returns += 1
            session.announced_returns += 1
        counters.idle_s += gap_s
        counters.off_device_s += off_s
        if session.offloaded_this_gap:
            counters.offloaded_returns += 1
            if session.phase is Phase.PREWARMED:
                counters.prewarm_hits += 1
            else:
                counters.early_returns += 1

    def finish(
        self,
        session_id: str,
        finish_reason: str | None,
        after: NextStep | None,
        prompt_tokens: int,
        output_tokens: int,
    ) -> None:
        """A call of ``session_id`` ended: decide where its pages stay until the next one."""
        session = self._call_ended(session_id)
        if session is None:
            return
        now = self.clock()
        session.after = after or ("tool" if finish_reason == "tool_calls" else "user")
        session.num_pages = (prompt_tokens + output_tokens) // self.engine.engine.page_size
        session.turn_end = TurnEndFeatures(
            turn_duration_s=(now - session.turn_start_s) / self.settings.time_scale,
            calls_in_turn=session.calls_in_turn,
            last_output_tokens=output_tokens,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            time_of_day_s=time.time() % 86_400.0,
            announced_share=self._announced_share(session),
        )
        if session.after == "tool":
            # Back within the hold, usually; a tool (or a user answering it) that takes longer gets a look.
            hold_s = self._tool_hold_s(session_id)
            self.counters.tool_holds += 1
            self._hold(session, hold_s, "tool", then=self._look if self.has_store else self._released)
            self._expected_s[session_id] = now + hold_s
            return
        self._tasks.spawn(self._look(session, session.epoch))

    def _announced_share(self, session: _Session) -> float:
        """The chance that the session's next return comes announced: its own returns so far, with the
        replica's share of announced returns counting as one more (clients either announce or do not)."""
        counters = self.counters
        replica_share = counters.announced_returns / counters.returns if counters.returns else 0.0
        return (session.announced_returns + replica_share) / (session.returns + 1)

    def composing(self, session_id: str) -> dict[str, Any]:
        """The client announces a call of ``session_id`` (its user has started typing); returns the
        session's state when the announcement came (``unknown``: not a session of this replica).

        Pages in the store start back now (a prewarm under way is redone as an
        announced one, which loads as for an arrived call); pages on the device
        stay there until the call or for ``composing_hold_s``. With a call in
        flight (the user types while the agent works), the pages stay when
        that call ends.
        """
        session = self._sessions.get(session_id)
        if session is None:
            return {"state": "unknown"}
        report = {"state": session.phase.value}
        self.counters.composing_hints += 1
        now = self.clock()
        hold_s = self.settings.wall_s(self.settings.composing_hold_s)
        session.composing_until_s = now + hold_s
        if session.in_flight or session.last_end_s is None:
            return report  # the call's end finds the announcement (``_look``)
        self._expected_s[session_id] = now
        session.epoch += 1  # the plan for this gap (timers, a move under way) gives way
        self._cancel_timer(session)
        if session.phase in (Phase.OFFLOADED, Phase.PREWARMING):
            self._tasks.spawn(self._prewarm_due(session, session.epoch))
        else:
            self._hold(session, hold_s, "tool", then=self._after_hold(session))
        return report

    def _after_hold(self, session: _Session) -> _Action:
        """What follows a hold: another look, or (no store, or no turn ended to plan from) a release."""
        return self._look if self.has_store and session.turn_end is not None else self._released

    def _composing_left_s(self, session: _Session, now: float) -> float:
        return max(session.composing_until_s - now, 0.0)

    def _call_ended(self, session_id: str) -> _Session | None:
        """Count a call of the session as ended; the session when it was its last one in flight (which decides)."""
        session = self._session(session_id)
        if session.in_flight:
            session.in_flight -= 1
            self._in_flight -= 1
        session.last_end_s = self.clock()
        if session.in_flight:
            return None
        session.epoch += 1
        return session

    def _tool_hold_s(self, session_id: str) -> float:
        """Wall seconds to hold a session waiting on a tool: its tool-latency quantile, within the bounds."""
        expected_s = self.tool_latency.quantile_s(session_id)
        return self.settings.wall_s(min(max(expected_s, self.settings.tool_hold_min_s), self.settings.tool_hold_max_s))

    def abandon(self, session_id: str) -> None:
        """A call of ``session_id`` failed or was cancelled before its answer: no turn ended.

        A retry is likely within seconds, so the pages are held as for a tool
        wait, and the next arrival is neither a return nor a gap to learn from.
        """
        session = self._call_ended(session_id)
        if session is None:
            return
        session.retry = True
        now = self.clock()
        hold_s = self._tool_hold_s(session_id)
        self._hold(session, hold_s, "tool", then=self._released)
        self._expected_s[session_id] = now + hold_s

    # -- decisions --------------------------------------------------------

    def _costs_s(self, session: _Session) -> tuple[float, float]:
        """(break-even, reload) wall seconds for moving this session's pages out and back."""
        num_bytes = session.num_pages * self.bytes_per_page
        reload_s = num_bytes / self._in.bytes_per_s
        offload_s = num_bytes / self._out.bytes_per_s
        return offload_s + reload_s + self.settings.wall_s(self.settings.break_even_margin_s), reload_s

    def _predict(self, session: _Session, now: float) -> tuple[float, float]:
        """Predicted (point, lower quantile) of the whole gap, wall seconds from its start."""
        assert session.turn_end is not None and session.last_end_s is not None
        idle_s = now - session.last_end_s
        features = replace(session.turn_end, idle_so_far_s=idle_s / self.settings.time_scale)
        prediction = self.predictor.predict(session.session_id, features)
        return self.settings.wall_s(prediction.point_s), self.settings.wall_s(prediction.lower_s)

    def _prewarm_at(self, session: _Session, lower_s: float, reload_s: float) -> float:
        assert session.last_end_s is not None
        return session.last_end_s + lower_s - reload_s - self.settings.wall_s(self.settings.prewarm_lead_s)

    def _gone(self, session: _Session, now: float) -> bool:
        """Away past ``MAX_IDLE_S``: no more holds, looks or prewarms for this session."""
        assert session.last_end_s is not None
        return now - session.last_end_s > self.settings.wall_s(MAX_IDLE_S)

    def _planned_prewarm(self, session: _Session, now: float, lower_s: float, reload_s: float, off_s: float) -> float:
        """When the prewarm starts if the user stays away: ``_prewarm_at`` the predicted ``lower_s``, moved
        later while a prediction from the idle time at that moment says so (as the timer does when it
        fires), looking only as far as needed to tell whether it lies more than ``off_s`` from now."""
        start_s = max(now, self._prewarm_at(session, lower_s, reload_s))
        min_step_s = self.settings.wall_s(REPLAN_MIN_STEP_S)
        for _ in range(MAX_REPLANS):
            if start_s - now > off_s:
                break
            _, later_lower_s = self._predict(session, start_s)
            later_s = self._prewarm_at(session, later_lower_s, reload_s)
            if later_s < start_s + min_step_s:
                break
            start_s = later_s
        return start_s

    async def _look(self, session: _Session, epoch: int) -> None:
        if epoch != session.epoch:
            return
        self.counters.looks += 1
        waiting_s = self._composing_left_s(session, self.clock())
        if waiting_s > 0:  # an announced call is on its way: keep the pages for it
            self._hold(session, waiting_s, "tool", then=self._after_hold(session))
            return
        if self._gone(session, self.clock()):
            self._expected_s.pop(session.session_id, None)
            if self.has_store:
                await self._offload(session, epoch, math.inf)  # no prewarm: a return loads on demand
            else:
                session.phase = Phase.RELEASED
            return
        if self.has_store:
            now = self.clock()
            assert session.last_end_s is not None
            point_s, lower_s = self._predict(session, now)
            break_even_s, reload_s = self._costs_s(session)
            # Offload when the user should stay away past break-even and the pages would stay off
            # long enough to pay for the move (its break-even less the reload inside it).
            least_off_s = min_off_s(break_even_s, reload_s)
            prewarm_at_s = self._planned_prewarm(session, now, lower_s, reload_s, least_off_s)
            if point_s - (now - session.last_end_s) > break_even_s and prewarm_at_s - now > least_off_s:
                self._expected_s[session.session_id] = prewarm_at_s
                await self._offload(session, epoch, prewarm_at_s)
                return
            self._expected_s[session.session_id] = session.last_end_s + lower_s
        self.counters.turn_holds += 1
        hold_s = self.settings.wall_s(self.settings.turn_hold_s)
        then = self._look if self.has_store else self._released
        self._hold(session, hold_s, "turn", then=then)

    async def _offload(self, session: _Session, epoch: int, prewarm_at_s: float) -> None:
        session.phase = Phase.OFFLOADED
        session.offloaded_at_s = self.clock()
        session.offloaded_this_gap = True
        move = await self._engine(lambda engine: engine.offload_session(session.session_id))
        if move is not None:
            self._out.update(move)
            self.counters.offloads += 1
            self.counters.offloaded_pages += move.pages
        if epoch != session.epoch:
            return  # the user came back meanwhile; the call has taken over
        if move is None:  # failed: the pages stay where they are, held no more
            session.phase, session.offloaded_at_s = Phase.RELEASED, None
            self._expected_s.pop(session.session_id, None)
            return
        if math.isfinite(prewarm_at_s):
            self._at(session, prewarm_at_s, self._prewarm_due)

    async def _prewarm_due(self, session: _Session, epoch: int) -> None:
        if epoch != session.epoch:
            return
        now = self.clock()
        if not self._composing_left_s(session, now):  # unannounced: is the return still expected this soon?
            if self._gone(session, now):
                self._expected_s.pop(session.session_id, None)
                return  # the pages stay in the store; a return loads them on demand
            _, lower_s = self._predict(session, now)
            _, reload_s = self._costs_s(session)
            later_s = self._prewarm_at(session, lower_s, reload_s)
            if later_s > now + max(reload_s, self.settings.wall_s(REPLAN_MIN_STEP_S)):
                self.counters.replans += 1
                if math.isfinite(later_s):
                    self._expected_s[session.session_id] = later_s
                    self._at(session, later_s, self._prewarm_due)
                else:  # no return worth waiting for on the device: a return loads on demand
                    self._expected_s.pop(session.session_id, None)
                return
        session.phase = Phase.PREWARMING
        announced_s = self._composing_left_s(session, now)
        hold_s = max(self.settings.wall_s(self.settings.turn_hold_s), announced_s)
        move = await self._engine(
            lambda engine: engine.prewarm_session(session.session_id, hold_s * HOLD_SLACK, announced=announced_s > 0)
        )
        if move is not None:
            self._in.update(move)
            self.counters.prewarms += 1
            self.counters.prewarmed_pages += move.pages
        if epoch != session.epoch:
            return  # the user came back meanwhile; the call has taken over
        if session.offloaded_at_s is not None:
            session.off_device_s += self.clock() - session.offloaded_at_s
            session.offloaded_at_s = None
        if move is None:
            session.phase = Phase.RELEASED
            self._expected_s.pop(session.session_id, None)
            return
        session.phase = Phase.PREWARMED
        # An announced call is due any moment; a guessed return within the hold.
        self._expected_s[session.session_id] = self.clock() + (0.0 if announced_s > 0 else hold_s)
        self._at(session, self.clock() + hold_s, self._look)

    async def _released(self, session: _Session, epoch: int) -> None:
        if epoch == session.epoch:
            session.phase = Phase.RELEASED
            self._expected_s.pop(session.session_id, None)

    def next_activity_s(self) -> float:
        """Wall time of the next expected call or move of any session: ``-inf`` while a call is in flight."""
        if self._in_flight or self.engine.engine.has_unfinished_requests():
            return -math.inf
        return min(self._expected_s.values(), default=math.inf)

    def _hold(
        self,
        session: _Session,
        hold_s: float,
        kind: str,
        then: _Action,
    ) -> None:
        """Hold the session's pages a little longer than ``hold_s``, then run ``then``."""
        if session.phase is not Phase.PREWARMED:
            session.phase = Phase.HELD
        session_id = session.session_id
        self._tasks.spawn(self._call_quietly(lambda engine: engine.hold_session(session_id, hold_s * HOLD_SLACK, kind)))
        self._at(session, self.clock() + hold_s, then)

    # -- plumbing ---------------------------------------------------------

    def _at(self, session: _Session, when_s: float, action: _Action) -> None:
        self._cancel_timer(session)
        epoch = session.epoch
        delay_s = max(when_s - self.clock(), 0.0)
        session.timer = asyncio.get_running_loop().call_later(
            delay_s, lambda: self._tasks.spawn(action(session, epoch))
        )

    @staticmethod
    def _cancel_timer(session: _Session) -> None:
        if session.timer is not None:
            session.timer.cancel()
            session.timer = None

    async def _engine(self, fn: Callable[[LLMEngine], T]) -> T | None:
        """Run ``fn`` on the engine thread; None (logged, counted) if it fails: a move is never worth an error."""
        try:
            return await asyncio.wrap_future(self.engine.call(fn))
        except Exception as err:
            self.counters.failed_moves += 1
            logger.warning("session KV move failed: %s", err)
            return None

    async def _call_quietly(self, fn: Callable[[LLMEngine], object]) -> None:
        await self._engine(fn)

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.pop(session_id, None) or _Session(session_id, routing_key=session_key(session_id))
        self._sessions[session_id] = session  # most recently seen last
        session.seen_unix_s = time.time()
        while len(self._sessions) > MAX_SESSIONS:
            dropped_id, dropped = self._sessions.popitem(last=False)
            self._cancel_timer(dropped)
            self._expected_s.pop(dropped_id, None)
            self._in_flight -= dropped.in_flight
        return session

    def followed_sessions(self, limit: int = MAX_REPORTED_SESSIONS) -> dict[str, float]:
        """``session_key`` -> when a call was last seen (epoch seconds) for the ``limit`` sessions seen
        last, for the routing stats: announcements (which carry no pages to match) route to the replica
        that saw their session last."""
        recent = itertools.islice(reversed(self._sessions.values()), limit)
        return {session.routing_key: round(session.seen_unix_s, 3) for session in recent}

    def stats(self) -> dict[str, Any]:
        counters = {spec_field.name: getattr(self.counters, spec_field.name) for spec_field in fields(self.counters)}
        phases: dict[str, int] = {}
        for session in self._sessions.values():
            phases[session.phase.value] = phases.get(session.phase.value, 0) + 1
        return {
            **counters,
            "sessions": len(self._sessions),
            "phases": phases,
            "store_in_bytes_per_s": self._in.bytes_per_s,
            "store_out_bytes_per_s": self._out.bytes_per_s,
        }
