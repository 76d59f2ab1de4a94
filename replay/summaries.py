"""What a replay measured, per system: cache hits against the prefix-cache bound, the life cycle's figures,
latencies, and the targets they are held to.

Definitions (per system, over successful calls; "within" and "cross" are the
call kinds of ``rayturn.replay.plans.call_kinds``, each conversation's first call
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
  (``rayturn.replay.idle_eval.keep_or_offload_capture``): it keeps the pages
  through the shortest gaps and offloads the rest at once.

For a call the prefill pool computed, ``cached_tokens`` (and
``kv_store_tokens``) are what the prefill replica found cached, not the pages
the decode replica then loaded from the store; ``prefill_paths`` says how
many calls took that path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rayturn.replay.harness import percentile
from rayturn.replay.idle_eval import keep_or_offload_capture
from rayturn.replay.plans import CallKind
from rayturn.replay.records import CallRecord, SessionView

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
