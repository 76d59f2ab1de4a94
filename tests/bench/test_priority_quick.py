"""``bench/priority.py`` on ``tiny`` with a small load: classes put agents' calls ahead of a background batch."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import run_bench


def test_agents_calls_start_sooner_with_classes_than_behind_the_batch(tmp_path: Path) -> None:
    args = ["--quick", "--background", "40", "--background-prompt", "128", "--background-tokens", "64"]
    args += ["--seconds", "0.3", "--rate", "30"]
    result = run_bench("priority.py", *args, "--out", str(tmp_path))
    assert result["bench"] == "priority" and json.loads((tmp_path / "priority.json").read_text()) == result
    on, off = result["on"], result["off"]
    assert on["interactive_calls"] == off["interactive_calls"] > 0
    assert on["continuation_calls"] == off["continuation_calls"] > 0
    # First come first served, an agent's call waits behind the queued batch; with classes it waits only for a
    # slot, and (almost) no request of the batch starts ahead of it. (Counted, not timed: the calls all arrive in
    # the first 0.3 s, while the batch, 40 requests on 8 slots, runs in five waves.)
    assert off["agent_calls_overtaken_by_batch_mean"] >= 8
    assert on["agent_calls_overtaken_by_batch_mean"] < 1
