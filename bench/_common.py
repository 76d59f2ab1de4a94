"""What only the benchmark scripts share (the rest lives in ``rayturn.replay.harness``): peak memory."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
