"""What a replay measured: per-call records, the prefix-cache bound, per-system summaries, targets, plots.

Definitions (per system, over successful calls; "within" and "cross" are the
call kinds of ``replay_workload.call_kinds``, each conversation's first call
is in neither):

- ``hit_within_turn`` / ``hit_cross_turn``: cached over prompt tokens;
  ``bound_*``: what a prefix cache that never forgets would serve of the same
  calls, sent in the same order (``prefix_bound``), and ``*_over_bound``.
- ``idle_capture``: over cross-turn calls whose session header reports an
  idle time, the time the session's pages spent off the device over the idle
  time.
- ``prewarm_hit``: of the cross-turn calls whose pages left the device during
  the gap (state ``offloaded``, ``prewarming`` or ``prewarmed``), the share
  that found them back (``prewarmed``).
- ``warm_return_rate``: the share of cross-turn calls that found at least 90%
  of their session's pages resident.
- ``idle_capture_keep_bound`` / ``idle_capture_keep_bound_at_target``: the
  most idle capture any policy without prewarms could have had on the same
  returns, knowing every gap, with as many of those returns warm as the run
  had / with 90%
  (``rayturn.router.idle.keep_or_offload_capture``): it keeps the pages
  through the shortest gaps and offloads the rest at once.

For a call the prefill pool computed, ``cached_tokens`` (and
``kv_store_tokens``) are what the prefill replica found cached, not the pages
the decode replica then loaded from the store; ``prefill_paths`` says how
many calls took that path.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from _common import percentile
from replay_workload import CallKind

from rayturn.decode.lifecycle import Phase
from rayturn.router.idle import keep_or_offload_capture
from rayturn.router.session import SESSION_STATE_HEADER

SESSION_STATES = tuple(phase.value for phase in Phase)
OFF_DEVICE_STATES = frozenset({"offloaded", "prewarming", "prewarmed"})
WARM_RESIDENT_SHARE = 0.9

# name -> (comparison, threshold): the goals a run is held to.
TARGETS: dict[str, tuple[Literal[">=", "<="], float]] = {
    "hit_within_turn_over_bound": (">=", 0.95),
    "hit_cross_turn_over_bound": (">=", 0.90),
    "idle_capture": (">=", 0.90),
    "prewarm_hit": (">=", 0.90),
    "ttft_cross_over_within_p99": ("<=", 2.0),
}

# Figures compared across systems: each baseline's over rayturn's.
RATIO_METRICS = (
    "hit_within_turn",
    "hit_cross_turn",
    "idle_capture",
    "prewarm_hit",
    "warm_return_rate",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_cross_p99_s",
    "itl_p99_s",
)


@dataclass(frozen=True, slots=True)
class SessionView:
    """The decode replica's view of a call's session when it arrived (the ``x-rayturn-session`` header)."""

    call: Literal["user", "tool"]
    state: str
    idle_s: float | None
    off_device_s: float | None
    resident_pages: int
    session_pages: int


@dataclass(frozen=True, slots=True)
class CallRecord:
    conversation_id: str
    call_index: int
    kind: CallKind
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    store_tokens: int = 0  # loaded from the KV store; part of cached_tokens
    ttft_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    session: SessionView | None = None
    error: str = ""


def parse_session_header(value: str | None) -> SessionView | None:
    """The ``x-rayturn-session`` header, or None without one; ValueError naming the bad field."""
    if value is None:
        return None
    try:
        data = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{SESSION_STATE_HEADER}: invalid JSON ({err}): {value!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{SESSION_STATE_HEADER}: expected a JSON object, got {value!r}")

    def need(key: str) -> Any:
        if key not in data:
            raise ValueError(f"{SESSION_STATE_HEADER}: missing {key!r} in {value!r}")
        return data[key]

    def seconds(key: str) -> float | None:
        seconds_value = data.get(key)
        if seconds_value is None:
            return None
        if isinstance(seconds_value, bool) or not isinstance(seconds_value, int | float) or seconds_value < 0:
            raise ValueError(f"{SESSION_STATE_HEADER}: {key}: expected seconds >= 0, got {seconds_value!r}")
        return float(seconds_value)

    def pages(key: str) -> int:
        count = need(key)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{SESSION_STATE_HEADER}: {key}: expected a page count, got {count!r}")
        return count

    call, state = need("call"), need("state")
    if call not in ("user", "tool"):
        raise ValueError(f"{SESSION_STATE_HEADER}: call: expected 'user' or 'tool', got {call!r}")
    if state not in SESSION_STATES:
        raise ValueError(f"{SESSION_STATE_HEADER}: state: expected one of {', '.join(SESSION_STATES)}, got {state!r}")
    return SessionView(
        call, state, seconds("idle_s"), seconds("off_device_s"), pages("resident_pages"), pages("session_pages")
    )


# -- the bound ----------------------------------------------------------------


def prefix_bound(sent: Sequence[tuple[CallKind, Sequence[int]]], page_size: int) -> dict[str, float | None]:
    """The share of prompt tokens a never-forgetting prefix cache serves, within and across turns.

    Calls in send order, any conversation: a call is served its longest run of
    leading full pages whose chained page (the page and every page before it)
    some earlier call held. Only the first ``(len - 1) // page_size`` pages can
    count, since the last prompt token is always computed.
    """
    chain: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent page, tokens) -> page id: chained hashes, exactly
    served = {"within": 0, "cross": 0}
    total = {"within": 0, "cross": 0}
    for kind, token_ids in sent:
        pages, parent, hits, missed = [], -1, 0, False
        for start in range(0, len(token_ids) // page_size * page_size, page_size):
            key = (parent, tuple(token_ids[start : start + page_size]))
            known = key in chain
            parent = chain.setdefault(key, len(chain))
            pages.append(parent)
            if len(pages) <= (len(token_ids) - 1) // page_size and known and not missed:
                hits += 1
            else:
                missed = True
        if kind in total:
            served[kind] += hits * page_size
            total[kind] += len(token_ids)
    return {
        "bound_within_turn": _share(served["within"], total["within"]),
        "bound_cross_turn": _share(served["cross"], total["cross"]),
    }


# -- per-system summary -------------------------------------------------------


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 4) if ours is not None and theirs else None


def _p(samples: Sequence[float], q: float) -> float | None:
    return round(percentile(samples, q), 5) if samples else None


def summarize(
    records: Sequence[CallRecord], sent: Sequence[tuple[CallKind, Sequence[int]]], page_size: int, wall_s: float
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    by_kind = {kind: [r for r in ok if r.kind == kind] for kind in ("within", "cross")}
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    store = sum(r.store_tokens for r in ok)
    summary: dict[str, Any] = {
        "calls": len(records),
        "failures": len(records) - len(ok),
        "duration_s": round(wall_s, 2),
        "prompt_tokens": prompt,
        "device_cache_tokens": cached - store,
        "store_tokens": store,
        "recomputed_tokens": prompt - cached,
    }
    for kind, label in (("within", "hit_within_turn"), ("cross", "hit_cross_turn")):
        calls = by_kind[kind]
        summary[f"{kind}_calls"] = len(calls)
        summary[label] = _share(sum(r.cached_tokens for r in calls), sum(r.prompt_tokens for r in calls))
    summary.update(prefix_bound(sent, page_size))
    summary["hit_within_turn_over_bound"] = _ratio(summary["hit_within_turn"], summary["bound_within_turn"])
    summary["hit_cross_turn_over_bound"] = _ratio(summary["hit_cross_turn"], summary["bound_cross_turn"])
    summary.update(lifecycle_figures(by_kind["cross"]))
    ttfts = [r.ttft_s for r in ok]
    within_ttfts = [r.ttft_s for r in by_kind["within"]]
    cross_ttfts = [r.ttft_s for r in by_kind["cross"]]
    itls = [gap for r in ok for gap in r.itl_s]
    summary.update(
        ttft_p50_s=_p(ttfts, 50),
        ttft_p99_s=_p(ttfts, 99),
        ttft_within_p50_s=_p(within_ttfts, 50),
        ttft_within_p99_s=_p(within_ttfts, 99),
        ttft_cross_p50_s=_p(cross_ttfts, 50),
        ttft_cross_p99_s=_p(cross_ttfts, 99),
        itl_p50_s=_p(itls, 50),
        itl_p99_s=_p(itls, 99),
    )
    summary["ttft_cross_over_within_p99"] = _ratio(summary["ttft_cross_p99_s"], summary["ttft_within_p99_s"])
    summary["targets"] = targets(summary)
    errors = sorted({r.error for r in records if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _is_warm(view: SessionView) -> bool:
    """The call found (nearly) all of its session's pages on the device."""
    return view.resident_pages >= WARM_RESIDENT_SHARE * view.session_pages


def lifecycle_figures(cross_calls: Sequence[CallRecord]) -> dict[str, Any]:
    """Idle capture, prewarm hits and warm returns of cross-turn calls, from their session headers."""
    views = [r.session for r in cross_calls if r.session is not None]
    idle = [v for v in views if v.idle_s is not None]
    off_device = [v for v in views if v.state in OFF_DEVICE_STATES]
    warm = [v for v in views if _is_warm(v)]
    warm_return_rate = _share(len(warm), len(views))
    gaps_s = [v.idle_s for v in idle if v.idle_s is not None]
    # The bound at the warm share of these same returns (a new session's first call is not one).
    warm_share = _share(sum(1 for v in idle if _is_warm(v)), len(idle))
    return {
        "session_header_calls": len(views),
        "idle_capture": _share(sum(v.off_device_s or 0.0 for v in idle), sum(gaps_s)),
        "offloaded_returns": len(off_device),
        "prewarm_hit": _share(sum(1 for v in off_device if v.state == "prewarmed"), len(off_device)),
        "warm_return_rate": warm_return_rate,
        "idle_capture_keep_bound": None
        if warm_share is None or not gaps_s
        else round(keep_or_offload_capture(gaps_s, warm_share), 4),
        "idle_capture_keep_bound_at_target": round(keep_or_offload_capture(gaps_s, TARGETS["prewarm_hit"][1]), 4)
        if gaps_s
        else None,
    }


def targets(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target with its value and whether it was met (an unmeasured value is not met)."""
    result = {}
    for name, (comparison, threshold) in TARGETS.items():
        value = summary.get(name)
        met = value is not None and (value >= threshold if comparison == ">=" else value <= threshold)
        result[name] = {"target": f"{comparison} {threshold}", "value": value, "met": met}
    return result


def compare(systems: Mapping[str, Mapping[str, Any]], reference: str = "rayturn") -> dict[str, dict[str, Any]]:
    """Each other system's figures over the reference system's: ``{baseline: {metric: ratio}}``."""
    ours = systems[reference]
    return {
        name: {metric: _ratio(theirs.get(metric), ours.get(metric)) for metric in RATIO_METRICS}
        for name, theirs in systems.items()
        if name != reference
    }


def record_dict(record: CallRecord) -> dict[str, Any]:
    """A record for the JSON file, latencies rounded."""
    data = asdict(record)
    data["ttft_s"] = round(record.ttft_s, 5)
    data["itl_s"] = [round(gap, 5) for gap in record.itl_s]
    return data


# -- markdown and plots -------------------------------------------------------

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
