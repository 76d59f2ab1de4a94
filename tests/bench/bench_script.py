"""Running a benchmark script as a user does, for the quick tests: its exit status, then its last line's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str) -> dict[str, Any]:
    """Run ``bench/<script>`` with ``args`` (stdout and stderr in one pipe, so their order shows); returns the JSON
    object on the last line it printed, after asserting it exited 0."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.rstrip().splitlines()[-1])
    return result
