"""Output made elsewhere continues exactly: a prefill server's first token, or the tokens a resumed stream had
sent, arrive as ``output_prefix`` and are computed one per step, as the decode steps that made them were, so
greedy decoding goes on with the tokens the call would have produced on one replica.

Prefill and decode attention round differently (a prompt chunk's online softmax against a decode's two passes);
on random weights some greedy choices are near ties that the difference flips. The prompts here are the load of
``tests/cluster/test_affinity_and_scaling.py``, whose ``[load 0.46]`` flipped when its output was recomputed
in a prompt chunk.
"""

from __future__ import annotations

import pytest

from rayturn.engine import LLMEngine, SamplingParams

LONG_TEXT = "def handler(event):\n    return process(event)\n" * 3
RESUME_AT = (1, 3, 6, 12)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_pretrained("tiny", enable_prefix_caching=False)


def run(engine: LLMEngine, prompt: list[int], output_prefix: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request(prompt, params, output_prefix=output_prefix)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.token_ids
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("thread", range(3))
def test_a_continuation_from_any_point_is_the_uninterrupted_answer(engine: LLMEngine, thread: int) -> None:
    for call in range(0, 50, 2):
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": f"[load {thread}.{call}] " + LONG_TEXT}])
        whole = run(engine, prompt, [])
        for k in RESUME_AT:
            assert run(engine, prompt, whole[:k]) == whole, (thread, call, k)
