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


def test_an_output_prefix_is_reported_on_arrival_before_its_request_is_scheduled() -> None:
    """A prefill replica's first token streams from the decode replica's next step, even while a long prompt
    there takes every step's budget: the request's first output is the prefix alone, unfinished; its answer
    then goes on as before."""
    engine = LLMEngine.from_pretrained("tiny", enable_prefix_caching=False, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(3, 203)), params)  # 200 tokens: seven steps of prefill
    engine.step()
    prompt = engine.tokenizer.encode(LONG_TEXT)
    alone = run(engine, prompt, [])
    busy_id = engine.add_request(list(range(3, 203)), params)
    engine.step()
    request_id = engine.add_request(prompt, params, output_prefix=alone[:1])
    (first,) = [output for output in engine.step() if output.request_id == request_id]
    assert (first.token_ids, first.finished) == (alone[:1], False)
    assert request_id in {seq.request_id for seq in engine.scheduler.waiting}  # not scheduled yet
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
    assert finished[request_id] == alone[:4] and busy_id in finished
