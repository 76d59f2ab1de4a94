"""``bench/moe_kernel.py --quick``: the Triton fused MoE MLP and the torch reference timed on the same inputs,
plain and GPT-OSS experts, with results the same as the float32 reference's. On a GPU the kernels run natively;
here under the interpreter, which the result says. Speed is the benchmark's to report (BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bench_script import run_bench

pytest.importorskip("triton")


def test_moe_kernel_quick_times_both_sides_on_the_same_results(tmp_path: Path) -> None:
    result = run_bench("moe_kernel.py", "--quick", "--out", str(tmp_path))
    assert result["bench"] == "moe_kernel" and result["quick"] is True
    assert result["interpreted"] is (not torch.cuda.is_available())
    cases = result["cases"]
    assert len(cases) >= 3 and {case["gpt_oss"] for case in cases} == {False, True}
    assert min(case["num_tokens"] for case in cases) == 1  # a decode step among them
    for case in cases:
        assert case["triton_ms"] > 0 and case["torch_ms"] > 0
        assert case["speedup"] == pytest.approx(case["torch_ms"] / case["triton_ms"], rel=1e-2)
        assert case["triton_relative_error"] <= (1e-4 if case["dtype"] == "float32" else 3e-2)
        assert case["close"] is True
    assert result["all_close"] is True
    assert json.loads((tmp_path / "moe_kernel.json").read_text())["cases"] == cases
