"""Idle-time predictors: cold start, session learning, quantiles, feature weights, the registry."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest

from rayturn.decode.lifecycle.lognormal import SessionIdlePredictor
from rayturn.decode.lifecycle.predictors import PREDICTORS, IdleModelConfig, IdlePrior, TurnEndFeatures

NO_FEATURES = IdleModelConfig(features=())


def flat_prior(median_s: float = 100.0, log_std: float = 1.0, **config: float) -> IdlePrior:
    return IdlePrior(math.log(median_s), (), log_std, replace(NO_FEATURES, **config))


def test_cold_start_uses_the_prior() -> None:
    predictor = SessionIdlePredictor(flat_prior(100.0, 1.0, lower_quantile=0.1))
    prediction = predictor.predict("new", TurnEndFeatures())
    assert prediction.point_s == pytest.approx(100.0)
    assert prediction.lower_s == pytest.approx(100.0 * math.exp(-1.2815516), rel=1e-6)


def test_default_predictor_without_a_fitted_prior() -> None:
    prediction = SessionIdlePredictor().predict("s", TurnEndFeatures())
    assert prediction.point_s == pytest.approx(127.0)
    assert 0 < prediction.lower_s < prediction.point_s


def test_learns_a_sessions_typical_gap_and_keeps_sessions_apart() -> None:
    predictor = SessionIdlePredictor(flat_prior(100.0, 1.0, global_rate=0.0))
    features = TurnEndFeatures()
    cold = predictor.predict("slow", features)
    predictor.observe_gap("slow", features, 900.0)
    # One gap moves the estimate a third of the way in log space (one gap against two of prior weight).
    assert predictor.predict("slow", features).point_s == pytest.approx(100.0 * 9.0 ** (1 / 3))
    for _ in range(30):
        predictor.observe_gap("slow", features, 900.0)
    learned = predictor.predict("slow", features)
    assert 600.0 < learned.point_s < 900.0
    # A steady session earns a narrower spread, so its lower quantile comes closer.
    assert learned.lower_s / learned.point_s > 2 * cold.lower_s / cold.point_s
    assert predictor.predict("other", features) == cold


def test_global_drift_moves_every_session() -> None:
    predictor = SessionIdlePredictor(flat_prior(100.0, 1.0, global_rate=0.1), learn_sessions=False)
    for index in range(50):
        predictor.observe_gap(f"s{index}", TurnEndFeatures(), 1000.0)
    assert predictor.predict("new", TurnEndFeatures()).point_s == pytest.approx(1000.0, rel=0.05)


def test_quantiles_are_ordered_and_conditioned_on_the_idle_so_far() -> None:
    predictor = SessionIdlePredictor(flat_prior(100.0, 1.2, lower_quantile=0.1))
    features = TurnEndFeatures()
    previous = predictor.predict("s", features)
    assert previous.lower_s < previous.point_s
    for idle_s in (10.0, 100.0, 1000.0, 10_000.0):
        prediction = predictor.predict("s", replace(features, idle_so_far_s=idle_s))
        assert idle_s <= prediction.lower_s <= prediction.point_s
        assert prediction.lower_s >= previous.lower_s and prediction.point_s >= previous.point_s
        previous = prediction
    # Far in the tail, what is left still grows with what has passed.
    assert previous.point_s > 11_000.0


def test_feature_weights_shift_the_centre() -> None:
    config = IdleModelConfig(features=("finish_stop",))
    predictor = SessionIdlePredictor(IdlePrior(math.log(10.0), (math.log(30.0),), 1.0, config))
    assert predictor.predict("s", TurnEndFeatures(finish_reason="stop")).point_s == pytest.approx(300.0)
    assert predictor.predict("s", TurnEndFeatures(finish_reason=None)).point_s == pytest.approx(10.0)


def test_config_rejects_unknown_features_and_bad_quantiles() -> None:
    with pytest.raises(ValueError, match="unknown idle features"):
        IdleModelConfig(features=("weather",))
    with pytest.raises(ValueError, match="lower_quantile"):
        IdleModelConfig(lower_quantile=0.7)


def test_session_table_is_bounded() -> None:
    predictor = SessionIdlePredictor(flat_prior(global_rate=0.0), max_sessions=2)
    for session_id in ("a", "b", "c"):
        predictor.observe_gap(session_id, TurnEndFeatures(), 1000.0)
    assert predictor.predict("a", TurnEndFeatures()).point_s == pytest.approx(100.0)
    assert predictor.predict("c", TurnEndFeatures()).point_s > 200.0


def test_prediction_is_cheap() -> None:
    predictor = SessionIdlePredictor(IdlePrior(4.5, (1.0, 0.5), 1.3, IdleModelConfig()))
    features = TurnEndFeatures(past_gaps_s=(100.0, 20.0), turn_duration_s=30.0, calls_in_turn=4)
    for index in range(1000):
        predictor.observe_gap(f"s{index % 100}", features, 100.0 + index)
    conditioned = replace(features, idle_so_far_s=300.0)
    count = 20_000
    start = time.perf_counter()
    for index in range(count):
        predictor.predict(f"s{index % 100}", conditioned if index % 2 else features)
    per_prediction_us = (time.perf_counter() - start) / count * 1e6
    # The target is < 50 us; the bound leaves room for slow, shared test machines.
    assert per_prediction_us < 200.0


def test_predictors_are_registered_by_name() -> None:
    assert PREDICTORS.names() == ["hazard", "prior", "session"]
    prior = IdlePrior(math.log(100.0), (), 1.0, replace(NO_FEATURES, global_rate=0.0))
    learning, fixed = PREDICTORS.create("session", prior), PREDICTORS.create("prior", prior)
    for predictor in (learning, fixed):
        predictor.observe_gap("s", TurnEndFeatures(), 900.0)
    # The session predictor learns the session's gap; the prior alone does not.
    assert learning.predict("s", TurnEndFeatures()).point_s > 150.0
    assert fixed.predict("s", TurnEndFeatures()).point_s == pytest.approx(100.0)
    assert type(PREDICTORS.create("hazard", prior)).__name__ == "HazardIdlePredictor"
    with pytest.raises(ValueError, match="unknown idle predictor 'oracle'"):
        PREDICTORS.factory("oracle")
