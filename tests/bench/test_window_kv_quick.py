"""``bench/window_kv.py --quick``: on one KV budget, the engine that keeps sliding-window layers for their
window only holds more context and runs more sequences at once than the one that keeps them in every page,
with identical greedy tokens. Speed is the benchmark's to report (BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

from bench_script import run_bench


def test_window_kv_quick_holds_more_context_on_the_same_budget(tmp_path: Path) -> None:
    result = run_bench("window_kv.py", "--quick", "--out", str(tmp_path))
    assert result["bench"] == "window_kv" and result["quick"] is True
    assert result["identical_outputs"] is True
    whole, windowed = result["whole"], result["windowed"]
    assert whole["num_window_slots"] == 0 and windowed["num_window_slots"] > 0
    assert whole["kv_bytes"] <= result["budget_bytes"] and windowed["kv_bytes"] <= result["budget_bytes"]
    assert result["context_ratio"] > 1.2 and windowed["context_tokens"] > whole["context_tokens"]
    assert windowed["most_running"] > whole["most_running"]
    assert whole["output_tokens_per_s"] > 0 and windowed["output_tokens_per_s"] > 0
    assert (tmp_path / "window_kv.json").is_file()
