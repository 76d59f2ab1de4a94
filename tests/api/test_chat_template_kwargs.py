"""vLLM's ``chat_template_kwargs``: more variables for the model's chat template, checked against
``transformers.apply_chat_template`` with the same variables on the same tokenizer files.

The model directory here carries a Qwen3-style template (``enable_thinking``
and a string variable); the prompt the ingress computes for a call of every
HTTP API that takes a chat (chat completions, Anthropic Messages and its token
count, Responses), the ids ``/tokenize`` gives and a cache breakpoint's
retained prefix all see the variables.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rayturn.api.anthropic_request import parse_count_tokens_request, parse_messages_request
from rayturn.api.chat_request import RESERVED_KWARGS, parse_chat_request
from rayturn.api.errors import APIError
from rayturn.api.pipeline import CallPipeline
from rayturn.api.protocol import CachePoint
from rayturn.api.responses_request import parse_responses_request
from rayturn.api.serving_tokens import ServingTokens
from rayturn.api.settings import IngressSettings
from rayturn.api.tokenize_request import parse_tokenize_request
from rayturn.engine.presets import preset_dir

transformers = pytest.importorskip("transformers")

QWEN3_STYLE_TEMPLATE = """\
{%- if reasoning_effort is defined %}
{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}
{%- endif %}
{%- if persona is defined %}
{{- '<|im_start|>system\\n' + persona + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
MODEL = "qwen3-style"
MESSAGES = [{"role": "user", "content": "Rename f to g in src/app.py"}]
EPHEMERAL = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-style")
    tiny = preset_dir("tiny")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny / name, directory / name)
    (directory / "model.safetensors").symlink_to(tiny / "model.safetensors")
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_STYLE_TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def pipeline(model_dir: Path) -> CallPipeline:
    return CallPipeline(None, None, None, IngressSettings(model=str(model_dir), served_model_name=MODEL, page_size=16))


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _hf_ids(hf_tokenizer: Any, messages: list[dict[str, Any]], **variables: Any) -> list[int]:
    ids: list[int] = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True, **variables
    )
    return ids


@pytest.mark.parametrize(
    "variables",
    [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"enable_thinking": False, "persona": "a terse agent"}],
    ids=["none", "thinking-off", "thinking-on", "two"],
)
def test_a_chat_calls_prompt_and_tokenize_see_the_variables_as_transformers_does(
    pipeline: CallPipeline, hf_tokenizer: Any, variables: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}
    if variables:
        body["chat_template_kwargs"] = variables
    expected = _hf_ids(hf_tokenizer, MESSAGES, **variables)
    chat = parse_chat_request(body, MODEL)
    assert asyncio.run(pipeline.chat_prompt(chat, 100)) == expected
    tokenized = ServingTokens(pipeline)._tokenize(parse_tokenize_request(body, MODEL))
    assert tokenized["tokens"] == expected
    text = hf_tokenizer.decode(expected)
    assert text.endswith("<think>\n\n</think>\n\n") == (variables.get("enable_thinking") is False)
    assert ("a terse agent" in text) == ("persona" in variables)


def test_a_retained_prefix_is_measured_with_the_same_variables(pipeline: CallPipeline, hf_tokenizer: Any) -> None:
    """A cache breakpoint after the first message keeps that message's prefix, rendered with the call's
    variables: with the persona it starts with the persona's system turn, which a rendering without it lacks."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Now test it"}]
    variables = {"persona": "a terse agent"}
    chat = parse_chat_request({"messages": messages, "chat_template_kwargs": variables}, MODEL)
    chat = dataclasses.replace(chat, cache_points=(CachePoint(num_messages=1, ttl_s=300.0),))
    prompt_ids = asyncio.run(pipeline.chat_prompt(chat, 100))
    retention = asyncio.run(pipeline.retention(chat, prompt_ids))
    prefix = hf_tokenizer.apply_chat_template(
        messages[:1], tokenize=True, return_dict=False, add_generation_prompt=False, **variables
    )
    assert prompt_ids[: len(prefix)] == prefix and len(prefix) > 20
    assert retention is not None and (retention.num_tokens, retention.ttl_s) == (len(prefix), 300.0)


def test_anthropic_and_responses_calls_carry_them_too(pipeline: CallPipeline, hf_tokenizer: Any) -> None:
    """An Anthropic breakpoint after the first message keeps that message's prefix rendered with the persona;
    the token count and a Responses call see the same prompt."""
    variables = {"persona": "a terse agent", "enable_thinking": False}
    turns = [
        {"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"], "cache_control": EPHEMERAL}]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Now test it"},
    ]
    body = {"model": MODEL, "max_tokens": 8, "messages": turns, "chat_template_kwargs": variables}
    chat = parse_messages_request(body, MODEL).chat
    assert chat.template_kwargs == variables
    prompt_ids = asyncio.run(pipeline.chat_prompt(chat, 100))
    plain = [{"role": "user", "content": MESSAGES[0]["content"]}, *turns[1:]]
    assert prompt_ids == _hf_ids(hf_tokenizer, plain, **variables)
    retention = asyncio.run(pipeline.retention(chat, prompt_ids))
    prefix = hf_tokenizer.apply_chat_template(
        plain[:1], tokenize=True, return_dict=False, add_generation_prompt=False, **variables
    )
    assert retention is not None and retention.num_tokens == len(prefix) and prompt_ids[: len(prefix)] == prefix
    counted = parse_count_tokens_request({k: v for k, v in body.items() if k != "max_tokens"}, MODEL)
    assert asyncio.run(pipeline.chat_prompt(counted, 100)) == prompt_ids
    responses = parse_responses_request({"model": MODEL, "input": plain, "chat_template_kwargs": variables}, MODEL)
    assert asyncio.run(pipeline.chat_prompt(responses.chat(), 100)) == prompt_ids


def _anthropic_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": MESSAGES, "chat_template_kwargs": kwargs}


PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "chat": lambda kwargs: parse_chat_request({"messages": MESSAGES, "chat_template_kwargs": kwargs}, MODEL),
    "tokenize": lambda kwargs: parse_tokenize_request({"messages": MESSAGES, "chat_template_kwargs": kwargs}, MODEL),
    "messages": lambda kwargs: parse_messages_request(_anthropic_body(kwargs), MODEL),
    "responses": lambda kwargs: parse_responses_request({"input": "hi", "chat_template_kwargs": kwargs}, MODEL),
}


@pytest.mark.parametrize("api", list(PARSERS))
@pytest.mark.parametrize("name", ["tools", "add_generation_prompt", "messages", "raise_exception", "chat_template"])
def test_variables_the_server_sets_are_refused_by_name(api: str, name: str) -> None:
    assert name in RESERVED_KWARGS
    with pytest.raises(APIError) as caught:
        PARSERS[api]({"enable_thinking": False, name: 1})
    assert caught.value.status_code == 400 and caught.value.param == f"chat_template_kwargs.{name}"
    assert "the server sets" in caught.value.message


def test_kwargs_must_be_an_object_and_a_value_the_template_cannot_use_is_a_400(pipeline: CallPipeline) -> None:
    with pytest.raises(APIError) as caught:
        parse_chat_request({"messages": MESSAGES, "chat_template_kwargs": ["enable_thinking"]}, MODEL)
    assert caught.value.param == "chat_template_kwargs" and "an object" in caught.value.message
    chat = parse_chat_request({"messages": MESSAGES, "chat_template_kwargs": {"persona": 7}}, MODEL)
    with pytest.raises(APIError) as caught:  # '<|im_start|>system\n' + 7: the template's TypeError
        asyncio.run(pipeline.chat_prompt(chat, 100))
    assert caught.value.status_code == 400 and caught.value.param == "messages"
    assert "TypeError" in caught.value.message
    assert parse_chat_request({"messages": MESSAGES, "chat_template_kwargs": {}}, MODEL).template_kwargs is None


REASONING_CASES = [
    ({"reasoning_effort": "high"}, {"reasoning_effort": "high", "enable_thinking": True}),
    ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "enable_thinking": False}),
    (
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "low"}},
        {"reasoning_effort": "high", "enable_thinking": False},
    ),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}}, {"reasoning_effort": "low"}),
]


@pytest.mark.parametrize(("fields", "variables"), REASONING_CASES, ids=["high", "none", "both", "kwargs-only"])
def test_a_reasoning_effort_reaches_the_template_as_vllm_passes_it(
    pipeline: CallPipeline, hf_tokenizer: Any, fields: dict[str, Any], variables: dict[str, Any]
) -> None:
    """The field's effort is ``reasoning_effort`` (over the kwargs'), and ``enable_thinking`` is false for "none"
    unless the kwargs name it: on chat completions, and from Responses' ``reasoning.effort``."""
    expected = _hf_ids(hf_tokenizer, MESSAGES, **variables)
    chat = parse_chat_request({"messages": MESSAGES, **fields}, MODEL)
    assert chat.template_kwargs == variables
    assert asyncio.run(pipeline.chat_prompt(chat, 100)) == expected
    responses_body: dict[str, Any] = {"input": MESSAGES}
    if "reasoning_effort" in fields:
        responses_body["reasoning"] = {"effort": fields["reasoning_effort"], "summary": "auto"}
    if "chat_template_kwargs" in fields:
        responses_body["chat_template_kwargs"] = fields["chat_template_kwargs"]
    responses = parse_responses_request(responses_body, MODEL)
    assert asyncio.run(pipeline.chat_prompt(responses.chat(), 100)) == expected
    assert responses.echo["reasoning"]["effort"] == fields.get("reasoning_effort")


@pytest.mark.parametrize(
    ("fields", "effort"),
    [
        ({"output_config": {"effort": "high"}}, "high"),
        ({"output_config": {"effort": "high"}, "thinking": {"type": "disabled"}}, "none"),
        ({"thinking": {"type": "adaptive"}}, None),
        ({"output_config": {"effort": "ultra"}}, None),  # a later Claude Code's: left out, the call goes on
    ],
)
def test_claude_codes_effort_and_disabled_thinking_reach_the_template(
    pipeline: CallPipeline, hf_tokenizer: Any, fields: dict[str, Any], effort: str | None
) -> None:
    chat = parse_messages_request({"model": MODEL, "max_tokens": 8, "messages": MESSAGES, **fields}, MODEL).chat
    variables = {} if effort is None else {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    assert chat.template_kwargs == (variables or None)
    assert asyncio.run(pipeline.chat_prompt(chat, 100)) == _hf_ids(hf_tokenizer, MESSAGES, **variables)


def test_an_effort_openai_does_not_define_is_a_400_naming_the_field() -> None:
    with pytest.raises(APIError) as caught:
        parse_chat_request({"messages": MESSAGES, "reasoning_effort": "ultra"}, MODEL)
    assert caught.value.param == "reasoning_effort" and "one of none, minimal" in caught.value.message
    with pytest.raises(APIError) as caught:
        parse_responses_request({"input": "hi", "reasoning": {"effort": "ultra"}}, MODEL)
    assert caught.value.param == "reasoning.effort"
