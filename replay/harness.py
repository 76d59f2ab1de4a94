"""What every benchmark shares: progress on stderr, percentiles, the machine, ``--out``, the JSON line, a small
host's cluster."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rayturn.replay.paths import RESULTS_DIR

# Cluster settings for a small host: two decode replicas (so routing matters) on fractional CPUs.
SMALL_MACHINE: dict[str, Any] = {
    "decode.min_replicas": 2,
    "decode.max_replicas": 2,
    "decode.num_cpus": 0.25,
    "prefill.num_cpus": 0.25,
    "server.ingress_num_cpus": 0.25,
    "kvstore.segment_bytes": "64MiB",
}


class Progress:
    """A one-line progress bar on stderr (the JSON result owns stdout's last line)."""

    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label, self.total, self.width = label, max(total, 1), width
        self.done = 0
        self.start = time.perf_counter()
        self._draw()

    def advance(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        self._draw()
        if self.done == self.total:
            sys.stderr.write("\n")

    def _draw(self) -> None:
        filled = self.width * self.done // self.total
        elapsed_s = time.perf_counter() - self.start
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.label:<28} [{bar}] {self.done}/{self.total} {elapsed_s:6.1f}s")
        sys.stderr.flush()


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated linearly between closest ranks (numpy's default)."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out DIR``: the one folder a benchmark writes all it makes to (JSON, Markdown, plots, traces)."""
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / name,
        metavar="DIR",
        help=f"folder for every output: JSON, plots (default: bench/results/{name})",
    )


def pyplot() -> Any | None:
    """matplotlib's ``pyplot``, drawing to files only (the Agg backend); None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, figure: Any, path: Path, dpi: int = 110) -> Path:
    """Lay ``figure`` out, write it to ``path`` (PNG) and close it."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def emit(result: dict[str, Any]) -> None:
    """Print the result as one JSON object on the last line of stdout."""
    print(json.dumps(result, sort_keys=True), flush=True)
