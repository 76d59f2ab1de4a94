"""How much idle capture can be had with how many warm returns, on the Claude Code traces.

Idle capture (the share of user idle time a session's KV spends off the
device) and prewarm hits (the share of returns that find it back) pull
against each other: bringing pages back earlier catches more returns and
gives up idle time. This sweeps that trade-off for both idle predictors of
``rayturn.decode.lifecycle`` (cross-validated by conversation,
``rayturn.replay.idle_eval``): ``hazard`` (the
default) over the worth of a warm return, ``session`` (log-normal) over its
prewarm quantile. References in the same run:

- ``hindsight``: for each session, the best "keep the pages for X seconds,
  then offload, load on demand" rule, X chosen *knowing all of that
  session's gaps* (no causal policy picks better thresholds), swept over
  the weight of a warm return against captured idle time.
- ``keep_or_offload``: the best any policy without prewarms can do, even
  one that knows every gap: keep the pages through the shortest gaps, offload
  the rest at once. Whatever lies beyond it needs prewarms that land inside
  a user's absence, before the user is back.
- ``oracle``: knows every gap; offloads those past break-even and prewarms
  just in time.

And ``announced``: the ``hazard`` default when the client announces every
return some seconds before its call (``POST /v1/sessions/{id}/prewarm`` when
the user starts typing), swept over that lead: the signal the traces lack.

A warm return is any return that finds the pages resident, the prewarmed
and the never-offloaded alike.

Figures: per point, idle capture, the share of offloaded gaps prewarmed in
time (``prewarm_hit``) and the share of all returns that found their pages
resident (``warm_return``). The last line is one JSON object; a PNG of the
frontier goes next to the JSON under ``--out``.

    python bench/idle_frontier.py [--quick] [--traces DIR] [--break-even-s 5] [--reload-s 0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rayturn.decode.lifecycle.predictors import IdleModelConfig
from rayturn.replay.harness import Progress, emit, pyplot, save_figure
from rayturn.replay.idle_eval import cross_validate, keep_or_offload_capture, keep_or_offload_kept
from rayturn.replay.idle_fit import turn_end_samples
from rayturn.replay.paths import DEFAULT_TRACES, RESULTS_DIR
from rayturn.replay.trace_files import load_traces

QUANTILES = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.05)
QUICK_QUANTILES = (0.001, 0.005, 0.02)
# Worth of a warm return in seconds of device residency, for the hazard predictor.
WORTHS_S = (100, 150, 200, 250, 300, 350, 400, 500, 700, 1000, 2000)
QUICK_WORTHS_S = (200, 400, 1000)
# Seconds between a client's announcement of a return and the call.
ANNOUNCE_LEADS_S = (0.5, 1, 2, 5, 10, 30, 60)
QUICK_ANNOUNCE_LEADS_S = (2, 10)
# Shares of warm returns at which the keep-or-offload bound is read.
KEEP_SHARES = (0.5, 0.6, 0.7, 0.8, 0.85, 0.88, 0.9, 0.92, 0.95, 0.98, 1.0)
# Weight of one warm return, in seconds of captured idle, for the hindsight rule.
WEIGHTS_S = (10, 30, 100, 200, 300, 500, 1000, 2000, 3000, 10_000)
TARGET = (0.90, 0.90)  # idle capture, warm returns


def hindsight_hold(gaps_by_session: Sequence[Sequence[float]], weight_s: float) -> dict[str, float]:
    """Each session's best hold-then-offload threshold for ``weight_s``, chosen knowing its gaps."""
    captured = warm = 0.0
    for gaps in gaps_by_session:
        best = (-1.0, 0.0, 0)
        for threshold in (0.0, *sorted(gaps)):
            session_captured = sum(max(0.0, gap - threshold) for gap in gaps)
            session_warm = sum(1 for gap in gaps if gap <= threshold)
            score = session_captured + weight_s * session_warm
            if score > best[0]:
                best = (score, session_captured, session_warm)
        captured += best[1]
        warm += best[2]
    total_idle = sum(sum(gaps) for gaps in gaps_by_session)
    total_gaps = sum(len(gaps) for gaps in gaps_by_session)
    return {"weight_s": weight_s, "idle_capture": captured / total_idle, "warm_return": warm / total_gaps}


def keep_or_offload(gaps: Sequence[float], warm_share: float) -> dict[str, float]:
    """The keep-or-offload bound at ``warm_share`` (``keep_or_offload_capture``), as a frontier point."""
    return {
        "warm_share": warm_share,
        "idle_capture": keep_or_offload_capture(gaps, warm_share),
        "warm_return": keep_or_offload_kept(len(gaps), warm_share) / len(gaps) if gaps else 0.0,
    }


def predictor_point(summary: dict[str, Any], knob: str, value: float) -> dict[str, float]:
    policy = summary["predictor"]
    return {
        knob: value,
        "idle_capture": policy["idle_capture"],
        "prewarm_hit": policy["prewarm_hit_rate"],
        "warm_return": policy["warm_return_rate"],
    }


def balanced(points: Sequence[dict[str, float]]) -> dict[str, float]:
    """The point whose lesser share (capture or warm returns) is largest."""
    return max(points, key=lambda p: min(p["idle_capture"], p["warm_return"]))


def meets(point: dict[str, float]) -> bool:
    return point["idle_capture"] >= TARGET[0] and point["warm_return"] >= TARGET[1]


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    curves = (
        ("hazard", "o-"),
        ("session", "^-"),
        ("hindsight", "s--"),
        ("keep_or_offload", "k:"),
        ("announced", "D-"),
    )
    for name, marker in curves:
        points = sorted(result[name], key=lambda p: p["idle_capture"])
        axes.plot([p["idle_capture"] for p in points], [p["warm_return"] for p in points], marker, label=name)
    oracle = result["oracle"]
    axes.plot([oracle["idle_capture"]], [oracle["warm_return"]], "k*", markersize=12, label="oracle")
    axes.axvline(TARGET[0], color="grey", linewidth=0.8)
    axes.axhline(TARGET[1], color="grey", linewidth=0.8)
    axes.fill_between([TARGET[0], 1.0], TARGET[1], 1.0, color="green", alpha=0.08, label="target")
    axes.set_xlabel("idle capture (share of user idle time off the device)")
    axes.set_ylabel("warm returns (share of returns with pages resident)")
    axes.set_title(f"{result['gaps']} think gaps, break-even {result['break_even_s']:g} s")
    axes.set_xlim(0.6, 1.01)
    axes.set_ylim(0.0, 1.01)
    axes.legend(loc="lower left")
    save_figure(plt, figure, path, dpi=120)
    return True


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="trace file or folder")
    parser.add_argument("--quick", action="store_true", help="three prewarm quantiles, two folds")
    parser.add_argument("--break-even-s", type=float, default=5.0, help="idle time past which an offload pays")
    parser.add_argument("--reload-s", type=float, default=0.5, help="time to bring a session's KV back")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if not args.traces.exists():
        print(f"no traces at {args.traces}; pass --traces", file=sys.stderr)
        return 2
    conversations = [c for c in load_traces([args.traces]) if c.think_gaps()]
    gaps_by_session = [[gap.duration_s for _, gap in turn_end_samples(c)] for c in conversations]
    gaps_by_session = [gaps for gaps in gaps_by_session if gaps]
    quantiles = QUICK_QUANTILES if args.quick else QUANTILES
    worths = QUICK_WORTHS_S if args.quick else WORTHS_S
    leads = QUICK_ANNOUNCE_LEADS_S if args.quick else ANNOUNCE_LEADS_S
    folds = 2 if args.quick else args.folds
    progress = Progress("idle frontier", len(quantiles) + len(worths) + len(leads))
    curves: dict[str, list[dict[str, float]]] = {"hazard": [], "session": []}
    oracle = None
    sweeps = [("hazard", "warm_return_worth_s", float(worth)) for worth in worths]
    sweeps += [("session", "lower_quantile", quantile) for quantile in quantiles]
    for predictor, knob, value in sweeps:
        config = replace(IdleModelConfig(), **{knob: value})
        summary = cross_validate(
            conversations, folds, args.break_even_s, args.reload_s, predictor=predictor, config=config
        )
        curves[predictor].append(predictor_point(summary, knob, value))
        oracle = summary["oracle"]
        progress.advance()
    assert oracle is not None
    announced = []
    for lead_s in leads:
        summary = cross_validate(conversations, folds, args.break_even_s, args.reload_s, announce_lead_s=lead_s)
        announced.append(predictor_point(summary, "announce_lead_s", float(lead_s)))
        progress.advance()
    hindsight = [hindsight_hold(gaps_by_session, weight) for weight in WEIGHTS_S]
    all_gaps = [gap for gaps in gaps_by_session for gap in gaps]
    keep = [keep_or_offload(all_gaps, share) for share in KEEP_SHARES]
    keep_at_target = keep_or_offload(all_gaps, TARGET[1])
    references = {name: balanced(points) for name, points in (*curves.items(), ("hindsight", hindsight))}
    result: dict[str, Any] = {
        "bench": "idle_frontier",
        "quick": args.quick,
        "gaps": sum(len(g) for g in gaps_by_session),
        "conversations": len(gaps_by_session),
        "break_even_s": args.break_even_s,
        "reload_s": args.reload_s,
        "folds": folds,
        **curves,
        "hindsight": hindsight,
        "keep_or_offload": keep,
        "announced": announced,
        "announced_meets_target": any(meets(p) for p in announced),
        "oracle": {"idle_capture": oracle["idle_capture"], "warm_return": oracle["warm_return_rate"]},
        "target_idle_capture": TARGET[0],
        "target_warm_return": TARGET[1],
        # Without prewarms, even knowing every gap, this is the most capture at the target's warm share.
        "keep_or_offload_capture_at_target": keep_at_target["idle_capture"],
        **{
            f"{name}_meets_target": any(meets(p) for p in points)
            for name, points in (*curves.items(), ("hindsight", hindsight))
        },
        # The balanced point of each (the largest lesser share), and the predictors' against hindsight.
        **{f"{name}_balanced": point for name, point in references.items()},
        **{
            f"{name}_balanced_over_hindsight": min(references[name]["idle_capture"], references[name]["warm_return"])
            / min(references["hindsight"]["idle_capture"], references["hindsight"]["warm_return"])
            for name in curves
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "idle_frontier_quick" if args.quick else "idle_frontier"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    if plot(result, args.out / f"{stem}.png"):
        result["plot"] = str(args.out / f"{stem}.png")
    knobs = {
        "hazard": "warm_return_worth_s",
        "session": "lower_quantile",
        "hindsight": "weight_s",
        "keep_or_offload": "warm_share",
        "announced": "announce_lead_s",
    }
    for name, knob in knobs.items():
        for point in result[name]:
            print(
                f"{name:16s} {knob}={point[knob]:<8g} capture {point['idle_capture']:.3f}  "
                f"warm returns {point['warm_return']:.3f}"
            )
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
