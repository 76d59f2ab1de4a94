"""``bench/engine_throughput.py --quick`` on ``tiny``: its JSON object is the last line of everything it prints.

Each side runs in a process of its own; the transformers one makes a multiprocessing lock (tqdm's, for the
weight-loading bar), which the resource tracker reported as a leaked semaphore after the JSON line whenever
that process was terminated rather than let go. stdout and stderr share one pipe here, so that order shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_json_object_is_the_last_line_printed() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine_throughput.py"), "--quick", "--model", "tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    result = json.loads(done.stdout.rstrip().splitlines()[-1])
    assert result["bench"] == "engine_throughput" and result["model"] == "tiny" and result["requests"] == 8
    assert "leaked" not in done.stdout
