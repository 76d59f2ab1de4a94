"""Reasoning tokens in every API's usage: the answers' reasoning (harmony's analysis channel) as the model's
tokenizer encodes it, folded from the decode replica's split of the text; absent where no answer was split."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from rayturn.api.call_result import CallResult
from rayturn.api.grpc_stream import GrpcStream
from rayturn.api.responses_bodies import response_usage
from rayturn.engine.presets import preset_dir
from rayturn.engine.tokenizer import Tokenizer
from rayturn.engine.tool_calls import ToolCallStream
from rayturn.messages import Delta, Step

REASONING = "The user greets me; greet them back, briefly and kindly."
ANSWER = f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(preset_dir("tiny"))


def count(tokenizer: Tokenizer) -> int:
    return len(tokenizer.encode(REASONING, add_special_tokens=False))


def test_the_tokenizer_counts_a_texts_tokens_without_special_ones(tokenizer: Tokenizer) -> None:
    assert tokenizer.count_tokens(REASONING) == count(tokenizer) > 0
    assert tokenizer.count_tokens("") == 0


def step(text: str, num_tokens: int, *, index: int = 0, parser: str | None = "harmony", cut: int = 7) -> Step:
    """The one step of a completion whose ``num_tokens`` tokens read ``text``, split as a replica splits it
    (``parser`` None: an answer that is not split), the text arriving in pieces of ``cut`` characters."""
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    split = ToolCallStream(parser) if parser is not None else None
    parse = ()
    if split is not None:
        parse = (*[split.push(piece) for piece in pieces], split.finish())
    delta = Delta(
        index=index,
        token_ids=tuple(range(num_tokens)),
        text=text,
        logprobs=None,
        finish_reason="stop",
        tool_parse=parse,
    )
    return Step(
        deltas=(delta,),
        prompt_tokens=12,
        cached_tokens=0,
        loaded_tokens=0,
        finished=True,
        path="local",
        replica_id=None,
    )


def folded(tokenizer: Tokenizer, steps: Sequence[Step]) -> CallResult:
    result = CallResult(completions={}, count_tokens=tokenizer.count_tokens)
    for each in steps:
        result.fold(each)
    return result


def test_a_harmony_answers_reasoning_is_counted_in_the_chat_usage(tokenizer: Tokenizer) -> None:
    result = folded(tokenizer, [step(ANSWER, 60)])
    expected = count(tokenizer)
    assert 5 < expected < 60
    assert result.reasoning_tokens == expected
    usage = result.usage()
    assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}
    assert usage["completion_tokens"] == 60 and usage["total_tokens"] == 72


def test_reasoning_is_counted_however_the_text_was_cut(tokenizer: Tokenizer) -> None:
    counts = {folded(tokenizer, [step(ANSWER, 60, cut=cut)]).reasoning_tokens for cut in (1, 3, 16, len(ANSWER))}
    assert counts == {count(tokenizer)}


def test_every_completion_counts_and_none_counts_past_its_own_length(tokenizer: Tokenizer) -> None:
    two = folded(tokenizer, [step(ANSWER, 60, index=0), step(ANSWER, 60, index=1)])
    assert two.reasoning_tokens == 2 * count(tokenizer)
    # A completion cannot have reasoned in more tokens than it produced.
    assert folded(tokenizer, [step(ANSWER, 3)]).reasoning_tokens == 3


def test_a_split_answer_without_reasoning_counts_zero_and_an_unsplit_one_has_no_details(tokenizer: Tokenizer) -> None:
    plain = folded(tokenizer, [step("Hello there!", 4)])
    assert plain.reasoning_tokens == 0
    assert plain.usage()["completion_tokens_details"] == {"reasoning_tokens": 0}
    unsplit = folded(tokenizer, [step(ANSWER, 60, parser=None)])
    assert unsplit.reasoning_tokens is None
    assert "completion_tokens_details" not in unsplit.usage()
    # Without a tokenizer to count with (a result made outside the pipeline), nothing is claimed.
    bare = CallResult(completions={})
    bare.fold(step(ANSWER, 60))
    assert bare.reasoning_tokens is None


def test_responses_and_grpc_usage_carry_the_same_count(tokenizer: Tokenizer) -> None:
    result = folded(tokenizer, [step(ANSWER, 60)])
    body = response_usage(12, 60, reasoning_tokens=result.reasoning_tokens or 0)
    assert body["output_tokens_details"] == {"reasoning_tokens": count(tokenizer)}
    stream = GrpcStream(n=1, tools=True, token_text=str)
    (delta,) = step(ANSWER, 60).deltas
    last = stream.response(delta, result)
    assert last.HasField("usage") and last.usage.reasoning_tokens == count(tokenizer)
    assert last.usage.completion_tokens == 60
