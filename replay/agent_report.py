"""What the agent-sessions benchmark reports per system: latency percentiles, throughput, cache hits, ratios."""

from __future__ import annotations

import bisect
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayturn.replay.agent_client import CallSample
from rayturn.replay.harness import percentile


def _stat(samples: Sequence[float], q: float) -> float | None:
    return round(percentile(samples, q), 5) if samples else None


def summarize(samples: Sequence[CallSample], wall_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttfts = [s.ttft_s for s in ok]
    itls = [gap for s in ok for gap in s.itl_s]
    prompt_tokens = sum(s.prompt_tokens for s in ok)
    cached_tokens = sum(s.cached_tokens for s in ok)
    replicas: dict[str, set[str]] = {}
    calls_by_replica: Counter[str] = Counter()
    computed_by_replica: Counter[str] = Counter()
    for s in ok:
        if s.replica is not None:
            replicas.setdefault(s.session_id, set()).add(s.replica)
            calls_by_replica[s.replica] += 1
            computed_by_replica[s.replica] += s.prompt_tokens - s.cached_tokens
    return {
        "calls": len(samples),
        "failures": len(samples) - len(ok),
        "ttft_p50_s": _stat(ttfts, 50),
        "ttft_p99_s": _stat(ttfts, 99),
        "itl_p50_s": _stat(itls, 50),
        "itl_p99_s": _stat(itls, 99),
        "output_tok_s": round(sum(s.completion_tokens for s in ok) / wall_s, 2) if wall_s > 0 else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_token_fraction": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else None,
        "replicas_per_session": round(sum(map(len, replicas.values())) / len(replicas), 2) if replicas else None,
        "largest_replica_share": _largest_shares(calls_by_replica, computed_by_replica),
        "itl_p50_by_streams": itl_p50_by_streams(ok),
        "wall_s": round(wall_s, 2),
    }


# A stream count's ITL p50 is reported from at least this many gaps.
MIN_GAPS_PER_STREAM_COUNT = 50


def itl_p50_by_streams(samples: Sequence[CallSample]) -> dict[str, dict[str, float | int]]:
    """ITL p50 by how many calls were streaming tokens on the same decode replica when the gap ended (the
    call itself included), for counts with at least ``MIN_GAPS_PER_STREAM_COUNT`` gaps: {count: {"itl_p50_s",
    "gaps"}}. In a closed loop a system that answers sooner has more calls decoding at once, and a decode
    step's time grows with its batch; these p50s compare two systems' ITLs at the same batch.

    A call streams from its first token to its last. Calls the server did not name a replica for are left
    out, as are calls in prefill (which also take a replica's time)."""
    spans: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    timed = [(s, s.token_times()) for s in samples if s.replica is not None and s.itl_s]
    for sample, times in timed:
        starts, ends = spans[sample.replica or ""]
        starts.append(times[0])
        ends.append(times[-1])
    for starts, ends in spans.values():
        starts.sort()
        ends.sort()
    gaps_by_count: dict[int, list[float]] = defaultdict(list)
    for sample, times in timed:
        starts, ends = spans[sample.replica or ""]
        for gap, end_s in zip(sample.itl_s, times[1:], strict=True):
            # Streaming at end_s: started at or before it, not ended before it.
            count = bisect.bisect_right(starts, end_s) - bisect.bisect_left(ends, end_s)
            gaps_by_count[count].append(gap)
    return {
        str(count): {"itl_p50_s": round(percentile(gaps, 50), 5), "gaps": len(gaps)}
        for count, gaps in sorted(gaps_by_count.items())
        if len(gaps) >= MIN_GAPS_PER_STREAM_COUNT
    }


def _largest_shares(calls: Counter[str], computed: Counter[str]) -> dict[str, Any] | None:
    """How evenly the calls spread over the decode replicas that served them: the largest share of the calls
    any one replica served, and of the prompt tokens computed for them (1 / replicas when even)."""
    if not calls:
        return None
    total_computed = sum(computed.values())
    return {
        "replicas": len(calls),
        "calls": round(max(calls.values()) / sum(calls.values()), 3),
        "computed_prompt_tokens": round(max(computed.values()) / total_computed, 3) if total_computed else None,
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


RATIOS = {  # reported ratio -> the per-system figure it divides
    "ttft_p50_ratio_vs_baseline": "ttft_p50_s",
    "ttft_p99_ratio_vs_baseline": "ttft_p99_s",
    "itl_p50_ratio_vs_baseline": "itl_p50_s",
    "itl_p99_ratio_vs_baseline": "itl_p99_s",
    "output_tok_s_ratio_vs_baseline": "output_tok_s",
}


def compare(rayturn: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """rayturn over baseline: latency ratios < 1 and a throughput ratio > 1 favour rayturn; the ITL p50 ratio
    also per count of calls streaming on the replica, for the counts both systems report."""
    ratios: dict[str, Any] = {name: _ratio(rayturn[key], baseline[key]) for name, key in RATIOS.items()}
    ours, theirs = rayturn.get("itl_p50_by_streams") or {}, baseline.get("itl_p50_by_streams") or {}
    ratios["itl_p50_ratio_by_streams"] = {
        count: _ratio(ours[count]["itl_p50_s"], theirs[count]["itl_p50_s"])
        for count in sorted(ours.keys() & theirs.keys(), key=int)
    }
    return ratios


def write_plot(ttfts: dict[str, list[float]], title: str, path: Path) -> Path | None:
    """A TTFT CDF per system, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    figure, axes = plt.subplots(figsize=(6, 4))
    for system, samples in ttfts.items():
        ordered = sorted(samples)
        axes.step([t * 1e3 for t in ordered], [(i + 1) / len(ordered) for i in range(len(ordered))], label=system)
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel("time to first token (ms)")
    axes.set_ylabel("fraction of calls")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
