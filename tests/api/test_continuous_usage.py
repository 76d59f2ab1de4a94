"""vLLM's ``stream_options.continuous_usage_stats``: with ``include_usage``, every chunk of a streamed chat completion
or completion carries the usage so far. Through the ingress's real chat and completion paths, with the decode pool
replaced by one that answers scripted steps (two answers, steps of one or two tokens): the first chunk counts no
answer tokens, each later chunk the tokens sent up to it, the last the whole answer; the final usage chunk is as
before; every chat chunk, and every completion chunk's usage, is valid for the ``openai`` SDK; a bad value is a 400
naming the field, as the published schema says."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ingress_recorder import RecordingPipeline, ScriptedDecode, assert_refused, http_request
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionChunk

from rayturn.api.chat_request import parse_chat_request
from rayturn.api.completion_request import parse_completion_request
from rayturn.api.openapi import openapi_document
from rayturn.api.pipeline import CallPipeline
from rayturn.api.serving_chat import ServingChat
from rayturn.api.serving_completion import ServingCompletion
from rayturn.api.settings import IngressSettings
from rayturn.messages import Delta, Step

MODEL = "tiny"
DOCUMENT = openapi_document(MODEL, vocab_size=263, max_model_len=4096)
PROMPT_TOKENS, CACHED_TOKENS, LOADED_TOKENS = 9, 4, 2
# Per step, each answer's (index, token ids, text, finish reason): answer 1 takes two tokens in one step.
STEPS = (
    ((0, (72,), "H", None), (1, (65, 66), "AB", None)),
    ((0, (105,), "i", None),),
    ((0, (33,), "!", "stop"), (1, (67,), "C", "length")),
)
ANSWER_TOKENS = sum(len(ids) for step in STEPS for _, ids, _, _ in step)


def scripted_steps() -> tuple[Step, ...]:
    """``STEPS`` as the decode pool streams them (the last ending the call)."""
    return tuple(
        Step(
            tuple(Delta(index, ids, text, None, reason) for index, ids, text, reason in step),
            PROMPT_TOKENS,
            CACHED_TOKENS,
            LOADED_TOKENS,
            finished=i == len(STEPS) - 1,
            path="local",
            replica_id=None,
        )
        for i, step in enumerate(STEPS)
    )


def stream(serving_class: type[Any], body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of ``body``'s stream (``[DONE]`` left out)."""
    settings = IngressSettings(model=MODEL, served_model_name=MODEL, page_size=16)
    pipeline = CallPipeline(ScriptedDecode(scripted_steps()), None, None, settings)

    async def go() -> list[dict[str, Any]]:
        response = await serving_class(pipeline).create(http_request({"stream": True, **body}), "request-1")
        text = "".join([frame if isinstance(frame, str) else frame.decode() async for frame in response.body_iterator])
        return [json.loads(line[len("data: ") :]) for line in text.split("\n") if line.startswith("data: {")]

    return asyncio.run(go())


def counts(usage: dict[str, Any]) -> tuple[int, int, int, int, int]:
    details = usage["prompt_tokens_details"]
    return (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["total_tokens"],
        details["cached_tokens"],
        details["kv_store_tokens"],
    )


def so_far(prompt_tokens: int, answered: int) -> tuple[int, int, int, int, int]:
    return prompt_tokens, answered, prompt_tokens + answered, CACHED_TOKENS, LOADED_TOKENS


CHAT = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3}
BOTH = {"include_usage": True, "continuous_usage_stats": True}


def test_every_chat_chunk_carries_the_usage_so_far() -> None:
    chunks = stream(ServingChat, {**CHAT, "stream_options": BOTH})
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    *streamed, final = chunks
    assert final["choices"] == [] and "energy" in final["usage"]
    assert counts(final["usage"]) == so_far(PROMPT_TOKENS, ANSWER_TOKENS)
    # The roles (no token yet), then per step its text chunk and, on the last, its finish chunk.
    assert [counts(chunk["usage"]) for chunk in streamed] == [
        so_far(PROMPT_TOKENS, answered) for answered in (0, 3, 4, 6, 6)
    ]
    assert all("energy" not in chunk["usage"] for chunk in streamed)
    texts = ["".join(c["delta"].get("content") or "" for c in chunk["choices"]) for chunk in streamed]
    assert texts == ["", "HAB", "i", "!C", ""]


@pytest.mark.parametrize(
    "options",
    [
        {"include_usage": True},
        {"continuous_usage_stats": True},
        {"include_usage": False, "continuous_usage_stats": True},
    ],
)
def test_without_both_options_chunks_carry_no_usage_as_before(options: dict[str, Any]) -> None:
    """Continuous stats take effect only with ``include_usage``, as in vLLM; alone they change nothing."""
    chunks = stream(ServingChat, {**CHAT, "stream_options": options})
    include = options.get("include_usage", False)
    streamed = chunks[:-1] if include else chunks
    assert all(chunk.get("usage") is None for chunk in streamed)
    if include:
        assert counts(chunks[-1]["usage"]) == so_far(PROMPT_TOKENS, ANSWER_TOKENS)
    parsed = parse_chat_request({**CHAT, "stream": True, "stream_options": options}, MODEL)
    assert (parsed.include_usage, parsed.continuous_usage) == (include, False)


def test_every_completion_chunk_of_several_prompts_counts_the_prompts_begun() -> None:
    body = {"prompt": ["hi", "ho"], "n": 2, "max_tokens": 3, "stream_options": BOTH}
    chunks = stream(ServingCompletion, body)
    *streamed, final = chunks
    for chunk in chunks:
        CompletionUsage.model_validate(chunk["usage"])
    assert counts(final["usage"]) == (
        2 * PROMPT_TOKENS,
        2 * ANSWER_TOKENS,
        2 * (PROMPT_TOKENS + ANSWER_TOKENS),
        2 * CACHED_TOKENS,
        2 * LOADED_TOKENS,
    )
    # Each chunk: the prompts whose answers have begun, and every answer's tokens sent up to it; the last
    # chunk's counts are the final usage's.
    answered = 0
    begun: set[int] = set()
    for chunk in streamed:
        begun |= {choice["index"] // 2 for choice in chunk["choices"]}
        answered += sum(len(choice["text"]) for choice in chunk["choices"])  # one letter per scripted token
        usage = chunk["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(begun) * PROMPT_TOKENS, answered)
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(begun) * CACHED_TOKENS
    assert counts(streamed[-1]["usage"]) == counts(final["usage"])


def test_a_scored_prompt_counts_no_answer_tokens() -> None:
    """``echo`` with ``max_tokens: 0`` generates nothing: the chunks count the prompt only."""
    body = {"prompt": "hi", "echo": True, "max_tokens": 0, "stream_options": BOTH}
    chunks = stream(ServingCompletion, body)
    assert [chunk["usage"]["completion_tokens"] for chunk in chunks] == [0] * len(chunks)
    assert chunks[-1]["usage"]["prompt_tokens"] == PROMPT_TOKENS


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_bad_value_is_a_400_naming_it_as_the_schema_says(api: str) -> None:
    extra = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}}
    assert_refused(
        RecordingPipeline(), api, extra, "stream_options.continuous_usage_stats", "expected a boolean", DOCUMENT
    )
    parsed = parse_completion_request({"prompt": "hi", "stream": True, "stream_options": BOTH}, MODEL)
    assert (parsed.include_usage, parsed.continuous_usage) == (True, True)
