"""A few agent traces the project writes itself, in the kv-cache-tester format, for a replay with no real traces.

``rayturn replay`` reads recorded traces (``../shared/traces/weka`` next to
the checkout, or any files it is given); a fresh clone has none, so it
replays these instead. Each conversation is one kv-cache-tester JSON file
(what ``trace_files`` reads as ``weka``): ``id``, ``block_size`` 64,
``tool_tokens`` + ``system_tokens`` for the shared prefix, and ``requests``
whose ``hash_ids`` name the prompt's 64-token blocks, conversation-local. A
call's prompt is the previous one plus the answer and the tool's result (or,
opening a turn, the user's message): its full blocks keep their ids, a block
that was partial and every new one get fresh ids. Sizes and gaps follow the
real Claude Code sessions (``agent_workload``'s distributions), with fewer
turns and calls so that a quick replay sees several turns of each. The
seed alone fixes every file.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from rayturn.replay.agent_workload import (
    ANSWER_TOKENS,
    CALLS_PER_TURN,
    SHARED_PREFIX_TOKENS,
    THINK_GAP_S,
    TOOL_GAP_S,
    TOOL_RESULT_TOKENS,
)

SAMPLE_CONVERSATIONS = 6
TURNS_PER_CONVERSATION = (2, 4)
CALLS_PER_TURN_RANGE = (2, 8)
BLOCK_SIZE = 64
SYSTEM_TOKENS = 2_600  # the real sessions' median; the tool definitions take the rest of the shared prefix
DECODE_TOKENS_PER_S = 50.0  # how long an answer took to stream, for ``api_time``


def write_sample_traces(folder: Path, seed: int = 0, count: int = SAMPLE_CONVERSATIONS) -> list[Path]:
    """Write ``count`` sample conversations into ``folder`` (made if needed); their files, in name order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        trace = sample_trace(f"sample_{index + 1:04d}", random.Random(f"{seed}-sample-trace-{index}"))
        path = folder / f"{trace['id']}.json"
        path.write_text(json.dumps(trace, indent=1) + "\n")
        paths.append(path)
    return paths


def sample_trace(conversation_id: str, rng: random.Random) -> dict[str, Any]:
    """One conversation in the kv-cache-tester JSON format."""
    blocks = _Blocks()
    requests: list[dict[str, Any]] = []
    prompt_tokens = SHARED_PREFIX_TOKENS
    t = 0.0
    for turn in range(rng.randint(*TURNS_PER_CONVERSATION)):
        low, high = CALLS_PER_TURN_RANGE
        num_calls = min(max(round(CALLS_PER_TURN.draw(rng)), low), high)
        for step in range(num_calls):
            opens_turn = step == 0
            gap_s = 0.0 if turn == step == 0 else (THINK_GAP_S if opens_turn else TOOL_GAP_S).draw(rng)
            if requests:
                previous = requests[-1]
                t = math.ceil(previous["t"] + previous["api_time"] + gap_s)  # the traces' 1 s resolution
                prompt_tokens += previous["out"]
            prompt_tokens += round(TOOL_RESULT_TOKENS.draw(rng))  # the user's message, or the tool's result
            output_tokens = round(ANSWER_TOKENS.draw(rng))
            last = step == num_calls - 1
            requests.append(
                {
                    "t": float(t),
                    "type": "n",
                    "model": "rayturn-sample",
                    "in": prompt_tokens,
                    "out": output_tokens,
                    "hash_ids": blocks.extend_to(prompt_tokens),
                    "input_types": ["text"] if opens_turn else ["tool_result"],
                    "output_types": ["text"] if last else ["text", "tool_use"],
                    "stop": "end_turn" if last else "tool_use",
                    "api_time": round(1.0 + output_tokens / DECODE_TOKENS_PER_S, 2),
                    "think_time": float(round(gap_s)),
                }
            )
    return {
        "id": conversation_id,
        "models": ["rayturn-sample"],
        "block_size": BLOCK_SIZE,
        "hash_id_scope": "local",
        "tool_tokens": SHARED_PREFIX_TOKENS - SYSTEM_TOKENS,
        "system_tokens": SYSTEM_TOKENS,
        "requests": requests,
    }


class _Blocks:
    """A growing prompt's block ids: full blocks keep theirs, the rest are new."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.full_blocks = 0
        self.next_id = 1

    def extend_to(self, prompt_tokens: int) -> list[int]:
        del self.ids[self.full_blocks :]  # the partial last block changes as the prompt grows
        while len(self.ids) < math.ceil(prompt_tokens / BLOCK_SIZE):
            self.ids.append(self.next_id)
            self.next_id += 1
        self.full_blocks = prompt_tokens // BLOCK_SIZE
        return list(self.ids)
