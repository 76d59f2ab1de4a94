"""The offline evaluation: fitting the prior, exact replay arithmetic, the CLI, and the real traces."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from rayturn.decode.lifecycle.hazard import HazardIdlePredictor
from rayturn.decode.lifecycle.lognormal import SessionIdlePredictor
from rayturn.decode.lifecycle.predictors import IdleModelConfig, IdlePrediction, IdlePrior, TurnEndFeatures
from rayturn.replay.idle_eval import cross_validate, evaluate, main
from rayturn.replay.idle_fit import fit_prior, turn_end_samples
from rayturn.replay.trace_files import load_traces
from rayturn.replay.traces import Call, Conversation

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"

NO_FEATURES = IdleModelConfig(features=())


def flat_prior(median_s: float = 100.0, log_std: float = 1.0, **config: float) -> IdlePrior:
    return IdlePrior(math.log(median_s), (), log_std, replace(NO_FEATURES, **config))


def conversation(conversation_id: str, gaps_s: list[float], finish_reason: str | None = "stop") -> Conversation:
    """One call per turn, each a second long, the user back ``gaps_s`` after each response."""
    calls, now_s = [], 0.0
    for gap_s in [*gaps_s, 0.0]:
        calls.append(Call(now_s, 1000, 50, "user", duration_s=1.0, finish_reason=finish_reason))
        now_s += 1.0 + gap_s
    return Conversation(conversation_id, "weka", tuple(calls))


def test_turn_end_samples_carry_history_and_turn_facts() -> None:
    samples = turn_end_samples(conversation("c", [100.0, 20.0]))
    assert [gap.duration_s for _, gap in samples] == [100.0, 20.0]
    first, second = (features for features, _ in samples)
    assert first.past_gaps_s == () and second.past_gaps_s == (100.0,)
    assert (second.turn_duration_s, second.calls_in_turn, second.last_output_tokens) == (1.0, 1, 50)
    assert second.finish_reason == "stop" and second.time_of_day_s is None


def test_fit_prior_learns_the_finish_reason_effect() -> None:
    training = [conversation(f"stop{i}", [300.0] * 6, "stop") for i in range(4)]
    training += [conversation(f"cut{i}", [10.0] * 6, None) for i in range(4)]
    prior = fit_prior(training, IdleModelConfig(features=("finish_stop",), ridge=1e-6))
    assert prior.num_gaps == 48
    assert math.exp(prior.intercept) == pytest.approx(10.0, rel=1e-3)
    assert math.exp(prior.weights[0]) == pytest.approx(30.0, rel=1e-3)
    assert prior.log_std == pytest.approx(0.1)  # no spread left, floored
    assert fit_prior([], NO_FEATURES) == IdlePrior(config=NO_FEATURES)


class FixedPredictor:
    """Says the same whatever it is asked: point 200 s, lower quantile 50 s."""

    def __init__(self) -> None:
        self.observed: list[float] = []

    def observe_gap(self, session_id: str, features: TurnEndFeatures, gap_s: float) -> None:
        self.observed.append(gap_s)

    def predict(self, session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        return IdlePrediction(max(200.0, features.idle_so_far_s), max(50.0, features.idle_so_far_s))


def test_evaluation_arithmetic_is_exact() -> None:
    fixed = FixedPredictor()
    result = evaluate([conversation("c", [100.0, 10.0])], lambda: fixed, break_even_s=30.0, reload_s=5.0)
    assert fixed.observed == [100.0, 10.0]
    assert (result["gaps"], result["idle_s"]) == (2, 110.0)
    # Both gaps offloaded at turn end, prewarm at 50 - 5 = 45 s: the 100 s gap is a hit (45 s off the
    # device); the user is back from the 10 s gap before the prewarm starts (wrong, and an on-demand load).
    for policy in ("predictor", "single_shot"):
        report = result[policy]
        assert report["idle_capture"] == pytest.approx(55.0 / 110.0)
        assert (report["offloads"], report["wrong_offloads"], report["early_returns"]) == (2, 1, 1)
        assert report["prewarm_hit_rate"] == 0.5 and report["mean_stall_s"] == 5.0
    timeout = result["timeout"]  # offload after 30 s, load on demand
    assert timeout["idle_capture"] == pytest.approx(70.0 / 110.0)
    assert (timeout["offloads"], timeout["wrong_offloads"], timeout["early_returns"]) == (1, 0, 1)
    assert timeout["prewarm_hit_rate"] == 0.0
    oracle = result["oracle"]  # offload the 100 s gap only, prewarm 5 s before the user
    assert oracle["idle_capture"] == pytest.approx(95.0 / 110.0)
    assert (oracle["offloads"], oracle["wrong_offloads"], oracle["prewarm_hit_rate"]) == (1, 0, 1.0)
    assert result["capture_vs_oracle"] == pytest.approx(55.0 / 95.0)
    assert result["predictions"] >= 2 and result["prediction_us_mean"] > 0


def test_second_looks_offload_again_and_move_the_prewarm() -> None:
    predictor = SessionIdlePredictor(flat_prior(1000.0, 0.5, lower_quantile=0.1))
    result = evaluate([conversation("c", [20_000.0])], lambda: predictor, break_even_s=30.0, reload_s=5.0)
    # The prewarm planned at the first lower quantile (~527 s) is moved out by later looks.
    assert result["single_shot"]["idle_capture"] == pytest.approx((1000 * math.exp(-0.5 * 1.2815516) - 5) / 20_000)
    assert result["predictor"]["idle_capture"] > 0.9
    assert result["oracle"]["idle_capture"] == pytest.approx(19_995 / 20_000)


def test_evaluate_rejects_a_reload_longer_than_break_even() -> None:
    with pytest.raises(ValueError, match="reload_s"):
        evaluate([], FixedPredictor, break_even_s=5.0, reload_s=10.0)


def test_cli_prints_a_table_and_json_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for index in range(4):
        gaps = [600.0, 20.0, 900.0, 15.0, 1200.0] if index % 2 else [30.0, 400.0, 10.0, 50.0]
        calls = conversation(f"trace_{index}", gaps).calls
        fixed = {"type": "n", "in": 100, "out": 5, "hash_ids": [1], "input_types": ["text"], "stop": "end_turn"}
        requests = [{"t": c.arrival_s, "api_time": c.duration_s, **fixed} for c in calls]
        (tmp_path / f"trace_{index}.json").write_text(json.dumps({"id": f"trace_{index}", "requests": requests}))
    assert main(["--traces", str(tmp_path), "--folds", "2", "--break-even-s", "60", "--reload-s", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert lines[0].startswith("18 think gaps")
    assert any(line.startswith("predictor") for line in lines)
    assert (summary["gaps"], summary["folds"], summary["break_even_s"], summary["reload_s"]) == (18, 2, 60.0, 2.0)
    assert 0.0 <= summary["predictor"]["idle_capture"] <= 1.0


def hazard(median_s: float = 100.0, log_std: float = 1.0, **config: float) -> HazardIdlePredictor:
    return HazardIdlePredictor(flat_prior(median_s, log_std, global_rate=0.0, **config))


def test_hazard_catches_regular_returns_the_log_normal_misses() -> None:
    # Quick tool-style replies between long, regular absences (a user back every ten minutes).
    gaps = [15.0, 12.0, 600.0, 18.0, 610.0, 14.0, 605.0, 11.0, 600.0, 16.0, 612.0, 13.0, 604.0, 15.0, 608.0]
    conversations = [conversation(f"c{index}", gaps) for index in range(4)]
    results = {
        name: evaluate(conversations, factory, break_even_s=5.0, reload_s=0.5)["predictor"]
        for name, factory in (
            ("hazard", lambda: HazardIdlePredictor(flat_prior(30.0, 1.5))),
            ("session", lambda: SessionIdlePredictor(flat_prior(30.0, 1.5, lower_quantile=0.02))),
        )
    }
    # The hazard predictor learns the ten-minute returns: most absences are spent off the device and
    # prewarmed in time. The log-normal's prewarm quantile lands in time for none of them.
    assert results["hazard"]["prewarm_hit_rate"] > 0.8
    assert results["hazard"]["warm_return_rate"] > 0.9
    assert results["hazard"]["idle_capture"] > 0.6
    assert results["session"]["prewarm_hit_rate"] < 0.1
    assert results["session"]["warm_return_rate"] < 0.5


def real_weka() -> list[Conversation]:
    folder = SHARED_TRACES / "weka"
    if not folder.exists():
        pytest.skip(f"real traces not found at {folder} (expected ../shared/traces next to the repository)")
    return [c for c in load_traces(sorted(folder.glob("trace_*.json"))[:16]) if c.think_gaps()]


def test_offline_evaluation_on_real_traces_is_sane() -> None:
    conversations = real_weka()
    summary = cross_validate(conversations, 4, break_even_s=30.0, reload_s=5.0)
    assert summary["gaps"] > 50
    for policy in ("predictor", "single_shot", "timeout", "oracle"):
        report = summary[policy]
        assert 0.0 <= report["idle_capture"] <= 1.0
        assert 0.0 <= report["prewarm_hit_rate"] <= 1.0
        assert report["wrong_offloads"] <= report["offloads"]
    oracle = summary["oracle"]
    for policy in ("predictor", "single_shot", "timeout"):
        assert oracle["idle_capture"] >= summary[policy]["idle_capture"]
        assert oracle["prewarm_hit_rate"] >= summary[policy]["prewarm_hit_rate"]
        assert oracle["wrong_offloads"] <= summary[policy]["wrong_offloads"]
    assert summary["predictor"]["idle_capture"] > summary["single_shot"]["idle_capture"]
    assert summary["prediction_us_mean"] < 200.0


def test_hazard_beats_the_log_normal_on_real_traces() -> None:
    conversations = real_weka()

    def point(predictor: str, **config: float) -> tuple[float, float]:
        summary = cross_validate(
            conversations, 4, 30.0, 5.0, predictor=predictor, config=replace(IdleModelConfig(), **config)
        )
        return summary["predictor"]["idle_capture"], summary["predictor"]["warm_return_rate"]

    # More idle time off the device and more warm returns at once than the log-normal's point.
    hazard_capture, hazard_warm = point("hazard", warm_return_worth_s=700.0)
    session_capture, session_warm = point("session", lower_quantile=0.01)
    assert hazard_capture > session_capture and hazard_warm > session_warm


def test_announced_returns_make_every_return_warm_offline() -> None:
    conversations = [conversation(f"c{i}", [8.0, 30.0, 600.0, 5000.0, 45.0, 12.0]) for i in range(4)]
    base = evaluate(conversations, lambda: hazard(100.0, 1.0), break_even_s=5.0, reload_s=0.5)["predictor"]
    announced = evaluate(
        conversations, lambda: hazard(100.0, 1.0), break_even_s=5.0, reload_s=0.5, announce_lead_s=2.0
    )["predictor"]
    assert announced["warm_return_rate"] == 1.0 and announced["early_returns"] == 0
    assert announced["prewarm_hit_rate"] == 1.0
    # Off from the turn end to 2 s before each return (a gap of 8 s: 5.5 s off would not pay, so it stays).
    idle_s = 4 * sum([8.0, 30.0, 600.0, 5000.0, 45.0, 12.0])
    assert announced["idle_capture"] == pytest.approx(
        4 * sum(g - 2.0 for g in (30.0, 600.0, 5000.0, 45.0, 12.0)) / idle_s, abs=0.002
    )
    assert announced["idle_capture"] > base["idle_capture"] and announced["warm_return_rate"] > base["warm_return_rate"]
    # Too short a lead for the reload: the predictor does not count on announcements (the same returns
    # are warm as without them); each one starts its prewarm, and the user waits out only the rest.
    late = evaluate(conversations, lambda: hazard(100.0, 1.0), break_even_s=5.0, reload_s=0.5, announce_lead_s=0.2)[
        "predictor"
    ]
    assert late["warm_return_rate"] == base["warm_return_rate"] and late["early_returns"] == base["early_returns"]
    assert base["mean_stall_s"] == pytest.approx(0.5) and late["mean_stall_s"] == pytest.approx(0.3)
    # A lead longer than the gap: the announcement comes at the turn end, and the pages stay for the call.
    long_lead = evaluate(
        [conversation("c", [8.0, 3000.0])], lambda: hazard(100.0, 1.0), break_even_s=5.0, reload_s=0.5,
        announce_lead_s=10.0,
    )["predictor"]  # fmt: skip
    assert long_lead["warm_return_rate"] == 1.0
    assert long_lead["idle_capture"] == pytest.approx((3000.0 - 10.0) / 3008.0)
    with pytest.raises(ValueError, match="announce_lead_s"):
        evaluate(conversations, lambda: hazard(), break_even_s=5.0, reload_s=0.5, announce_lead_s=-1.0)


def test_announced_returns_on_real_traces() -> None:
    summary = cross_validate(real_weka(), 4, 5.0, 0.5, announce_lead_s=2.0)["predictor"]
    assert summary["idle_capture"] >= 0.95 and summary["warm_return_rate"] >= 0.99
