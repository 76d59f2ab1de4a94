"""``bench/parallel_sampling.py`` on ``tiny``: forked completions equal the separately seeded requests, on fewer
pages, and the JSON object is the last line printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_forked_completions_equal_separate_requests_on_fewer_pages(tmp_path: Path) -> None:
    args = ["--quick", "--model", "tiny", "--n", "4", "--prompt-tokens", "100", "--max-tokens", "6"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "parallel_sampling.py"), *args, "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    result = json.loads(done.stdout.rstrip().splitlines()[-1])
    assert result["bench"] == "parallel_sampling" and result["outputs_identical"] is True
    assert json.loads((tmp_path / "parallel_sampling.json").read_text()) == result
    # The forked request computes its prompt once; without a prefix cache each separate request computes it.
    assert result["forked"]["computed_prompt_tokens"] == 100
    assert result["separate_no_prefix_cache"]["computed_prompt_tokens"] == 4 * 100
    assert result["forked"]["peak_pages"] < result["separate_no_prefix_cache"]["peak_pages"]
    assert result["pages_ratio_vs_separate"] <= 1.0
