"""``bench/decode_step.py --quick`` on ``tiny``: the JSON object on its last line, with both sides timed and
their greedy tokens compared. On a CPU no graphs are recorded, so there is no eager side to add."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import run_bench


def test_quick_run_times_both_sides_and_prints_its_json_last(tmp_path: Path) -> None:
    result = run_bench("decode_step.py", "--quick", "--model", "tiny", "--out", str(tmp_path))
    assert result["bench"] == "decode_step" and result["batches"] == [1, 8] and result["steps"] == 8
    assert result["graphs"] is False and result["rayturn_eager_ms"] is None and result["graphs_speedup"] is None
    for side in ("rayturn_ms", "hf_ms"):
        assert set(result[side]) == {"1", "8"} and all(ms > 0 for ms in result[side].values())
    assert result["outputs_match_hf"] is True  # float32, the same weights: the same greedy tokens
    assert json.loads((tmp_path / "decode_step.json").read_text()) == result
