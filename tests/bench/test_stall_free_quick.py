"""``bench/stall_free.py`` on ``tiny`` with small shapes: calls arriving during a long prompt go ahead of it."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import run_bench


def test_calls_arriving_during_a_long_prompt_wait_one_step_with_stall_free_batching(tmp_path: Path) -> None:
    args = ["--quick", "--long-prompt", "1024", "--max-num-batched-tokens", "256", "--streams", "2"]
    args += ["--stream-tokens", "24", "--continuation-prompt", "64", "--handed-prompt", "128"]
    result = run_bench("stall_free.py", *args, "--out", str(tmp_path))
    assert result["bench"] == "stall_free" and json.loads((tmp_path / "stall_free.json").read_text()) == result
    assert result["arrivals_per_round"] == 3  # after each of the long prompt's four chunks but the last
    on, off = result["on"], result["off"]
    # Counted in steps, not timed: on, a continuation (a higher class) and a handed-over call (one token to
    # compute) are admitted ahead of the long prompt's next chunk and have their token from that step; off,
    # they wait until the long prompt's chunks leave room in a step.
    assert on["continuation_ttft_steps_max"] == 1 and on["handed_over_ttft_steps_max"] == 1
    assert off["continuation_ttft_steps_max"] >= 3 and off["handed_over_ttft_steps_max"] >= 2
    if result["plot"] is not None:
        assert Path(result["plot"]).stat().st_size > 0
