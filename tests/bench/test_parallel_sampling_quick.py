"""``bench/parallel_sampling.py`` on ``tiny``: forked completions equal the separately seeded requests, on fewer
pages, and the JSON object is the last line printed."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import run_bench


def test_forked_completions_equal_separate_requests_on_fewer_pages(tmp_path: Path) -> None:
    args = ["--quick", "--model", "tiny", "--n", "4", "--prompt-tokens", "100", "--max-tokens", "6"]
    result = run_bench("parallel_sampling.py", *args, "--out", str(tmp_path))
    assert result["bench"] == "parallel_sampling" and result["outputs_identical"] is True
    assert json.loads((tmp_path / "parallel_sampling.json").read_text()) == result
    # The forked request computes its prompt once; without a prefix cache each separate request computes it.
    assert result["forked"]["computed_prompt_tokens"] == 100
    assert result["separate_no_prefix_cache"]["computed_prompt_tokens"] == 4 * 100
    assert result["forked"]["peak_pages"] < result["separate_no_prefix_cache"]["peak_pages"]
    assert result["pages_ratio_vs_separate"] <= 1.0
