"""``bench/prefill_attention.py --quick``: the native prefill kernel (chunked and in one chunk) and PyTorch's flash
kernel timed on the same keys, the two native schedules bit-equal, flash within float32 rounding of them. Speed is
the benchmark's to report (BENCHMARKS.md). A case that is not CONTEXT+QUERY is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bench_script import ROOT, run_bench

from rayturn.kernels import native

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler for the native kernels")


def test_prefill_attention_quick_times_every_side_on_the_same_results(tmp_path: Path) -> None:
    result = run_bench("prefill_attention.py", "--quick", "--out", str(tmp_path))
    assert result["bench"] == "prefill_attention" and result["quick"] is True and result["repeats"] == 5
    cases = result["cases"]
    assert [(case["context_tokens"], case["query_tokens"]) for case in cases] == [(4096, 200), (0, 1024)]
    for case in cases:
        assert set(case["ms"]) == {"native", "native_one_chunk", "flash"} and min(case["ms"].values()) > 0
        assert case["flash_over_native"] == pytest.approx(case["ms"]["flash"] / case["ms"]["native"], rel=1e-2)
        assert case["native_equals_one_chunk"] is True
        assert case["max_abs_diff_vs_flash"] < 1e-4
    assert result["native_equals_one_chunk"] is True
    assert json.loads((tmp_path / "prefill_attention.json").read_text())["cases"] == cases


def test_a_case_that_is_not_context_plus_query_is_refused_by_name(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "prefill_attention.py"),
            "--cases",
            "4096+200,4096x2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode != 0 and "'4096x2' is not CONTEXT+QUERY" in done.stderr
