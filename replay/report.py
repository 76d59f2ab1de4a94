"""A replay's results for people: the markdown table and the plots (none without matplotlib)."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rayturn.replay.records import CallRecord
from rayturn.replay.summaries import TARGETS

TABLE_ROWS = (
    "calls", "failures", "duration_s", "prompt_tokens", "device_cache_tokens", "store_tokens", "recomputed_tokens",
    "hit_within_turn", "bound_within_turn", "hit_within_turn_over_bound",
    "hit_cross_turn", "bound_cross_turn", "hit_cross_turn_over_bound",
    "idle_capture", "prewarm_hit", "warm_return_rate", "idle_capture_keep_bound", "idle_capture_keep_bound_at_target",
    "ttft_p50_s", "ttft_p99_s", "ttft_within_p99_s", "ttft_cross_p99_s", "ttft_cross_over_within_p99",
    "itl_p50_s", "itl_p99_s", "prefill_paths",
)  # fmt: skip


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "met" if value else "not met"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(result: Mapping[str, Any]) -> str:
    systems: Mapping[str, Mapping[str, Any]] = result["systems"]
    names = list(systems)
    lines = [
        "# Trace replay",
        "",
        f"Traces: {', '.join(result['traces'])}; {result['conversations']} conversations "
        f"({len(result['truncated_conversations'])} cut short and {len(result['dropped_conversations'])} left out "
        "to fit the context).",
        f"Model {result['model']}; token scale {result['token_scale']:.5g}, time scale {result['time_scale']:.5g}; "
        f"{result['device_kv_pages']} device KV pages per decode replica; "
        f"KV demand / device capacity {_cell(result['kv_demand_over_device_capacity'])}.",
        (
            "Clients announce no user turn ahead of its call."
            if result.get("announce_lead_s") is None
            else f"Clients announce each user turn {result['announce_lead_s']:.5g} trace seconds before its call "
            "(`POST /v1/sessions/{id}/prewarm`, as when the user starts typing)."
        ),
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for row in TABLE_ROWS:
        lines.append(f"| {row} | " + " | ".join(_cell(systems[name].get(row)) for name in names) + " |")
    for target, (comparison, threshold) in TARGETS.items():
        cells = " | ".join(_cell(systems[name]["targets"][target]["met"]) for name in names)
        lines.append(f"| target: {target} {comparison} {threshold} | {cells} |")
    for baseline, ratios in result.get("ratios", {}).items():
        lines += ["", f"{baseline} over rayturn: " + ", ".join(f"{k} {_cell(v)}" for k, v in ratios.items())]
    return "\n".join(lines) + "\n"


def write_plots(
    records: Mapping[str, Sequence[CallRecord]], summaries: Mapping[str, Mapping[str, Any]], out_dir: Path
) -> list[Path]:
    """A TTFT CDF (within vs cross, per system) and cache hit vs bound bars; none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []
    paths = []
    figure, axes = plt.subplots(figsize=(6.5, 4))
    for (system, calls), style in zip(records.items(), itertools.cycle(("-", "--", ":"))):
        for kind in ("within", "cross"):
            ordered = sorted(r.ttft_s * 1e3 for r in calls if r.ok and r.kind == kind)
            if ordered:
                fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
                axes.step(ordered, fractions, style, label=f"{system}, {kind}-turn")
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (ms)")
    axes.set_ylabel("fraction of calls")
    axes.set_title("Trace replay: TTFT within vs across turns")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    paths.append(out_dir / "replay_ttft_cdf.png")
    figure.savefig(paths[-1], dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6.5, 4))
    bars = ("hit_within_turn", "bound_within_turn", "hit_cross_turn", "bound_cross_turn")
    width = 0.8 / len(bars)
    colors = ("tab:blue", "lightsteelblue", "tab:orange", "navajowhite")
    for offset, (key, color) in enumerate(zip(bars, colors)):
        values = [summaries[system].get(key) or 0.0 for system in summaries]
        positions = [i + (offset - (len(bars) - 1) / 2) * width for i in range(len(values))]
        hatch = "//" if "bound" in key else None
        axes.bar(positions, values, width, label=key.replace("_", " "), color=color, hatch=hatch, edgecolor="gray")
    axes.set_xticks(range(len(summaries)), list(summaries))
    axes.set_ylim(0, 1.3)
    axes.set_ylabel("share of prompt tokens cached")
    axes.set_title("Trace replay: cache hits vs the prefix-cache bound")
    axes.legend(fontsize="small", loc="upper center", ncols=2)
    figure.tight_layout()
    paths.append(out_dir / "replay_hit_vs_bound.png")
    figure.savefig(paths[-1], dpi=120)
    plt.close(figure)
    return paths
