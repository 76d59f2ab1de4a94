"""The life cycle policy: the offload decision and the prewarm plan, with exact times."""

from __future__ import annotations

import math

from rayturn.decode.lifecycle.policy import (
    MAX_REPLANS,
    REPLAN_MIN_STEP_S,
    MoveCosts,
    moves_later,
    offload_until_s,
    plan_prewarm_s,
)


def test_costs_price_the_move() -> None:
    costs = MoveCosts(break_even_s=30.0, reload_s=5.0, lead_s=2.0)
    assert costs.min_off_s == 25.0  # break-even less the reload inside it
    assert MoveCosts(break_even_s=5.0, reload_s=4.0).min_off_s == 4.0  # never less than a reload
    assert costs.prewarm_start_s(100.0) == 93.0  # a reload and the lead before "back by"
    assert costs.horizon_s(10.0) == 10.0 + 25.0 + REPLAN_MIN_STEP_S


def test_a_replan_must_move_the_start_a_step() -> None:
    assert moves_later(10.0, 11.0)
    assert not moves_later(10.0, 10.5)
    assert moves_later(10.0, math.inf)
    assert not moves_later(10.0, 10.5, min_step_s=1.0) and moves_later(10.0, 10.5, min_step_s=0.5)


def test_the_plan_follows_later_predictions_up_to_the_horizon() -> None:
    costs = MoveCosts(break_even_s=30.0, reload_s=5.0)
    asked: list[float] = []

    def back_by_at(idle_s: float) -> float:
        asked.append(idle_s)
        return idle_s + 20.0  # always "back 20 s from now": each look moves the start 15 s later

    assert plan_prewarm_s(0.0, 20.0, back_by_at, costs, horizon_s=50.0) == 60.0
    assert asked == [15.0, 30.0, 45.0]  # the start reached the horizon: no more looks
    # Without replans (the single-shot rule) the first start stays; it never lies before now.
    assert plan_prewarm_s(0.0, 20.0, back_by_at, costs, horizon_s=50.0, max_replans=0) == 15.0
    assert plan_prewarm_s(40.0, 20.0, back_by_at, costs, horizon_s=0.0) == 40.0
    # A prediction that moves the start less than a step leaves it.
    assert plan_prewarm_s(0.0, 20.0, lambda idle_s: 20.5, costs, horizon_s=100.0) == 15.0
    # A predictor that keeps moving it is bounded.
    steps = plan_prewarm_s(0.0, 20.0, lambda idle_s: idle_s + 6.0, costs, horizon_s=math.inf)
    assert steps == 15.0 + MAX_REPLANS * 1.0


def test_offload_when_the_idle_left_pays_and_the_pages_stay_off_long_enough() -> None:
    costs = MoveCosts(break_even_s=30.0, reload_s=5.0)

    def stays(idle_s: float) -> float:
        return 100.0  # back by 100 s, whenever asked

    horizon_s = costs.horizon_s(0.0)
    assert offload_until_s(0.0, 200.0, 100.0, stays, costs, horizon_s) == 95.0
    # Idle left within break-even: the pages stay.
    assert offload_until_s(0.0, 30.0, 100.0, stays, costs, horizon_s) is None
    # Back by 29 s: a prewarm at 24 s would leave the pages off for less than min_off_s (25 s).
    assert offload_until_s(0.0, 200.0, 29.0, lambda idle_s: 29.0, costs, horizon_s) is None
    # ... unless a later look says later: the plan moves the prewarm past min_off_s, and the move pays.
    assert offload_until_s(0.0, 200.0, 29.0, lambda idle_s: idle_s + 40.0, costs, horizon_s) == 59.0
    # No return worth waiting for on the device: off, with no prewarm.
    assert offload_until_s(0.0, 200.0, math.inf, lambda idle_s: math.inf, costs, horizon_s) == math.inf
