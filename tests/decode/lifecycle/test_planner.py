"""The KV-residency planner's decisions, against a recording engine double (unit tests).

Time is compressed (``time_scale``) so the planner's real timers fire within
a fraction of a second; the predictor is a fixed stub, so every decision is
known in advance.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from rayturn.decode.lifecycle.planner import HOLD_SLACK, SessionPlanner
from rayturn.decode.lifecycle.predictors import IdlePrediction, TurnEndFeatures
from rayturn.decode.lifecycle.session import Phase
from rayturn.decode.lifecycle.settings import LifecycleSettings
from rayturn.decode.lifecycle.tool_latency import ToolLatencyModel
from rayturn.engine import SessionMove

PAGE_SIZE = 16
BYTES_PER_PAGE = 4096


class RecordingEngine:
    """The ``LLMEngine`` session methods the planner calls; records each call."""

    page_size = PAGE_SIZE

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.resident = (0, 0)

    def session_residency(self, session_id: str) -> tuple[int, int]:
        return self.resident

    def has_unfinished_requests(self) -> bool:
        return False

    def hold_session(self, session_id: str, ttl_s: float, kind: str = "tool") -> int:
        self.calls.append(("hold", session_id, round(ttl_s, 6), kind))
        return 3

    def offload_session(self, session_id: str) -> SessionMove:
        self.calls.append(("offload", session_id))
        return SessionMove(pages=3, resident_pages=0, bytes_moved=0, seconds=0.0)

    def prewarm_session(self, session_id: str, ttl_s: float, announced: bool = False) -> SessionMove:
        self.calls.append(("prewarm", session_id, round(ttl_s, 6)) + (("announced",) if announced else ()))
        return SessionMove(pages=3, resident_pages=3, bytes_moved=3 * BYTES_PER_PAGE, seconds=0.001)

    def kinds(self) -> list[str]:
        return [call[0] for call in self.calls]


class InlineAsyncEngine:
    """``AsyncEngine.call`` run inline, with the recording engine behind it (and the facade's members)."""

    def __init__(self) -> None:
        self.engine = RecordingEngine()

    @property
    def page_size(self) -> int:
        return self.engine.page_size

    def session_residency(self, session_id: str) -> tuple[int, int]:
        return self.engine.session_residency(session_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def call(self, fn: Callable[[Any], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(self.engine))
        return future


class FixedPredictor:
    def __init__(self, point_s: float, lower_s: float) -> None:
        self.prediction = IdlePrediction(point_s, lower_s)
        self.observed: list[float] = []
        self.asked: list[TurnEndFeatures] = []

    def observe_gap(self, session_id: str, features: TurnEndFeatures, gap_s: float) -> None:
        self.observed.append(gap_s)

    def predict(self, session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        self.asked.append(features)
        return IdlePrediction(
            max(self.prediction.point_s, features.idle_so_far_s), max(self.prediction.lower_s, features.idle_so_far_s)
        )


def planner(
    predictor: FixedPredictor, has_store: bool = True, **settings: Any
) -> tuple[SessionPlanner, RecordingEngine]:
    engine = InlineAsyncEngine()
    defaults: dict[str, Any] = {"time_scale": 0.001, "break_even_margin_s": 5.0, "prewarm_lead_s": 2.0}
    lifecycle = LifecycleSettings(**{**defaults, **settings})
    return (
        SessionPlanner(engine, lifecycle, BYTES_PER_PAGE, has_store=has_store, predictor=predictor),  # type: ignore[arg-type]
        engine.engine,
    )


async def settle(seconds: float) -> None:
    await asyncio.sleep(seconds)


def test_tool_call_holds_for_the_tool_latency_quantile_then_looks() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(1000.0, 500.0))
        report = plan.arrive("s", "user")
        assert report == {
            "call": "user",
            "state": "new",
            "idle_s": None,
            "off_device_s": None,
            "resident_pages": 0,
            "session_pages": 0,
        }
        plan.finish("s", "tool_calls", None, prompt_tokens=64, output_tokens=8)
        await settle(0.01)
        expected_s = min(max(ToolLatencyModel().quantile_s("s"), 5.0), 120.0) * 0.001
        assert engine.calls == [("hold", "s", round(expected_s * HOLD_SLACK, 6), "tool")]
        assert plan._sessions["s"].phase is Phase.HELD
        await settle(expected_s + 0.15)
        # The agent is not back within the hold: the planner looks, and the predictor says offload.
        assert engine.kinds() == ["hold", "offload"]
        assert plan._sessions["s"].phase is Phase.OFFLOADED
        report = plan.arrive("s", None)  # no hint: the answer called tools, so the turn goes on
        assert report["call"] == "tool" and report["idle_s"] is None
        assert plan.counters.tool_returns == 1 and plan.counters.tool_holds == 1

    asyncio.run(run())


def test_long_predicted_idle_offloads_then_prewarms_before_the_return() -> None:
    async def run() -> None:
        predictor = FixedPredictor(point_s=500.0, lower_s=300.0)  # wall: 0.5 s and 0.3 s
        plan, engine = planner(predictor, turn_hold_s=1000.0)  # no second look within the test
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.01)
        assert engine.kinds() == ["offload"]
        assert plan._sessions["s"].phase is Phase.OFFLOADED
        # Prewarm due at 300 s - 2 s lead - reload (11 pages at 1 GB/s: nothing) -> ~0.298 s wall.
        await settle(0.1)
        assert engine.kinds() == ["offload"]
        await settle(0.3)
        assert engine.kinds() == ["offload", "prewarm"]
        assert plan._sessions["s"].phase is Phase.PREWARMED
        engine.resident = (11, 11)
        report = plan.arrive("s", "user")
        assert report["state"] == "prewarmed"
        assert report["resident_pages"] == 11
        assert 0.4 <= report["idle_s"] < 1.0
        # Off the device from the offload (~0.0 s) to the prewarm (~0.298 s): most, not all, of the gap.
        assert 0.25 <= report["off_device_s"] < report["idle_s"] - 0.05
        counters = plan.counters
        assert (counters.returns, counters.offloaded_returns, counters.prewarm_hits, counters.early_returns) == (
            1,
            1,
            1,
            0,
        )
        assert counters.prewarmed_pages == 3 and counters.offloads == 1
        # The predictor learns the gap in users' seconds.
        assert len(predictor.observed) == 1 and 400.0 <= predictor.observed[0] < 1000.0

    asyncio.run(run())


def test_an_early_return_finds_the_pages_offloaded() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(point_s=1000.0, lower_s=500.0))
        plan.arrive("s", "user")
        ended = plan.clock()
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.02)
        waited = plan.clock() - ended
        report = plan.arrive("s", "user")
        assert report["state"] == "offloaded"
        # Off the device from the look right after the turn end: all of the idle time but the wait for it.
        assert report["idle_s"] - waited <= report["off_device_s"] <= report["idle_s"]
        assert plan.counters.early_returns == 1 and plan.counters.prewarm_hits == 0
        await settle(0.6)  # the cancelled prewarm timer must not fire
        assert engine.kinds() == ["offload"]

    asyncio.run(run())


def test_short_predicted_idle_holds_and_looks_again() -> None:
    async def run() -> None:
        # Point 3 s < break-even (5 s margin): hold for turn_hold_s (10 s -> 0.01 s wall), then look again.
        predictor = FixedPredictor(point_s=3.0, lower_s=1.0)
        plan, engine = planner(predictor, turn_hold_s=10.0)
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=32, output_tokens=4)
        await settle(0.005)
        assert engine.calls == [("hold", "s", round(0.01 * HOLD_SLACK, 6), "turn")]
        await settle(0.03)
        assert plan.counters.looks >= 2
        # Once the idle so far passes the point estimate, each look conditions on it.
        assert any(features.idle_so_far_s > 0 for features in predictor.asked)

    asyncio.run(run())


def test_without_a_store_a_turn_end_holds_once_then_releases() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(point_s=1000.0, lower_s=500.0), has_store=False, turn_hold_s=10.0)
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=32, output_tokens=4)
        await settle(0.05)
        assert engine.kinds() == ["hold"]
        assert plan._sessions["s"].phase is Phase.RELEASED

    asyncio.run(run())


def test_the_last_of_concurrent_calls_decides() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(point_s=1000.0, lower_s=500.0))
        plan.arrive("s", "user")
        plan.arrive("s", "tool")
        plan.finish("s", "stop", None, prompt_tokens=32, output_tokens=4)
        await settle(0.01)
        assert engine.calls == []
        plan.finish("s", "stop", "user", prompt_tokens=32, output_tokens=4)
        await settle(0.01)
        assert engine.kinds() == ["offload"]

    asyncio.run(run())


def test_next_activity_follows_the_sessions() -> None:
    async def run() -> None:
        plan, _ = planner(FixedPredictor(point_s=500.0, lower_s=300.0), turn_hold_s=1000.0)
        assert plan.next_activity_s() == math.inf  # nobody here
        plan.arrive("s", "user")
        assert plan.next_activity_s() == -math.inf  # a call in flight
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.01)
        # Offloaded: the next activity is the prewarm, ~0.298 s after the turn ended.
        ended_s = plan._sessions["s"].last_end_s
        assert ended_s is not None
        assert plan.next_activity_s() == pytest.approx(ended_s + 0.298, abs=0.01)
        plan.arrive("t", "user")
        plan.finish("t", "tool_calls", None, prompt_tokens=32, output_tokens=4)
        tool_s = min(max(ToolLatencyModel().quantile_s("t"), 5.0), 120.0) * 0.001
        assert plan.next_activity_s() == pytest.approx(plan._sessions["t"].last_end_s + tool_s, abs=0.001)

    asyncio.run(run())


def test_an_abandoned_call_holds_for_a_retry_that_is_no_return() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(point_s=1000.0, lower_s=500.0))
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.01)
        plan.arrive("s", "user")  # the next turn...
        assert plan.counters.returns == 1
        plan.abandon("s")  # ...fails before its answer
        await settle(0.01)
        tool_s = min(max(ToolLatencyModel().quantile_s("s"), 5.0), 120.0) * 0.001
        assert engine.calls[-1] == ("hold", "s", round(tool_s * HOLD_SLACK, 6), "tool")
        report = plan.arrive("s", None)  # the client retries at once
        assert report["call"] == "tool" and report["idle_s"] is None
        assert plan.counters.returns == 1  # the retry is not a return, and no gap was learnt
        assert plan.next_activity_s() == -math.inf

    asyncio.run(run())


def test_a_session_away_past_the_horizon_is_not_prewarmed() -> None:
    async def run() -> None:
        # time_scale 1e-6: the 24 h horizon is 0.0864 s of wall time.
        plan, engine = planner(FixedPredictor(point_s=1e6, lower_s=2e5), time_scale=1e-6)
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.4)  # the prewarm (due at ~0.2 s) finds the session gone
        assert engine.kinds() == ["offload"]
        assert plan.next_activity_s() == math.inf

    asyncio.run(run())


class ChangingPredictor(FixedPredictor):
    """Says its first answer until ``switch`` is set, then ``later``."""

    def __init__(self, point_s: float, lower_s: float, later: IdlePrediction) -> None:
        super().__init__(point_s, lower_s)
        self.later = later
        self.switch = False

    def predict(self, session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        if not self.switch:
            return super().predict(session_id, features)
        self.asked.append(features)
        return IdlePrediction(max(self.later.point_s, features.idle_so_far_s), self.later.lower_s)


def test_a_prewarm_no_longer_expected_leaves_the_pages_in_the_store() -> None:
    async def run() -> None:
        predictor = ChangingPredictor(1000.0, 300.0, later=IdlePrediction(5000.0, math.inf))
        plan, engine = planner(predictor)
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.05)
        assert engine.kinds() == ["offload"]
        predictor.switch = True  # by the time the prewarm timer fires, no return is worth waiting for
        await settle(0.4)
        assert engine.kinds() == ["offload"]
        session = plan._sessions["s"]
        assert session.phase is Phase.OFFLOADED
        assert plan.next_activity_s() == math.inf
        assert plan.counters.replans == 1
        await settle(0.3)  # and no timer is left to prewarm them later
        assert engine.kinds() == ["offload"]
        report = plan.arrive("s", "user")  # the user is back after all: an on-demand load
        assert report["state"] == "offloaded" and plan.counters.early_returns == 1

    asyncio.run(run())


def test_hazard_predictor_offloads_prewarms_for_a_learned_return_and_offloads_again() -> None:
    from rayturn.decode.lifecycle.hazard import HazardIdlePredictor
    from rayturn.decode.lifecycle.predictors import IdleModelConfig, IdlePrior

    async def run() -> None:
        prior = IdlePrior(math.log(100.0), (), 1.0, IdleModelConfig(features=(), global_rate=0.0))
        predictor = HazardIdlePredictor(prior)
        for _ in range(6):
            predictor.observe_gap("s", TurnEndFeatures(), 600.0)
        # 1 ms per user second: the usual return is 0.6 s away; looks every 10 user seconds.
        plan, engine = planner(predictor, turn_hold_s=10.0)  # type: ignore[arg-type]
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.3)
        assert "offload" in engine.kinds() and "prewarm" not in engine.kinds()
        await settle(0.35)  # ~650 user seconds: prewarmed for the usual return
        moves = [kind for kind in engine.kinds() if kind != "hold"]
        assert moves[-1] == "prewarm" and plan._sessions["s"].phase is Phase.PREWARMED
        await settle(1.6)  # well past it, the user has not come: off the device again
        moves = [kind for kind in engine.kinds() if kind != "hold"]
        assert moves[-2:] == ["prewarm", "offload"]
        assert plan._sessions["s"].phase is Phase.OFFLOADED

    asyncio.run(run())


def test_an_announced_return_prewarms_at_once_and_counts_as_announced() -> None:
    async def run() -> None:
        predictor = FixedPredictor(point_s=1000.0, lower_s=800.0)  # prewarm due ~0.8 s wall: too late here
        plan, engine = planner(predictor, turn_hold_s=10.0, composing_hold_s=60.0)
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.02)
        assert engine.kinds() == ["offload"]
        announced = plan.clock()
        assert plan.composing("s") == {"state": "offloaded"}
        await settle(0.01)
        waited = plan.clock() - announced
        # The prewarm starts now, and holds the pages for the announced call (60 s -> 0.06 s wall).
        # It loads as for an arrived call (idle sessions' holds give way).
        assert engine.calls[1][:2] == ("prewarm", "s") and engine.calls[1][3:] == ("announced",)
        assert (0.06 - waited) * HOLD_SLACK <= engine.calls[1][2] <= 0.06 * HOLD_SLACK  # what is left of it
        assert plan._sessions["s"].phase is Phase.PREWARMED
        report = plan.arrive("s", "user")
        assert report["state"] == "prewarmed"
        counters = plan.counters
        assert (counters.composing_hints, counters.announced_returns, counters.prewarm_hits) == (1, 1, 1)
        await settle(0.9)  # the planned prewarm's timer is gone
        assert engine.kinds() == ["offload", "prewarm"]
        # The next turn end tells the predictor this session's returns come announced.
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.005)
        assert predictor.asked[-1].announced_share == pytest.approx(1.0)

    asyncio.run(run())


def test_an_announced_call_keeps_held_pages_until_it_comes_or_the_hold_ends() -> None:
    async def run() -> None:
        # Short predicted idle: held for turn_hold_s (10 s -> 0.01 s wall), then a look.
        predictor = FixedPredictor(point_s=3.0, lower_s=1.0)
        plan, engine = planner(predictor, turn_hold_s=10.0, composing_hold_s=100.0)
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=32, output_tokens=4)
        await settle(0.005)
        assert plan.composing("s") == {"state": "held"}
        await settle(0.001)
        assert engine.calls[-1] == ("hold", "s", round(0.1 * HOLD_SLACK, 6), "tool")
        looks = plan.counters.looks
        await settle(0.05)
        assert plan.counters.looks == looks  # no look (and no offload) while the announced call is awaited
        predictor.prediction = IdlePrediction(point_s=1000.0, lower_s=800.0)
        await settle(0.1)
        # The call did not come within the hold: the plan resumes, and the long prediction offloads.
        assert plan.counters.looks > looks and engine.kinds()[-1] == "offload"

    asyncio.run(run())


def test_an_announcement_during_a_call_keeps_the_pages_when_it_ends() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(point_s=1000.0, lower_s=800.0), composing_hold_s=100.0)
        assert plan.composing("nobody") == {"state": "unknown"}
        plan.arrive("s", "user")
        announced = plan.clock()
        assert plan.composing("s") == {"state": "active"}  # the user types while the agent works
        await settle(0.01)
        assert engine.calls == []
        plan.finish("s", "stop", None, prompt_tokens=32, output_tokens=4)
        await settle(0.01)
        waited = plan.clock() - announced
        # The turn is over, but the announced call is coming: held for it, not offloaded.
        assert [call[0::3] for call in engine.calls] == [("hold", "tool")]
        # For what is left of the announcement's hold (100 s -> 0.1 s wall).
        assert (0.1 - waited) * HOLD_SLACK <= engine.calls[0][2] < 0.1 * HOLD_SLACK
        assert plan._sessions["s"].phase is Phase.HELD
        report = plan.arrive("s", "user")
        assert report["state"] == "held" and plan.counters.announced_returns == 1

    asyncio.run(run())


def test_an_announcement_after_an_abandoned_first_call_ends_in_a_release() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(point_s=1000.0, lower_s=800.0), composing_hold_s=20.0)
        plan.arrive("s", "user")
        plan.abandon("s")  # no turn ended: nothing to plan the gap from
        assert plan.composing("s") == {"state": "held"}
        await settle(0.05)  # past the announcement's hold (20 s -> 0.02 s wall)
        assert plan._sessions["s"].phase is Phase.RELEASED
        assert plan.next_activity_s() == math.inf
        assert "offload" not in engine.kinds()

    asyncio.run(run())


def test_an_announcement_redoes_a_guessed_prewarm_as_an_announced_one() -> None:
    async def run() -> None:
        plan, engine = planner(FixedPredictor(point_s=1000.0, lower_s=800.0), turn_hold_s=10.0)
        plan.arrive("s", "user")
        plan.finish("s", "stop", None, prompt_tokens=160, output_tokens=16)
        await settle(0.01)
        assert engine.kinds() == ["offload"]
        plan._sessions["s"].phase = Phase.PREWARMING  # as while a guessed prewarm is under way
        assert plan.composing("s") == {"state": "prewarming"}
        await settle(0.01)
        # The announced prewarm follows it on the engine thread: it loads what the guess left out,
        # as for an arrived call, and holds the pages as surely as a tool wait.
        assert engine.calls[-1][0] == "prewarm" and engine.calls[-1][3:] == ("announced",)
        assert plan._sessions["s"].phase is Phase.PREWARMED
        assert plan.next_activity_s() <= plan.clock()  # the call is due any moment

    asyncio.run(run())


def test_a_new_session_starts_from_the_replicas_announced_share() -> None:
    async def run() -> None:
        predictor = FixedPredictor(point_s=3.0, lower_s=1.0)
        plan, _ = planner(predictor, turn_hold_s=1000.0)
        for session_id, announce in (("a", True), ("b", False)):
            plan.arrive(session_id, "user")
            plan.finish(session_id, "stop", None, prompt_tokens=32, output_tokens=4)
            await settle(0.005)
            if announce:
                plan.composing(session_id)
            plan.arrive(session_id, "user")
        shares = {}
        for session_id in ("a", "b", "c"):
            if session_id == "c":
                plan.arrive("c", "user")
            plan.finish(session_id, "stop", None, prompt_tokens=32, output_tokens=4)
            await settle(0.005)
            shares[session_id] = predictor.asked[-1].announced_share
        # "a": 1 announced of 1, with the replica's half as one more; "b": 0 of 1, likewise; "c": the replica's.
        assert shares == {"a": pytest.approx(0.75), "b": pytest.approx(0.25), "c": pytest.approx(0.5)}

    asyncio.run(run())
