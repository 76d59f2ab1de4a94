"""The return-hazard idle predictor: holds while a return is likely, learns repeated returns, stays bounded."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest

from rayturn.decode.lifecycle.hazard import HAZARD_HISTORY_GAPS, HAZARD_PRIOR_ENTRIES, HazardIdlePredictor
from rayturn.decode.lifecycle.predictors import IdleModelConfig, IdlePrior, TurnEndFeatures

NO_FEATURES = IdleModelConfig(features=())


def flat_prior(median_s: float = 100.0, log_std: float = 1.0, **config: float) -> IdlePrior:
    return IdlePrior(math.log(median_s), (), log_std, replace(NO_FEATURES, **config))


def hazard(median_s: float = 100.0, log_std: float = 1.0, **config: float) -> HazardIdlePredictor:
    return HazardIdlePredictor(flat_prior(median_s, log_std, global_rate=0.0, **config))


def test_hazard_holds_a_new_session_while_a_return_is_likely_then_lets_go() -> None:
    predictor = hazard(100.0, 1.0, warm_return_worth_s=400.0)
    features = TurnEndFeatures()
    # A log-normal return is unlikely in the first seconds (off, back within ~10 s), likely
    # over the next minutes (the pages belong on the device: back by now), ...
    assert 5.0 < predictor.predict("new", features).lower_s < 15.0
    for idle_s in (20.0, 60.0, 120.0):
        prediction = predictor.predict("new", replace(features, idle_so_far_s=idle_s))
        assert prediction.lower_s == idle_s
        assert prediction.point_s > idle_s
    # ... and unlikely again in the tail, where its hazard falls: no return is worth waiting for on the device.
    late = predictor.predict("new", replace(features, idle_so_far_s=2000.0))
    assert late.lower_s == math.inf
    assert late.point_s > 2000.0

    # The cutoff moves with the worth of a warm return: worth more, held longer.
    def first_release_s(worth_s: float) -> float:
        candidate = hazard(100.0, 1.0, warm_return_worth_s=worth_s)
        return next(
            t for t in range(20, 100_000, 5) if candidate.predict("s", replace(features, idle_so_far_s=t)).lower_s > t
        )

    assert first_release_s(200.0) < first_release_s(400.0) < first_release_s(800.0)
    # Worth less than the residency ever costs: off at once, never prewarmed.
    assert hazard(100.0, 1.0, warm_return_worth_s=100.0).predict("new", features).lower_s == math.inf


def test_hazard_learns_a_repeated_return_time_and_prewarms_for_it() -> None:
    predictor = hazard(100.0, 1.0)
    features = TurnEndFeatures()
    for _ in range(6):
        predictor.observe_gap("regular", features, 600.0)
    # Off between the early returns and the one this session keeps making: back just before 600 s.
    after_hold = predictor.predict("regular", replace(features, idle_so_far_s=200.0))
    assert 450.0 < after_hold.lower_s < 600.0
    assert after_hold.point_s == pytest.approx(600.0, rel=0.1)
    # Still likely a little late; once well past it without a return, the pages go off again.
    assert predictor.predict("regular", replace(features, idle_so_far_s=700.0)).lower_s == 700.0
    assert predictor.predict("regular", replace(features, idle_so_far_s=2000.0)).lower_s == math.inf
    # Other sessions keep the prior's plan: on the device at 200 s, off for good well before 2000 s.
    assert predictor.predict("other", replace(features, idle_so_far_s=200.0)).lower_s == 200.0
    assert predictor.predict("other", replace(features, idle_so_far_s=1500.0)).lower_s == math.inf


def test_hazard_history_and_session_table_are_bounded() -> None:
    predictor = HazardIdlePredictor(flat_prior(global_rate=0.0), max_sessions=2)
    features, later = TurnEndFeatures(), TurnEndFeatures(idle_so_far_s=200.0)
    fresh = predictor.predict("never seen", later)
    for _ in range(HAZARD_HISTORY_GAPS + 10):
        predictor.observe_gap("a", features, 600.0)
    assert len(predictor._sessions["a"]) == HAZARD_HISTORY_GAPS
    learned = predictor.predict("a", later)  # its schedule is kept for the next look
    assert learned != fresh
    for session_id in ("b", "c"):
        predictor.observe_gap(session_id, features, 600.0)
    assert set(predictor._sessions) == {"b", "c"}
    # "a" is forgotten, the schedule it had with it.
    assert predictor.predict("a", later) == fresh
    # A new gap replaces what was kept from the older ones.
    before = predictor.predict("c", later)
    for _ in range(5):
        predictor.observe_gap("c", features, 20.0)
    assert predictor.predict("c", later) != before
    assert len(predictor._prior_masses) <= HAZARD_PRIOR_ENTRIES
    mass, beyond = predictor.masses("a", features)
    fresh_mass, fresh_beyond = predictor.masses("never seen", features)
    assert np.allclose(mass, fresh_mass) and beyond == fresh_beyond


def test_hazard_distribution_keeps_all_its_mass() -> None:
    # Gaps at a second (half of each kernel below the grid), two days (half above) and beyond,
    # under a prior centred low and narrow: nothing is lost, and nothing goes wrong in the tails.
    predictor = HazardIdlePredictor(flat_prior(2.0, 0.3, global_rate=0.0, gap_kernel_log_width=0.6))
    features = TurnEndFeatures()
    for gap_s in (1.0, 0.2, 1.0, 2.0e5, 1.0e7, 1.0, float("nan"), float("inf")):
        predictor.observe_gap("s", features, gap_s)
    assert len(predictor._sessions["s"]) == 6  # the gaps that are not numbers are left out
    mass, beyond = predictor.masses("s", features)
    assert mass.sum() + beyond == pytest.approx(1.0, abs=1e-3)  # up to the grid's sum for the narrow prior
    # Past the grid: half the kernel of the gap at its end, all of the one beyond (weights decay per gap).
    decay = 0.5 ** (1 / IdleModelConfig().session_half_life_gaps)
    weights = sum(decay**age for age in range(6))
    assert beyond == pytest.approx((0.5 * decay**2 + decay) / (weights + 2.0), rel=0.05)
    for idle_s in (0.0, 0.5, 3.0, 100.0, 5000.0, 1.0e5, 1.0e7):
        prediction = predictor.predict("s", replace(features, idle_so_far_s=idle_s))
        assert math.isfinite(prediction.point_s) and prediction.point_s >= idle_s
        assert prediction.lower_s >= idle_s
    # A session of one-second answers: back within seconds, and the pages stay for them.
    quick = HazardIdlePredictor(flat_prior(100.0, 1.0, global_rate=0.0))
    for _ in range(12):
        quick.observe_gap("q", features, 1.0)
    assert quick.predict("q", replace(features, idle_so_far_s=0.5)).point_s < 10.0
    assert quick.predict("q", replace(features, idle_so_far_s=2.0)).lower_s == 2.0


def test_hazard_config_is_checked() -> None:
    with pytest.raises(ValueError, match="warm_return_worth_s"):
        IdleModelConfig(warm_return_worth_s=0.0)
    with pytest.raises(ValueError, match="gap_kernel_log_width"):
        IdleModelConfig(gap_kernel_log_width=-1.0)


def test_hazard_prediction_is_cheap() -> None:
    predictor = HazardIdlePredictor(IdlePrior(4.5, (1.0, 0.5), 1.3, IdleModelConfig()))
    features = TurnEndFeatures(turn_duration_s=30.0, calls_in_turn=4)
    for index in range(1000):
        predictor.observe_gap(f"s{index % 100}", features, 100.0 + index)
    count = 5000
    start = time.perf_counter()
    for index in range(count):
        # Each session's first look computes its schedule, its later looks in the gap reuse it.
        predictor.predict(f"s{index % 100}", replace(features, idle_so_far_s=float(index % 7) * 50.0))
    per_prediction_us = (time.perf_counter() - start) / count * 1e6
    assert per_prediction_us < 200.0


def test_hazard_holds_less_for_sessions_whose_returns_come_announced() -> None:
    predictor = hazard(100.0, 1.0, warm_return_worth_s=400.0)
    features = TurnEndFeatures(idle_so_far_s=60.0)

    def first_release_s(share: float) -> float:
        return next(
            t
            for t in range(20, 100_000, 5)
            if predictor.predict("s", replace(features, idle_so_far_s=t, announced_share=share)).lower_s > t
        )

    # A return within the next minutes is worth waiting for on the device; announced half the
    # time, the wait is worth half as much, so the pages leave sooner.
    assert predictor.predict("s", features).lower_s == 60.0
    assert first_release_s(0.5) < first_release_s(0.0)
    # A session that always announces need never wait on the device: its pages come back on the announcement.
    assert predictor.predict("s", replace(features, announced_share=1.0)).lower_s == math.inf
    assert predictor.predict("s", replace(features, idle_so_far_s=0.0, announced_share=1.0)).lower_s == math.inf
    # The schedule cache keeps the shares apart.
    assert predictor.predict("s", features).lower_s == 60.0
