"""The per-step cost model, its Shapley split (exact and sampled) against enumeration, and its calibration."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import pytest

from rayturn.engine.energy import (
    CostCoefficients,
    OnlineCalibrator,
    RequestWork,
    exact_shapley,
    proportional_split,
    shapley_split,
)
from rayturn.engine.energy.cost_model import PARAMETERS

MODEL = CostCoefficients(
    fixed_j=1.0, token_j=0.01, knee_tokens=64, request_j=0.05, context_j=1e-4, attention_j=1e-5, page_move_j=0.05
)


def enumerated(works: Seq[RequestWork], coefficients: CostCoefficients) -> np.ndarray:
    return exact_shapley(lambda players: coefficients.cost_j([works[i] for i in players]), len(works))


def mixed_step(rng: np.random.Generator, num_decodes: int, num_prefills: int) -> list[RequestWork]:
    decodes = [
        RequestWork.chunk(f"d{i}", int(rng.integers(10, 4000)), 1, int(rng.integers(0, 3))) for i in range(num_decodes)
    ]
    prefills = [
        RequestWork.chunk(f"p{i}", int(rng.integers(0, 2000)), int(rng.integers(2, 200))) for i in range(num_prefills)
    ]
    return decodes + prefills


def test_chunk_work_counts_causal_attention_and_rejects_an_empty_chunk() -> None:
    assert RequestWork.chunk("r", 0, 3) == RequestWork("r", 3, 3, 1 + 2 + 3)
    assert RequestWork.chunk("r", 100, 1, pages_moved=2) == RequestWork("r", 1, 101, 101, 2)
    assert RequestWork.chunk("r", 10, 2).attended_tokens == 11 + 12
    with pytest.raises(ValueError, match="at least one new token"):
        RequestWork("r", 0, 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        CostCoefficients(-1.0, 0.0, 1, 0.0, 0.0, 0.0, 0.0)


def test_coalition_cost_shares_the_fixed_cost_and_the_weights_read_up_to_the_knee() -> None:
    decode = RequestWork("a", 1, 500, 500, 0)
    prefill = RequestWork("b", 100, 100, 5050, 2)
    decode_own = 0.05 + 1e-4 * 500 + 1e-5 * 500
    prefill_own = 0.05 + 1e-4 * 100 + 1e-5 * 5050 + 0.05 * 2
    assert MODEL.cost_j([]) == 0.0
    assert MODEL.cost_j([decode]) == pytest.approx(1.0 + 0.01 * 64 + decode_own)
    assert MODEL.cost_j([decode, prefill]) == pytest.approx(1.0 + 0.01 * 101 + decode_own + prefill_own)


@pytest.mark.parametrize("seed", range(6))
def test_exact_split_equals_enumeration_and_adds_up_to_the_step(seed: int) -> None:
    rng = np.random.default_rng(seed)
    works = mixed_step(rng, num_decodes=int(rng.integers(1, 7)), num_prefills=int(rng.integers(1, 4)))
    split = shapley_split(works, MODEL, rng)
    assert split.exact
    np.testing.assert_allclose(split.values_j, enumerated(works, MODEL), rtol=1e-9)
    assert sum(split.values_j) == pytest.approx(MODEL.cost_j(works))


@pytest.mark.parametrize(
    "tokens",
    [[1, 1, 1, 1], [100, 200, 70], [1, 3, 5, 7], [64, 1, 1], [40, 40, 40], [30]],
    ids=["memory", "compute", "mixed", "at-knee", "alike-past-knee", "alone"],
)
def test_every_regime_matches_enumeration(tokens: list[int]) -> None:
    works = [RequestWork.chunk(str(i), 50 * i, count) for i, count in enumerate(tokens)]
    np.testing.assert_allclose(
        shapley_split(works, MODEL, np.random.default_rng(0)).values_j, enumerated(works, MODEL), rtol=1e-9
    )


def test_a_remembered_composition_follows_new_coefficients() -> None:
    works = [RequestWork.chunk(str(i), 10 * i, count) for i, count in enumerate([1, 1, 5, 90])]
    refitted = MODEL.with_parameters([0.5, 0.02, 0.01, 0.0, 0.0, 0.0], knee_tokens=32)
    for coefficients in (MODEL, refitted, MODEL):  # the second MODEL split is served from memory
        np.testing.assert_allclose(
            shapley_split(works, coefficients, np.random.default_rng(0)).values_j,
            enumerated(works, coefficients),
            rtol=1e-9,
        )


def test_decodes_beside_a_prefill_chunk_pay_more_than_their_tokens_and_equal_ones_pay_alike() -> None:
    works = [RequestWork.chunk(f"d{i}", 1000, 1) for i in range(4)] + [RequestWork.chunk("p", 0, 60)]
    split = shapley_split(works, MODEL, np.random.default_rng(0)).values_j
    by_tokens = proportional_split(works, sum(split))
    assert np.allclose(split[:4], split[0])
    assert split[0] > 5 * by_tokens[0]  # the fixed cost and the weights' read are shared, not paid by tokens
    assert split[4] < by_tokens[4]


def test_sampled_split_adds_up_exactly_and_lands_near_the_exact_values() -> None:
    rng = np.random.default_rng(7)
    works = mixed_step(rng, num_decodes=40, num_prefills=6)
    exact = shapley_split(works, MODEL, rng, max_exact_coalitions=10**9)
    sampled = shapley_split(works, MODEL, np.random.default_rng(1), max_exact_coalitions=1, num_permutations=256)
    assert exact.exact and not sampled.exact
    assert sum(sampled.values_j) == pytest.approx(MODEL.cost_j(works))
    sampled_shares, exact_shares = np.array(sampled.values_j), np.array(exact.values_j)
    assert np.abs(sampled_shares / sampled_shares.sum() - exact_shares / exact_shares.sum()).sum() < 0.05


def test_exact_shapley_of_a_known_game() -> None:
    # Airport game: each pays for the runway up to its own plane, shared with the longer ones.
    runways = [1.0, 3.0, 6.0]
    values = exact_shapley(lambda players: max((runways[i] for i in players), default=0.0), 3)
    np.testing.assert_allclose(values, [1 / 3, 1 / 3 + 2 / 2, 1 / 3 + 1 + 3])
    with pytest.raises(ValueError, match="too many"):
        exact_shapley(lambda players: 0.0, 17)


def synthetic_steps(rng: np.random.Generator, num_steps: int) -> list[list[RequestWork]]:
    return [
        mixed_step(rng, num_decodes=int(rng.integers(1, 12)), num_prefills=int(rng.integers(0, 3)))
        for _ in range(num_steps)
    ]


def test_calibration_recovers_the_coefficients_and_the_knee() -> None:
    defaults = CostCoefficients(5.0, 1.0, 1, 0.0, 0.0, 0.0, 0.0)
    calibrator = OnlineCalibrator(defaults, window_steps=256, refit_every=64, min_steps=64)
    for works in synthetic_steps(np.random.default_rng(3), 256):
        calibrator.observe(works, MODEL.cost_j(works))
    fitted = calibrator.coefficients
    assert calibrator.num_fits == 4
    assert fitted.knee_tokens == MODEL.knee_tokens
    for name in PARAMETERS:
        assert getattr(fitted, name) == pytest.approx(getattr(MODEL, name), rel=1e-3), name


def test_calibration_keeps_coefficients_non_negative_and_prefers_the_additive_model_when_steps_are_compute_bound() -> (
    None
):
    additive = CostCoefficients(0.0, 0.02, 1, 0.0, 0.0, 0.0, 0.0)
    calibrator = OnlineCalibrator(MODEL, window_steps=128, refit_every=128, min_steps=128)
    rng = np.random.default_rng(4)
    for _ in range(128):
        works = [RequestWork.chunk(str(i), int(rng.integers(0, 500)), int(rng.integers(1, 300))) for i in range(3)]
        calibrator.observe(works, additive.cost_j(works) * (1.0 + 0.01 * rng.standard_normal()))
    fitted = calibrator.coefficients
    assert min(getattr(fitted, name) for name in PARAMETERS) >= 0.0
    assert fitted.token_j == pytest.approx(0.02, rel=0.05)
    assert fitted.knee_tokens <= 8  # below every step's total: the fit does not invent sharing


def test_calibrator_rejects_a_window_smaller_than_its_first_fit() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        OnlineCalibrator(MODEL, window_steps=8, min_steps=16)
