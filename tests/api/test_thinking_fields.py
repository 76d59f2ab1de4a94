"""A budget on the answer's reasoning as each API says it (vLLM's ``thinking_token_budget`` on chat and gRPC,
Anthropic's ``thinking.budget_tokens``), refused where it cannot hold, and what a chat call's sampling becomes
with the server's reasoning parser (``thinking_fields.chat_reasoning``)."""

from __future__ import annotations

from typing import Any

import pytest

from rayturn.api.anthropic_request import parse_messages_request
from rayturn.api.chat_request import parse_chat_request
from rayturn.api.completion_request import parse_completion_request
from rayturn.api.errors import APIError
from rayturn.api.grpc_request import parse_generate_request
from rayturn.api.streaming import ChatStreamState
from rayturn.api.thinking_fields import chat_reasoning
from rayturn.engine import Guide, SamplingParams
from rayturn.engine.thinking import ThinkingBudget
from rayturn.protos import rayturn_pb2 as pb

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "plan it"}]


def chat(**fields: Any) -> Any:
    return parse_chat_request({"messages": MESSAGES, **fields}, MODEL)


def messages(**fields: Any) -> Any:
    return parse_messages_request({"messages": MESSAGES, "max_tokens": 64, **fields}, MODEL).chat


def refused(parse: Any, param: str, words: str) -> None:
    with pytest.raises(APIError) as caught:
        parse()
    assert caught.value.status_code == 400 and caught.value.param == param
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("value", "budget", "param"),
    [(0, 0, "thinking_token_budget"), (512, 512, "thinking_token_budget"), (-1, None, None), (None, None, None)],
)
def test_vllms_budget_on_chat(value: int | None, budget: int | None, param: str | None) -> None:
    sampling = chat(thinking_token_budget=value).sampling
    assert (sampling.thinking_token_budget, sampling.thinking_budget_param) == (budget, param)


@pytest.mark.parametrize("value", [-2, 1.5, "64", True])
def test_a_bad_budget_is_a_400_naming_it(value: Any) -> None:
    refused(lambda: chat(thinking_token_budget=value), "thinking_token_budget", "thinking_token_budget")


def test_completions_refuse_a_budget_they_have_no_reasoning_for() -> None:
    body = {"prompt": "x", "thinking_token_budget": 8}
    refused(lambda: parse_completion_request(body, MODEL), "thinking_token_budget", "/v1/chat/completions")
    assert (
        parse_completion_request({"prompt": "x", "thinking_token_budget": -1}, MODEL).sampling.thinking_token_budget
        is None
    )


def test_anthropics_thinking_budget() -> None:
    enabled = messages(thinking={"type": "enabled", "budget_tokens": 2048}).sampling
    assert (enabled.thinking_token_budget, enabled.thinking_budget_param) == (2048, "thinking.budget_tokens")
    disabled = messages(thinking={"type": "disabled"})
    assert disabled.sampling.thinking_token_budget is None
    assert disabled.template_kwargs == {"enable_thinking": False, "reasoning_effort": "none"}
    assert messages(thinking={"type": "adaptive"}).sampling.thinking_token_budget is None
    refused(lambda: messages(thinking={"type": "enabled"}), "thinking.budget_tokens", "thinking.budget_tokens")
    refused(
        lambda: messages(thinking={"type": "enabled", "budget_tokens": -3}),
        "thinking.budget_tokens",
        "thinking.budget_tokens",
    )
    refused(lambda: messages(thinking="on"), "thinking", "thinking")


def test_grpc_budget_needs_messages_input_and_a_sane_value() -> None:
    conversation = pb.Messages(messages=[pb.ChatMessage(role="user", content="plan it")])
    sampling = pb.SamplingOptions(thinking_token_budget=16)
    parsed = parse_generate_request(pb.GenerateRequest(messages=conversation, sampling=sampling), MODEL)
    assert parsed.sampling.thinking_token_budget == 16
    unbounded = pb.SamplingOptions(thinking_token_budget=-1)
    assert (
        parse_generate_request(
            pb.GenerateRequest(messages=conversation, sampling=unbounded), MODEL
        ).sampling.thinking_token_budget
        is None
    )
    refused(
        lambda: parse_generate_request(pb.GenerateRequest(text="x", sampling=sampling), MODEL),
        "sampling.thinking_token_budget",
        "needs 'messages' input",
    )
    bad = pb.SamplingOptions(thinking_token_budget=-4)
    refused(
        lambda: parse_generate_request(pb.GenerateRequest(messages=conversation, sampling=bad), MODEL),
        "sampling.thinking_token_budget",
        "-1 for no bound",
    )


def test_a_chat_call_with_a_reasoning_parser_bounds_its_reasoning_and_guides_after_it() -> None:
    params = SamplingParams(guide=Guide.json_object())
    reasoning, bounded = chat_reasoning("qwen3", chat(thinking_token_budget=32), params)
    assert reasoning == "qwen3"
    assert bounded.thinking_budget == ThinkingBudget(32, "</think>")
    assert bounded.guide == Guide("json_object", after="</think>")
    # Thinking off: no reasoning to split, bound or wait for.
    off = chat(thinking_token_budget=32, chat_template_kwargs={"enable_thinking": False})
    assert chat_reasoning("qwen3", off, params) == (None, params)
    assert chat_reasoning("deepseek_r1", chat(), SamplingParams())[1].thinking_budget is None


def test_without_a_reasoning_parser_vllms_budget_is_refused_and_anthropics_left_unused() -> None:
    refused(
        lambda: chat_reasoning(None, chat(thinking_token_budget=32), SamplingParams()),
        "thinking_token_budget",
        "--reasoning-parser",
    )
    params = SamplingParams()
    anthropic = messages(thinking={"type": "enabled", "budget_tokens": 4096})
    assert chat_reasoning(None, anthropic, params) == (None, params)  # Claude Code sends one with every call
    assert chat_reasoning(None, chat(), params) == (None, params)


def test_include_reasoning_false_leaves_the_reasoning_out_of_chat_chunks() -> None:
    text = "<think>\nweigh it\n</think>\n\nDone."
    for include, expected in ((True, ("weigh it", "Done.")), (False, ("", "Done."))):
        request = chat(include_reasoning=include)
        assert request.include_reasoning is include
        state = ChatStreamState.for_request(request, 0, reasoning="deepseek_r1")
        state.start()
        chunks = [state.push(piece) for piece in (text[:12], text[12:])] + [state.finish("stop")]
        deltas = [chunk["delta"] for chunk in chunks if chunk is not None]
        joined = tuple("".join(delta.get(key, "") for delta in deltas) for key in ("reasoning", "content"))
        assert joined == expected
