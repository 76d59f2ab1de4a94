"""vLLM's ``/tokenize`` and ``/detokenize`` bodies, parsed (no cluster; the routes against a real server are in
``tests/cluster/test_openai_compat.py``, the key check in ``tests/cluster/test_security.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from rayturn.api.errors import APIError
from rayturn.api.tokenize_request import TokenizeRequest, parse_detokenize_request, parse_tokenize_request

MODEL = "tiny"
USER = {"role": "user", "content": "hi"}
TOOL_A = {"type": "function", "function": {"name": "a"}}
TOOL_B = {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}


def _refused(body: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_tokenize_request(body, MODEL)
    return caught.value


def test_a_text_takes_special_tokens_by_default_and_a_chat_does_not() -> None:
    text = parse_tokenize_request({"prompt": "hi"}, MODEL)
    assert text == TokenizeRequest("hi", None, None, False, False, True, False)
    assert parse_tokenize_request({"prompt": "", "add_special_tokens": False}, MODEL).add_special_tokens is False
    chat = parse_tokenize_request({"model": "", "messages": [USER], "return_token_strs": True}, MODEL)
    assert chat == TokenizeRequest(None, [USER], None, True, False, False, True)


@pytest.mark.parametrize(
    ("choice", "shown"),
    [(None, ["a", "b"]), ("auto", ["a", "b"]), ("required", ["a", "b"]), ("none", None), ("b", ["b"])],
)
def test_a_chats_tools_are_shown_as_the_chat_call_shows_them(choice: str | None, shown: list[str] | None) -> None:
    body: dict[str, Any] = {"messages": [USER], "tools": [TOOL_A, TOOL_B]}
    if choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": choice}} if choice == "b" else choice
    tools = parse_tokenize_request(body, MODEL).tools
    assert (None if tools is None else [tool["function"]["name"] for tool in tools]) == shown


def test_a_prompt_left_open_has_no_generation_prompt() -> None:
    messages = [USER, {"role": "assistant", "content": "Sure"}]
    parsed = parse_tokenize_request({"messages": messages, "continue_final_message": True}, MODEL)
    assert (parsed.continue_final_message, parsed.add_generation_prompt) == (True, False)
    parsed = parse_tokenize_request({"messages": messages, "add_generation_prompt": False}, MODEL)
    assert (parsed.continue_final_message, parsed.add_generation_prompt) == (False, False)
    both = _refused({"messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    assert both.param == "continue_final_message" and "both" in both.message


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({}, "prompt", "Missing required parameter: 'prompt' or 'messages'."),
        ({"prompt": "a", "messages": [USER]}, "messages", "not both"),
        ({"prompt": "a", "continue_final_message": False}, "continue_final_message", "goes with 'messages'"),
        ({"prompt": ["a"]}, "prompt", "expected a string, got an array"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
        ({"messages": [USER], "tools": [TOOL_A, TOOL_A]}, "tools[1].function.name", "duplicate"),
        ({"messages": [USER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", ""),
        ({"messages": [USER], "chat_template": "{{ messages }}"}, "chat_template", "does not support"),
        ({"prompt": "a", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "'messages'"),
        ({"messages": [USER], "return_token_strs": "yes"}, "return_token_strs", "a boolean"),
        ({"messages": [USER], "model": "other"}, "model", "'other' does not exist"),
    ],
)
def test_bad_tokenize_bodies_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    error = _refused(body)
    assert error.param is not None and error.param.startswith(param) and words in error.message, error.message


def test_detokenize_takes_ids_of_the_vocabulary_only() -> None:
    assert parse_detokenize_request({"tokens": [0, 5, 262, 7.0]}, MODEL, 263) == [0, 5, 262, 7]
    assert parse_detokenize_request({"tokens": []}, MODEL, 263) == []
    for tokens, param in (([1, 263], "tokens[1]"), ([-1], "tokens[0]"), ([1, None], "tokens[1]"), ({}, "tokens")):
        with pytest.raises(APIError) as caught:
            parse_detokenize_request({"tokens": tokens}, MODEL, 263)
        assert caught.value.status_code == 400 and caught.value.param == param
