"""Prompts cut instead of refused (``rayturn.api.truncation``), through the ingress (no cluster: the decode pool is
replaced by a recorder of the calls sent to it): vLLM's ``truncate_prompt_tokens`` and ``truncation_side`` on chat
completions, completions and gRPC, the Responses API's ``truncation: "auto"``; what reaches the call is the kept
part of the prompt the call would have had, its pages hashed as such; bad values are a 400 naming the field (gRPC:
INVALID_ARGUMENT) with nothing sent; the published schemas agree."""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import jsonschema
import pytest

pytest.importorskip("ray")

from ingress_recorder import (
    APIS,
    RecordingPipeline,
    assert_refused,
    grpc_refusal,
    request_schema,
    send_grpc,
    send_http,
)

from rayturn.api.chat_prompt import render_chat
from rayturn.api.errors import APIError
from rayturn.api.openapi import openapi_document
from rayturn.api.truncation import Truncation, fit_messages
from rayturn.engine.page_hash import hash_pages
from rayturn.protos import rayturn_pb2 as pb

CONTEXT = 4096  # the tiny preset's max_model_len
LONG = "def step(x):\n    return x + 1\n" * 200  # ~6,200 tokens of the tiny preset's byte-level vocabulary
TRUNCATING_APIS = ["chat", "completions"]
DOCUMENT = openapi_document("tiny", vocab_size=263, max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def pipeline() -> RecordingPipeline:
    return RecordingPipeline()


def body_schema(api: str) -> jsonschema.Draft202012Validator:
    return request_schema(DOCUMENT, api)


def whole_prompt(pipeline: RecordingPipeline, api: str, text: str) -> list[int]:
    """The ids of the prompt ``api``'s small body makes of ``text``, uncut (as the pipeline renders it)."""
    if api == "completions":
        return pipeline.tokenizer.encode(text)
    rendered = render_chat(pipeline.tokenizer, [{"role": "user", "content": text}], None, None)
    return pipeline.tokenizer.encode(rendered, add_special_tokens=False)


def long_body(api: str, text: str = LONG) -> dict[str, Any]:
    return {"prompt": text} if api == "completions" else {"messages": [{"role": "user", "content": text}]}


# -- the rule -------------------------------------------------------------


def test_the_limit_keeps_room_for_the_answer_and_refuses_more_than_the_context() -> None:
    assert Truncation(-1).limit(CONTEXT, None) == CONTEXT - 1
    assert Truncation(-1).limit(CONTEXT, 100) == CONTEXT - 100
    assert Truncation(-1).limit(CONTEXT, CONTEXT) == 1  # refused then for its max_tokens, never emptied
    assert Truncation(30).limit(CONTEXT, 100) == 30
    assert Truncation(CONTEXT).limit(CONTEXT, None) == CONTEXT
    too_many = r"'truncate_prompt_tokens': at most max_model_len \(4096\) tokens fit, got 4097"
    with pytest.raises(APIError, match=too_many):
        Truncation(CONTEXT + 1).limit(CONTEXT, None)
    ids = list(range(10))
    assert Truncation(4, "left").tokens(ids, 4) == [6, 7, 8, 9]
    assert Truncation(4, "right").tokens(ids, 4) == [0, 1, 2, 3]
    assert Truncation(4, "left").tokens(ids, 10) is ids


def _conversation(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s" * rng.randint(1, 30)}]
    for _ in range(turns):
        kind = rng.choice(["user", "assistant", "tools"])
        if kind == "tools":
            messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]})
            messages += [{"role": "tool", "content": "t" * rng.randint(1, 40)} for _ in range(rng.randint(1, 3))]
        else:
            messages.append({"role": kind, "content": kind[0] * rng.randint(1, 40)})
    return messages


def _length_encoder(calls: list[int]) -> Any:
    def encode(messages: list[dict[str, Any]]) -> list[int]:
        calls.append(1)
        return [0] * sum(len(message["content"]) + 2 for message in messages)

    return encode


def test_messages_go_oldest_first_whole_and_never_leave_a_tool_result_first() -> None:
    """Against a linear search over every cut: the same conversation, the system messages kept, the first kept
    message after them a user or assistant one, and O(log n) renders."""
    rng = random.Random(7)
    for _ in range(300):
        messages = _conversation(rng, rng.randint(1, 40))
        limit = rng.randint(10, 400)
        calls: list[int] = []
        kept = fit_messages(messages, _length_encoder(calls), limit)
        linear = [messages[:1] + messages[i:] for i in range(2, len(messages)) if messages[i]["role"] != "tool"]
        fitting = [m for m in linear if sum(len(x["content"]) + 2 for x in m) <= limit]
        whole = sum(len(x["content"]) + 2 for x in messages)
        if whole <= limit:
            expected = whole
        elif fitting:
            expected = sum(len(x["content"]) + 2 for x in fitting[0])
        else:
            expected = whole  # nothing fits: the whole prompt, refused for its length
        assert len(kept) == expected
        assert len(calls) <= 2 + max(1, len(messages)).bit_length()


def test_a_conversation_that_fits_is_rendered_once() -> None:
    calls: list[int] = []
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert len(fit_messages(messages, _length_encoder(calls), 100)) == 8 and len(calls) == 1


# -- chat completions and completions -------------------------------------


@pytest.mark.parametrize("api", TRUNCATING_APIS)
def test_a_prompt_too_long_is_refused_without_truncation(pipeline: RecordingPipeline, api: str) -> None:
    status, body, call = send_http(pipeline, api, {**long_body(api), "max_tokens": 8})
    assert (status, call) == (400, None), body
    assert body["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("api", TRUNCATING_APIS)
@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        ({"truncate_prompt_tokens": -1, "max_tokens": 100}, slice(-(CONTEXT - 100), None)),
        ({"truncate_prompt_tokens": -1, "max_tokens": None}, slice(-(CONTEXT - 1), None)),
        ({"truncate_prompt_tokens": 40, "max_tokens": 8}, slice(-40, None)),
        ({"truncate_prompt_tokens": 40, "truncation_side": "left", "max_tokens": 8}, slice(-40, None)),
        ({"truncate_prompt_tokens": 40, "truncation_side": "right", "max_tokens": 8}, slice(0, 40)),
        ({"truncate_prompt_tokens": 40, "truncation_side": None, "max_tokens": 8}, slice(-40, None)),
        ({"truncate_prompt_tokens": CONTEXT, "truncation_side": "right", "max_tokens": None}, None),
    ],
    ids=["fit", "fit-no-max", "40", "40-left", "40-right", "40-null-side", "whole-context-right"],
)
def test_the_call_gets_the_kept_part_of_its_prompt(
    pipeline: RecordingPipeline, api: str, fields: dict[str, Any], kept: slice | None
) -> None:
    whole = whole_prompt(pipeline, api, LONG)
    assert len(whole) > CONTEXT + 1000
    status, body, call = send_http(pipeline, api, {**long_body(api), **fields})
    if kept is None:  # all 4,096 tokens kept: no room for an answer, refused for that
        assert (status, call) == (400, None) and body["error"]["code"] == "context_length_exceeded", body
        return
    assert status == 200 and call is not None, body
    assert list(call.prompt_token_ids) == whole[kept]
    expected_max = fields["max_tokens"] or (CONTEXT - len(whole[kept]) if api == "chat" else 1)
    assert call.params.max_tokens == min(expected_max, CONTEXT - len(whole[kept]))
    full_pages = (len(whole[kept]) - 1) // pipeline.page_size * pipeline.page_size
    assert list(call.page_hashes) == hash_pages(whole[kept][:full_pages], 16, pipeline.model_id, call.cache_salt)
    body_schema(api).validate({**APIS[api][2], **{k: v for k, v in fields.items() if v is not None}})


@pytest.mark.parametrize("api", TRUNCATING_APIS)
def test_a_prompt_that_fits_is_sent_whole(pipeline: RecordingPipeline, api: str) -> None:
    text = "print('short')\n"
    status, body, call = send_http(pipeline, api, {**long_body(api, text), "truncate_prompt_tokens": -1})
    assert status == 200 and call is not None, body
    assert list(call.prompt_token_ids) == whole_prompt(pipeline, api, text)


def test_a_text_past_the_untokenized_bound_is_tokenized_when_it_is_to_be_cut(pipeline: RecordingPipeline) -> None:
    """Without truncation a text longer than the context could hold is refused before tokenizing it; with one it is
    tokenized (the body's size bounds it) and cut."""
    text = "x = 1\n" * (pipeline.budget.max_chars // 6 + 10)
    status, body, _ = send_http(pipeline, "completions", {"prompt": text})
    assert status == 400 and "characters, at least" in body["error"]["message"], body
    status, body, call = send_http(pipeline, "completions", {"prompt": text, "truncate_prompt_tokens": 12})
    assert status == 200 and call is not None, body
    assert list(call.prompt_token_ids) == pipeline.tokenizer.encode(text)[-12:]


def test_token_id_prompts_are_cut_too(pipeline: RecordingPipeline) -> None:
    ids = [(7 * i) % 250 for i in range(CONTEXT + 500)]
    status, body, call = send_http(pipeline, "completions", {"prompt": ids, "truncate_prompt_tokens": -1})
    assert status == 200 and call is not None, body
    assert list(call.prompt_token_ids) == ids[-(CONTEXT - 2) :]  # room for the small body's max_tokens: 2


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 (as much as leaves room for the answer)"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "an integer >= -1"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens", "an integer"),
    ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens", "an integer"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens", "an integer"),
    ({"truncation_side": "middle", "truncate_prompt_tokens": 5}, "truncation_side", "one of left, right"),
    ({"truncation_side": 1}, "truncation_side", "a string"),
]


@pytest.mark.parametrize("api", TRUNCATING_APIS)
@pytest.mark.parametrize(("extra", "param", "said"), BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_a_bad_value_is_a_400_naming_the_field_and_nothing_is_sent(
    pipeline: RecordingPipeline, api: str, extra: dict[str, Any], param: str, said: str
) -> None:
    assert_refused(pipeline, api, extra, param, said, DOCUMENT)


@pytest.mark.parametrize("api", TRUNCATING_APIS)
def test_more_than_the_context_is_a_400_naming_the_field(pipeline: RecordingPipeline, api: str) -> None:
    status, body, call = send_http(pipeline, api, {"truncate_prompt_tokens": CONTEXT + 1})
    assert (status, call) == (400, None), body
    assert body["error"]["param"] == "truncate_prompt_tokens" and "at most max_model_len (4096)" in json.dumps(body)
    assert not body_schema(api).is_valid({**APIS[api][2], "truncate_prompt_tokens": CONTEXT + 1})
    body_schema(api).validate({**APIS[api][2], "truncate_prompt_tokens": CONTEXT})


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_apis_without_the_field_do_not_take_it(pipeline: RecordingPipeline, api: str) -> None:
    """Anthropic's and the Responses API's bodies ignore fields they do not name; the prompt stays whole."""
    status, body, call = send_http(pipeline, api, {"truncate_prompt_tokens": 3})
    assert status == 200 and call is not None and len(call.prompt_token_ids) > 3, body


# -- the Responses API's truncation: "auto" -------------------------------


def _item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _rendered(pipeline: RecordingPipeline, messages: list[dict[str, Any]]) -> list[int]:
    return pipeline.tokenizer.encode(render_chat(pipeline.tokenizer, messages, None, None), add_special_tokens=False)


def test_auto_drops_the_oldest_items_until_the_conversation_fits(pipeline: RecordingPipeline) -> None:
    """Twelve turns of ~600 tokens with the instructions first: the call gets the instructions and the latest turns,
    as many as fit with the answer's room; one more turn would not have fit."""
    turns = [(role, f"turn {i}: " + "y = f(y)\n" * 60) for i in range(12) for role in ("user", "assistant")][:-1]
    items = [_item(role, text) for role, text in turns]
    body = {"input": items, "instructions": "You are terse.", "max_output_tokens": 300}
    status, answer, call = send_http(pipeline, "responses", body)
    assert (status, call) == (400, None) and answer["error"]["code"] == "context_length_exceeded", answer
    status, answer, call = send_http(pipeline, "responses", {**body, "truncation": "auto"})
    assert status == 200 and call is not None, answer
    system = [{"role": "system", "content": "You are terse."}]
    messages = [{"role": role, "content": text} for role, text in turns]
    fits = [i for i in range(1, len(messages)) if len(_rendered(pipeline, system + messages[i:])) <= CONTEXT - 300]
    assert fits and fits[0] > 1
    assert list(call.prompt_token_ids) == _rendered(pipeline, system + messages[fits[0] :])
    assert call.params.max_tokens == 300
    assert answer["truncation"] == "auto"


def test_auto_keeps_a_tool_result_with_its_call(pipeline: RecordingPipeline) -> None:
    """A long conversation ending in a tool loop: the kept part starts at a user or assistant message (here the
    assistant's call), never at the tool output alone."""
    items: list[dict[str, Any]] = [_item("user", "old " * 1500)]
    items += [
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "contents " * 200},
        _item("user", "now fix it"),
    ]
    tools = [{"type": "function", "name": "read", "parameters": {"type": "object"}}]
    status, answer, call = send_http(pipeline, "responses", {"input": items, "tools": tools, "truncation": "auto"})
    assert status == 200 and call is not None, answer
    text = pipeline.tokenizer.decode(list(call.prompt_token_ids))
    assert "old old" not in text and "contents contents" in text and "now fix it" in text and '"read"' in text


def test_auto_cannot_help_a_last_message_too_long_alone(pipeline: RecordingPipeline) -> None:
    body = {"input": [_item("user", "hi"), _item("assistant", "yo"), _item("user", LONG)], "truncation": "auto"}
    status, answer, call = send_http(pipeline, "responses", body)
    assert (status, call) == (400, None) and answer["error"]["code"] == "context_length_exceeded", answer


# -- gRPC -----------------------------------------------------------------


def test_grpc_sampling_options_carry_it(pipeline: RecordingPipeline) -> None:
    whole = pipeline.tokenizer.encode(LONG)
    sampling = pb.SamplingOptions(truncate_prompt_tokens=-1, max_tokens=50)
    assert list(send_grpc(pipeline, pb.GenerateRequest(text=LONG, sampling=sampling)).prompt_token_ids) == whole[-4046:]
    sampling = pb.SamplingOptions(truncate_prompt_tokens=30, truncation_side="right")
    ids = pb.TokenIds(ids=whole)
    call = send_grpc(pipeline, pb.GenerateRequest(token_ids=ids, sampling=sampling))
    assert list(call.prompt_token_ids) == whole[:30]
    messages = pb.Messages(messages=[pb.ChatMessage(role="user", content=LONG)])
    sampling = pb.SamplingOptions(truncate_prompt_tokens=64)
    call = send_grpc(pipeline, pb.GenerateRequest(messages=messages, sampling=sampling))
    assert list(call.prompt_token_ids) == whole_prompt(pipeline, "chat", LONG)[-64:]
    unset = send_grpc(pipeline, pb.GenerateRequest(text="hi"))
    assert list(unset.prompt_token_ids) == pipeline.tokenizer.encode("hi")


@pytest.mark.parametrize(
    ("sampling", "said"),
    [
        (pb.SamplingOptions(truncate_prompt_tokens=0), "'sampling.truncate_prompt_tokens': expected -1"),
        (pb.SamplingOptions(truncate_prompt_tokens=-5), "'sampling.truncate_prompt_tokens': expected -1"),
        (pb.SamplingOptions(truncate_prompt_tokens=CONTEXT + 1), "'sampling.truncate_prompt_tokens': at most"),
        (pb.SamplingOptions(truncate_prompt_tokens=5, truncation_side="up"), "'sampling.truncation_side': expected"),
        (pb.SamplingOptions(max_tokens=8), "maximum context length"),
    ],
)
def test_bad_grpc_values_are_invalid_argument(pipeline: RecordingPipeline, sampling: Any, said: str) -> None:
    context = grpc_refusal(pipeline, pb.GenerateRequest(text=LONG, sampling=sampling))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and said in context.details, context.details
