"""The idle-time predictors and the life cycle policy, replayed offline on recorded traces.

    python -m rayturn.replay.idle_eval --traces ../shared/traces/weka [--break-even-s 5 --reload-s 0.5]

Every think gap of the traces is replayed in time order against a predictor
(its prior fitted on the other folds, ``cross_validate``) and scored per
policy (``idle_gaps.py``): how much of the users' idle time the pages spend
off the device, and how many returns find them back. The ``predictor``
policy makes the live planner's decisions (``rayturn.decode.lifecycle.policy``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rayturn.decode.lifecycle.predictors import (
    FEATURES,
    MIN_GAP_S,
    PREDICTORS,
    IdleModelConfig,
    IdlePrediction,
    IdlePredictor,
    TurnEndFeatures,
)

from .idle_fit import fit_prior, turn_end_samples
from .idle_gaps import POLICIES, GapCosts, GapTally, oracle_gap, predictor_gap, timeout_gap
from .trace_files import load_traces
from .traces import Conversation

# Production idle predictors keep session KV off the device for this share of user idle time.
PRODUCTION_CAPTURE = (0.86, 0.90)


@dataclass(slots=True)
class _Replay:
    tallies: dict[str, GapTally] = field(default_factory=lambda: {name: GapTally() for name in POLICIES})
    prediction_ns: list[int] = field(default_factory=list)
    # Turn-end prediction quality: summed |log(gap / point)|, and gaps at or above the lower quantile.
    log_error_sum: float = 0.0
    lower_covered: int = 0

    def add(self, other: _Replay) -> None:
        for name, tally in self.tallies.items():
            tally.add(other.tallies[name])
        self.prediction_ns.extend(other.prediction_ns)
        self.log_error_sum += other.log_error_sum
        self.lower_covered += other.lower_covered


def _replay(conversations: Sequence[Conversation], predictor: IdlePredictor, costs: GapCosts) -> _Replay:
    result = _Replay()

    def timed(session_id: str, features: TurnEndFeatures) -> IdlePrediction:
        start = time.perf_counter_ns()
        prediction = predictor.predict(session_id, features)
        result.prediction_ns.append(time.perf_counter_ns() - start)
        return prediction

    # Returns announced, and returns, so far: the replica's share and each session's (as the planner keeps them).
    announced, returns = 0, 0
    for conversation in conversations:
        session_id = conversation.conversation_id
        for index, (features, gap) in enumerate(turn_end_samples(conversation)):
            if costs.announce_lead_s is not None:
                # Every return of this replay is announced, in time to bring the pages back when the lead
                # covers a reload; the share is the planner's estimate of that.
                in_time = costs.announce_lead_s >= costs.reload_s
                replica_share = announced / returns if returns else 0.0
                features = replace(features, announced_share=(index * in_time + replica_share) / (index + 1))
                announced += in_time
            returns += 1
            first = timed(session_id, features)
            gap_log_s = math.log(max(gap.duration_s, MIN_GAP_S))
            result.log_error_sum += abs(gap_log_s - math.log(max(first.point_s, MIN_GAP_S)))
            result.lower_covered += int(gap.duration_s >= first.lower_s)

            def again(
                idle_s: float, session_id: str = session_id, features: TurnEndFeatures = features
            ) -> IdlePrediction:
                return timed(session_id, replace(features, idle_so_far_s=idle_s))

            predictor_gap(result.tallies["predictor"], gap.duration_s, first, again, costs, second_looks=True)
            predictor_gap(result.tallies["single_shot"], gap.duration_s, first, again, costs, second_looks=False)
            timeout_gap(result.tallies["timeout"], gap.duration_s, costs)
            oracle_gap(result.tallies["oracle"], gap.duration_s, costs)
            predictor.observe_gap(session_id, features, gap.duration_s)
    return result


def _summary(result: _Replay, costs: GapCosts) -> dict[str, Any]:
    times_us = sorted(ns / 1000.0 for ns in result.prediction_ns)
    reports = {name: tally.report() for name, tally in result.tallies.items()}
    oracle_capture = reports["oracle"]["idle_capture"]
    gaps = result.tallies["oracle"].gaps
    return {
        **asdict(costs),
        "gaps": gaps,
        "idle_s": result.tallies["oracle"].idle_s,
        **reports,
        "capture_vs_oracle": reports["predictor"]["idle_capture"] / oracle_capture if oracle_capture else 0.0,
        "log_abs_error": result.log_error_sum / gaps if gaps else 0.0,
        "lower_coverage": result.lower_covered / gaps if gaps else 0.0,
        "production_capture": list(PRODUCTION_CAPTURE),
        "predictions": len(times_us),
        "prediction_us_mean": sum(times_us) / len(times_us) if times_us else 0.0,
        "prediction_us_p50": times_us[len(times_us) // 2] if times_us else 0.0,
        "prediction_us_p99": times_us[min(len(times_us) - 1, int(0.99 * len(times_us)))] if times_us else 0.0,
    }


def _costs(
    break_even_s: float,
    reload_s: float,
    timeout_s: float | None,
    hold_s: float | None,
    announce_lead_s: float | None = None,
) -> GapCosts:
    if min(break_even_s, reload_s) < 0 or reload_s > break_even_s:
        raise ValueError(f"need 0 <= reload_s <= break_even_s, got {reload_s} and {break_even_s}")
    if announce_lead_s is not None and not announce_lead_s >= 0:
        raise ValueError(f"announce_lead_s must be >= 0, got {announce_lead_s}")
    return GapCosts(
        break_even_s,
        reload_s,
        break_even_s if timeout_s is None else timeout_s,
        break_even_s if hold_s is None else hold_s,
        announce_lead_s,
    )


def evaluate(
    conversations: Sequence[Conversation],
    predictor_factory: Callable[[], IdlePredictor],
    break_even_s: float,
    reload_s: float,
    *,
    timeout_s: float | None = None,
    hold_s: float | None = None,
    announce_lead_s: float | None = None,
) -> dict[str, Any]:
    """Replay every think gap of ``conversations`` in time order (one predictor, sessions in turn).

    Policies: ``predictor`` follows the planner's life cycle (``idle_gaps.py``): at turn end
    and after every ``hold_s`` (default: break-even) the user stays away with
    the pages on the device, it offloads when the predicted idle left exceeds
    ``break_even_s`` and the pages would stay off long enough to pay for the
    move (``MoveCosts.min_off_s``); the prewarm starts ``reload_s`` before ``lower_s``,
    moved later by predictions from the idle time so far. ``single_shot`` is
    the plain rule: one look at turn end, the same offload test, prewarm at
    the first ``lower_s`` minus ``reload_s``. ``timeout``
    offloads every gap after ``timeout_s`` (default: break-even) and loads on
    demand. ``oracle`` offloads exactly the gaps longer than break-even and
    prewarms just in time.

    Per policy: ``idle_capture`` (share of all idle time the pages spend off
    the device, from offload to prewarm start or the user's return),
    ``prewarm_hit_rate`` (share of offloaded gaps whose pages were back before
    the user), ``wrong_offloads`` (offloads the user returned from within
    break-even), ``early_returns`` (on-demand loads) and their mean stall.

    ``announce_lead_s``: the client announces every return this long before
    the call (the user starts typing; at the turn end when the gap is
    shorter); the predictor policies (``predictor``, ``single_shot``) then
    start a prewarm at once or keep pages on the device until the call (the
    planner's ``composing_hold_s`` is assumed long enough), and the predictor
    sees the session's announced share (``TurnEndFeatures``). ``timeout`` and
    ``oracle`` ignore announcements.
    """
    costs = _costs(break_even_s, reload_s, timeout_s, hold_s, announce_lead_s)
    return _summary(_replay(conversations, predictor_factory(), costs), costs)


def cross_validate(
    conversations: Sequence[Conversation],
    folds: int,
    break_even_s: float,
    reload_s: float,
    *,
    predictor: str = "hazard",
    config: IdleModelConfig | None = None,
    timeout_s: float | None = None,
    hold_s: float | None = None,
    announce_lead_s: float | None = None,
) -> dict[str, Any]:
    """``evaluate`` with the prior fitted on the other folds (conversations dealt round-robin)."""
    if folds < 2 or len(conversations) < folds:
        raise ValueError(f"need at least 2 folds and a conversation per fold, got {folds} for {len(conversations)}")
    factory = PREDICTORS.factory(predictor)
    costs = _costs(break_even_s, reload_s, timeout_s, hold_s, announce_lead_s)
    total = _Replay()
    for fold in range(folds):
        training = [c for index, c in enumerate(conversations) if index % folds != fold]
        total.add(_replay(conversations[fold::folds], factory(fit_prior(training, config)), costs))
    summary = _summary(total, costs)
    summary.update(folds=folds, predictor_name=predictor, config=asdict(config or IdleModelConfig()))
    return summary


def keep_or_offload_capture(gaps_s: Sequence[float], warm_share: float) -> float:
    """The most idle capture any policy without prewarms can have with ``warm_share`` of returns warm,
    even one that knows every gap: without a prewarm a warm return keeps the pages on the device for
    its whole gap, so it keeps them through the shortest gaps and offloads every other at once. More
    capture at that share takes prewarms that land inside a user's absence."""
    ordered = sorted(gaps_s)
    total = sum(ordered)
    if not ordered or total <= 0.0:
        return 0.0
    return 1.0 - sum(ordered[: keep_or_offload_kept(len(ordered), warm_share)]) / total


def keep_or_offload_kept(num_gaps: int, warm_share: float) -> int:
    """How many of ``num_gaps`` gaps ``keep_or_offload_capture`` keeps the pages through: ``warm_share`` of them,
    rounded up."""
    return min(num_gaps, math.ceil(warm_share * num_gaps - 1e-9))


def format_table(summary: dict[str, Any]) -> str:
    """The evaluation as a text table, one row per policy."""
    lines = [
        f"{summary['gaps']} think gaps, {summary['idle_s'] / 3600:.1f} h of user idle; "
        f"break-even {summary['break_even_s']:g} s, reload {summary['reload_s']:g} s, "
        f"timeout {summary['timeout_s']:g} s, hold {summary['hold_s']:g} s",
        f"{'policy':<12}{'capture':>8}{'prewarm hit':>12}{'warm':>6}{'offloaded':>10}{'offloads':>9}{'wrong':>6}"
        f"{'early':>6}{'stall s':>8}",
    ]
    for name in POLICIES:
        r = summary[name]
        lines.append(
            f"{name:<12}{r['idle_capture']:>8.3f}{r['prewarm_hit_rate']:>12.3f}{r['warm_return_rate']:>6.2f}"
            f"{r['offloaded_gaps']:>10d}"
            f"{r['offloads']:>9d}{r['wrong_offloads']:>6d}{r['early_returns']:>6d}{r['mean_stall_s']:>8.2f}"
        )
    low, high = summary["production_capture"]
    lines.append(
        f"predictor capture is {summary['capture_vs_oracle']:.1%} of the oracle's; "
        f"production predictors capture {low:.0%}-{high:.0%} of user idle time"
    )
    lines.append(
        f"{summary['predictions']} predictions: mean {summary['prediction_us_mean']:.1f} us, "
        f"median {summary['prediction_us_p50']:.1f} us, p99 {summary['prediction_us_p99']:.1f} us"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    defaults = IdleModelConfig()
    parser = argparse.ArgumentParser(prog="python -m rayturn.replay.idle_eval", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", nargs="+", required=True, type=Path, help="trace files or folders")
    parser.add_argument("--break-even-s", type=float, default=30.0, help="idle time past which an offload pays")
    parser.add_argument("--reload-s", type=float, default=5.0, help="time to bring a session's KV back")
    parser.add_argument("--timeout-s", type=float, help="offload timeout of the baseline (default: break-even)")
    parser.add_argument(
        "--hold-s", type=float, help="pages on the device wait this long before a second look (default: break-even)"
    )
    parser.add_argument("--folds", type=int, default=5, help="cross-validation folds over conversations")
    parser.add_argument("--predictor", choices=PREDICTORS.names(), default="hazard")
    parser.add_argument("--features", default=",".join(defaults.features), help=f"comma list of {sorted(FEATURES)}")
    parser.add_argument(
        "--lower-quantile", type=float, default=defaults.lower_quantile, help="session, prior: the prewarm quantile"
    )
    parser.add_argument(
        "--warm-return-worth-s",
        type=float,
        default=defaults.warm_return_worth_s,
        help="hazard: seconds of device residency one warm return is worth",
    )
    parser.add_argument(
        "--announce-lead-s",
        type=float,
        default=None,
        help="the client announces every return this long before the call (default: never)",
    )
    args = parser.parse_args(argv)
    features = tuple(name for name in args.features.split(",") if name)
    config = replace(
        defaults,
        features=features,
        lower_quantile=args.lower_quantile,
        warm_return_worth_s=args.warm_return_worth_s,
    )
    conversations = [c for c in load_traces(args.traces) if c.think_gaps()]
    summary = cross_validate(
        conversations,
        min(args.folds, len(conversations)),
        args.break_even_s,
        args.reload_s,
        predictor=args.predictor,
        config=config,
        timeout_s=args.timeout_s,
        hold_s=args.hold_s,
        announce_lead_s=args.announce_lead_s,
    )
    print(format_table(summary))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
