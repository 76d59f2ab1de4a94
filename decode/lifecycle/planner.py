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
settings) plus a margin. The offload and prewarm decisions are those of
``policy.py``, which the offline evaluation replays too. Predictions come
from an ``IdlePredictor`` (``predictors.py``) in users' seconds;
``time_scale`` converts them to wall seconds (1 in production; a replay that
compresses time sets its factor). Every decision and its outcome is counted
(``stats()``), and each call's arrival reports the session's state
(``arrive()``): how long it was idle, how much of that its pages spent off
the device, how many are resident. Each decision also says when the session
is next expected (a tool result within its hold, a prewarm, the earliest
predicted return), so ``next_activity_s`` tells deferred background work
(``rayturn.decode.idle_work``) when the replica's next idle window closes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rayturn.engine.async_engine import AsyncEngine
from rayturn.messages import CallKind, NextStep

from .counters import LifecycleCounters
from .moves import SessionMoves
from .policy import REPLAN_MIN_STEP_S, MoveCosts, moves_later, offload_until_s
from .predictors import PREDICTORS, IdleModelConfig, IdlePredictor, IdlePrior, TurnEndFeatures
from .session import MAX_REPORTED_SESSIONS, Phase, SessionRecord, SessionTable
from .settings import LifecycleSettings
from .timers import Action, Timers
from .tool_latency import ToolLatencyModel

# A held session's TTL outlasts the planner's next look by this factor, so the look comes first.
HOLD_SLACK = 1.5
# A session away this long (users' seconds) is not planned for any more: its pages stay in the store.
MAX_IDLE_S = 24 * 3600.0


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
            predictor = PREDICTORS.create(settings.predictor, IdlePrior(config=config))
        self.predictor = predictor
        self.tool_latency = ToolLatencyModel()
        self.clock = clock
        self.counters = LifecycleCounters()
        self._sessions = SessionTable()
        self._moves = SessionMoves(engine, self.counters, settings.store_bandwidth_bytes_s)
        self._timers = Timers(clock)

    # -- calls ------------------------------------------------------------

    def arrive(self, session_id: str, call: CallKind | None) -> dict[str, Any]:
        """A call of ``session_id`` arrives: account for the gap before it; returns the session's state report.

        ``call``: the client's hint; without one a session whose last answer
        called tools continues its turn and any other call starts one.
        """
        session = self._sessions.seen(session_id)
        session.cancel_timer()
        now = self.clock()
        kind: CallKind = call or ("tool_continuation" if session.after == "tool" else "user")
        if session.retry and call is None:
            kind = "tool_continuation"  # a retry of an abandoned call goes on with its turn
        resident, recorded = self.engine.session_residency(session_id)
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
                off_s = session.off_device_until_s(now)
                report.update(idle_s=round(gap_s, 6), off_device_s=round(off_s, 6))
                # Announced in time: the announcement's hold still runs and the pages are back for it.
                announced = session.composing_left_s(now) > 0 and session.phase in (Phase.HELD, Phase.PREWARMED)
                self.counters.count_return(session, gap_s, off_s, announced)
                if session.turn_end is not None:
                    self.predictor.observe_gap(session_id, session.turn_end, gap_s / self.settings.time_scale)
            else:
                self.counters.tool_returns += 1
                self.tool_latency.observe(session_id, gap_s / self.settings.time_scale)
        self._sessions.start_call(session, kind, now)
        return report

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
        session.num_pages = (prompt_tokens + output_tokens) // self.engine.page_size
        session.turn_end = TurnEndFeatures(
            turn_duration_s=(now - session.turn_start_s) / self.settings.time_scale,
            calls_in_turn=session.calls_in_turn,
            last_output_tokens=output_tokens,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            time_of_day_s=time.time() % 86_400.0,
            announced_share=self.counters.announced_share(session),
        )
        if session.after == "tool":
            # Back within the hold, usually; a tool (or a user answering it) that takes longer gets a look.
            hold_s = self._tool_hold_s(session_id)
            self.counters.tool_holds += 1
            self._hold(session, hold_s, "tool", then=self._after_hold(session))
            self._sessions.expect(session_id, now + hold_s)
            return
        self._timers.spawn(self._look(session, session.epoch))

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
        self._sessions.expect(session_id, now)
        session.epoch += 1  # the plan for this gap (timers, a move under way) gives way
        session.cancel_timer()
        if session.phase in (Phase.OFFLOADED, Phase.PREWARMING):
            self._timers.spawn(self._prewarm_due(session, session.epoch))
        else:
            self._hold(session, hold_s, "tool", then=self._after_hold(session))
        return report

    def _after_hold(self, session: SessionRecord) -> Action:
        """What follows a hold: another look, or (no store, or no turn ended to plan from) a release."""
        return self._look if self.has_store and session.turn_end is not None else self._released

    def _call_ended(self, session_id: str) -> SessionRecord | None:
        """Count a call of the session as ended; the session when it was its last one in flight (which decides)."""
        session = self._sessions.seen(session_id)
        return session if self._sessions.end_call(session, self.clock()) else None

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
        self._sessions.expect(session_id, now + hold_s)

    # -- decisions --------------------------------------------------------

    def _costs(self, session: SessionRecord) -> MoveCosts:
        """Wall seconds of moving this session's pages out and back, as ``policy.py`` weighs them."""
        margin_s = self.settings.wall_s(self.settings.break_even_margin_s)
        lead_s = self.settings.wall_s(self.settings.prewarm_lead_s)
        return self._moves.costs(session.num_pages * self.bytes_per_page, margin_s, lead_s)

    def _predict(self, session: SessionRecord, now: float) -> tuple[float, float]:
        """Wall times of the user's predicted return (the point estimate) and of when the pages should be
        back on the device, from the idle time at ``now``."""
        assert session.turn_end is not None and session.last_end_s is not None
        idle_s = now - session.last_end_s
        features = replace(session.turn_end, idle_so_far_s=idle_s / self.settings.time_scale)
        prediction = self.predictor.predict(session.session_id, features)
        return (
            session.last_end_s + self.settings.wall_s(prediction.point_s),
            session.last_end_s + self.settings.wall_s(prediction.lower_s),
        )

    def _gone(self, session: SessionRecord, now: float) -> bool:
        """Away past ``MAX_IDLE_S``: no more holds, looks or prewarms for this session."""
        assert session.last_end_s is not None
        return now - session.last_end_s > self.settings.wall_s(MAX_IDLE_S)

    async def _look(self, session: SessionRecord, epoch: int) -> None:
        if epoch != session.epoch:
            return
        self.counters.looks += 1
        waiting_s = session.composing_left_s(self.clock())
        if waiting_s > 0:  # an announced call is on its way: keep the pages for it
            self._hold(session, waiting_s, "tool", then=self._after_hold(session))
            return
        if self._gone(session, self.clock()):
            self._sessions.expect_nothing(session.session_id)
            if self.has_store:
                await self._offload(session, epoch, math.inf)  # no prewarm: a return loads on demand
            else:
                session.phase = Phase.RELEASED
            return
        if self.has_store:
            now = self.clock()
            return_s, back_by_s = self._predict(session, now)
            costs = self._costs(session)
            min_step_s = self.settings.wall_s(REPLAN_MIN_STEP_S)
            prewarm_at_s = offload_until_s(
                now,
                return_s - now,
                back_by_s,
                lambda later: self._predict(session, later)[1],
                costs,
                costs.horizon_s(now, min_step_s),
                min_step_s,
            )
            if prewarm_at_s is not None:
                self._sessions.expect(session.session_id, prewarm_at_s)
                await self._offload(session, epoch, prewarm_at_s)
                return
            self._sessions.expect(session.session_id, back_by_s)
        self.counters.turn_holds += 1
        self._hold(session, self.settings.wall_s(self.settings.turn_hold_s), "turn", then=self._after_hold(session))

    async def _offload(self, session: SessionRecord, epoch: int, prewarm_at_s: float) -> None:
        session.goes_off_device(self.clock())
        move = await self._moves.offload(session.session_id)
        if epoch != session.epoch:
            return  # the user came back meanwhile; the call has taken over
        if move is None:  # failed: the pages stay where they are, held no more
            session.phase, session.offloaded_at_s = Phase.RELEASED, None
            self._sessions.expect_nothing(session.session_id)
            return
        if math.isfinite(prewarm_at_s):
            self._timers.at(session, prewarm_at_s, self._prewarm_due)

    async def _prewarm_due(self, session: SessionRecord, epoch: int) -> None:
        if epoch != session.epoch:
            return
        now = self.clock()
        if not session.composing_left_s(now):  # unannounced: is the return still expected this soon?
            if self._gone(session, now):
                self._sessions.expect_nothing(session.session_id)
                return  # the pages stay in the store; a return loads them on demand
            later_s = self._costs(session).prewarm_start_s(self._predict(session, now)[1])
            if moves_later(now, later_s, self.settings.wall_s(REPLAN_MIN_STEP_S)):
                self.counters.replans += 1
                if math.isfinite(later_s):
                    self._sessions.expect(session.session_id, later_s)
                    self._timers.at(session, later_s, self._prewarm_due)
                else:  # no return worth waiting for on the device: a return loads on demand
                    self._sessions.expect_nothing(session.session_id)
                return
        session.phase = Phase.PREWARMING
        announced_s = session.composing_left_s(now)
        hold_s = max(self.settings.wall_s(self.settings.turn_hold_s), announced_s)
        move = await self._moves.prewarm(session.session_id, hold_s * HOLD_SLACK, announced=announced_s > 0)
        if epoch != session.epoch:
            return  # the user came back meanwhile; the call has taken over
        session.back_on_device(self.clock())
        if move is None:
            session.phase = Phase.RELEASED
            self._sessions.expect_nothing(session.session_id)
            return
        session.phase = Phase.PREWARMED
        # An announced call is due any moment; a guessed return within the hold.
        self._sessions.expect(session.session_id, self.clock() + (0.0 if announced_s > 0 else hold_s))
        self._timers.at(session, self.clock() + hold_s, self._look)

    async def _released(self, session: SessionRecord, epoch: int) -> None:
        if epoch == session.epoch:
            session.phase = Phase.RELEASED
            self._sessions.expect_nothing(session.session_id)

    def _hold(self, session: SessionRecord, hold_s: float, kind: str, then: Action) -> None:
        """Hold the session's pages a little longer than ``hold_s``, then run ``then``."""
        if session.phase is not Phase.PREWARMED:
            session.phase = Phase.HELD
        self._timers.spawn(self._moves.hold(session.session_id, hold_s * HOLD_SLACK, kind))
        self._timers.at(session, self.clock() + hold_s, then)

    # -- reports ----------------------------------------------------------

    def next_activity_s(self) -> float:
        """Wall time of the next expected call or move of any session: ``-inf`` while a call is in flight."""
        if self._sessions.in_flight or self.engine.has_unfinished_requests():
            return -math.inf
        return self._sessions.next_expected_s()

    def followed_sessions(self, limit: int = MAX_REPORTED_SESSIONS) -> dict[str, float]:
        """``session_key`` -> when a call was last seen (epoch seconds) for the ``limit`` sessions seen
        last, for the routing stats: announcements (which carry no pages to match) route to the replica
        that saw their session last."""
        return self._sessions.followed(limit)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters.as_dict(),
            "sessions": len(self._sessions),
            "phases": self._sessions.phases(),
            "store_in_bytes_per_s": self._moves.in_bandwidth.bytes_per_s,
            "store_out_bytes_per_s": self._moves.out_bandwidth.bytes_per_s,
        }
