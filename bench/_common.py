"""What only the benchmark scripts share (the rest lives in ``rayturn.replay.harness``): peak memory, host load,
nearest-rank percentiles."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_average() -> float:
    """The host's 1-minute load average: the figures beside it are only as clean as it is low."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def nearest_rank(samples: list[float], q: int) -> float:
    """The q-th percentile (0-100) as one of the samples (the KV store benchmarks' and their Mooncake peer's
    definition; ``rayturn.replay.harness.percentile`` interpolates instead)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]
