"""``bench/stall_free.py`` on ``tiny`` with small shapes: calls arriving during a long prompt go ahead of it, and
with a cap on a step's prompt tokens while streams decode, the long prompt takes more, smaller steps."""

from __future__ import annotations

import json
from pathlib import Path

from bench_script import run_bench


def test_calls_arriving_during_a_long_prompt_wait_one_step_with_stall_free_batching(tmp_path: Path) -> None:
    args = ["--quick", "--long-prompt", "1024", "--max-num-batched-tokens", "256", "--streams", "2"]
    args += ["--max-prefill-tokens-while-decoding", "128"]
    args += ["--stream-tokens", "24", "--continuation-prompt", "64", "--handed-prompt", "128"]
    args += ["--turn-history", "128", "--turn-new", "48"]
    result = run_bench("stall_free.py", *args, "--out", str(tmp_path))
    assert result["bench"] == "stall_free" and json.loads((tmp_path / "stall_free.json").read_text()) == result
    assert result["arrivals_per_round"] == 3  # after each of the long prompt's four chunks but the last
    assert result["max_prefill_tokens_while_decoding"] == 128
    on, uncapped, off = result["on"], result["uncapped"], result["off"]
    # Counted in steps, not timed: on and uncapped, a new turn (48 new tokens: less than an eighth of the long
    # prompt's rest), a handed-over call (one token to compute) and a continuation (a higher class) are admitted
    # ahead of the long prompt's next chunk and have their token from that step; off, each waits out the long
    # prompt's remaining chunks (three after the first chunk: the new turn; two after the second: the handed-over
    # call; one after the third: the continuation), then its own step.
    for kind, chunks_left in (("new_turn", 3), ("handed_over", 2), ("continuation", 1)):
        assert on[f"{kind}_ttft_steps_max"] == 1, kind
        assert uncapped[f"{kind}_ttft_steps_max"] == 1, kind
        assert off[f"{kind}_ttft_steps_max"] >= chunks_left + 1, kind
    # While the streams decode, the long prompt's chunks are at most 128 tokens on (at least 8 steps for its
    # 1,024), up to the 256-token budget uncapped (the streams end before it does: at most 6 steps then).
    assert on["long_ttft_steps"] >= 8 and uncapped["long_ttft_steps"] <= 6
    if result["plot"] is not None:
        assert Path(result["plot"]).stat().st_size > 0
