"""Chat template rendering, checked against ``transformers.apply_chat_template``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rayturn.engine.byte_tokenizer import BOS_TOKEN, CHATML_TOOLS_TEMPLATE, save_byte_tokenizer
from rayturn.engine.chat_template import ChatTemplate, ChatTemplateError
from rayturn.engine.tokenizer import Tokenizer

LLAMA3_STYLE_TEMPLATE = """\
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. " }}
    {{- "To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'ipython', 'tool'] %}
        {{- raise_exception("Unknown role '" + message.role + "': roles must be user/assistant/ipython/tool") }}
    {%- endif %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

BOS_TOKEN_ID = 256

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}


def _weather_call(city: str) -> dict[str, Any]:
    return {"name": "get_weather", "arguments": {"city": city}}


SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there 👋"},
    ],
    "user_only": [{"role": "user", "content": "2+2?"}],
    "multi_turn": [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! 你好"},
        {"role": "user", "content": "Again"},
    ],
    "assistant_tool_calls": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": _weather_call("Paris")},
                {"id": "call_2", "type": "function", "function": _weather_call("Roma")},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."},
        {"role": "user", "content": "Thanks"},
    ],
    "openai_string_arguments": [
        {"role": "user", "content": "Search cats"},
        {
            "role": "assistant",
            "content": "Searching.",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": '{"hits": 3}'},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look"}]},
    ],
}


@pytest.fixture(scope="module")
def byte_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("chatml")
    save_byte_tokenizer(directory, CHATML_TOOLS_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def llama_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama_style")
    save_byte_tokenizer(directory, LLAMA3_STYLE_TEMPLATE)
    return directory


def _hf_tokenizer(directory: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def hf_chatml(byte_tokenizer_dir: Path) -> Any:
    return _hf_tokenizer(byte_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_llama_style(llama_style_dir: Path) -> Any:
    return _hf_tokenizer(llama_style_dir)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _hf_ids(hf_tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    encoded = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(encoded["input_ids"])


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL, SEARCH_TOOL]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen_prompt", "no_gen_prompt"])
def test_chatml_matches_transformers(
    byte_tokenizer_dir: Path,
    hf_chatml: Any,
    name: str,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> None:
    messages = CONVERSATIONS[name]
    ours = Tokenizer.from_dir(byte_tokenizer_dir)
    expected_text = hf_chatml.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt) == expected_text
    expected_ids = _hf_ids(hf_chatml, messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert ours.encode_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt) == expected_ids


def test_chatml_renders_tool_calls_and_grouped_tool_responses(byte_tokenizer_dir: Path) -> None:
    text = Tokenizer.from_dir(byte_tokenizer_dir).apply_chat_template(CONVERSATIONS["assistant_tool_calls"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    grouped_responses = "<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n</tool_response>"
    assert f"<|im_start|>user\n{grouped_responses}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chatml_lists_tools_in_system_prompt(byte_tokenizer_dir: Path) -> None:
    ours = Tokenizer.from_dir(byte_tokenizer_dir)
    text = ours.apply_chat_template(CONVERSATIONS["system_user"], tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(WEATHER_TOOL, ensure_ascii=False)}\n</tools>" in text


@pytest.mark.parametrize(
    ("messages", "extra"),
    [
        (CONVERSATIONS["system_user"], {"date_string": "01 Jan 2025"}),
        (CONVERSATIONS["multi_turn"], {}),
        (
            [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": _weather_call("Oslo")}],
                },
                {"role": "tool", "content": {"temp": "-3C"}},
            ],
            {"date_string": "01 Jan 2025", "tools_in_user_message": False},
        ),
    ],
    ids=["system_user", "multi_turn_strftime_now", "tool_call"],
)
def test_llama_style_template_matches_transformers(
    llama_style_dir: Path, hf_llama_style: Any, messages: list[dict[str, Any]], extra: dict[str, Any]
) -> None:
    ours = Tokenizer.from_dir(llama_style_dir)
    tools = [WEATHER_TOOL]
    expected_text = hf_llama_style.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra
    )
    text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **extra)
    assert text == expected_text
    assert text.startswith(BOS_TOKEN)
    expected_ids = _hf_ids(hf_llama_style, messages, tools=tools, add_generation_prompt=True, **extra)
    assert ours.encode_chat(messages, tools=tools, add_generation_prompt=True, **extra) == expected_ids
    assert expected_ids.count(BOS_TOKEN_ID) == 1


def test_llama_style_raise_exception_becomes_value_error(llama_style_dir: Path, hf_llama_style: Any) -> None:
    messages = [{"role": "narrator", "content": "Once upon a time"}]
    with pytest.raises(Exception, match="Unknown role 'narrator'"):
        hf_llama_style.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError, match="Unknown role 'narrator'"):
        Tokenizer.from_dir(llama_style_dir).apply_chat_template(messages)


def test_syntax_error_is_value_error_at_compile() -> None:
    with pytest.raises(ValueError, match="syntax error at line 2"):
        ChatTemplate("{{ bos_token }}\n{% for message in messages %}{{ message.content }}")


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}",
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
        "{{ {'b': 1, 'a': 'é<>&'} | tojson(separators=(',', ':')) }}",
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
        "{{ dict(a=1) | tojson }}{{ eos_token }}{{ pad_token }}{{ custom_flag }}",
        "{% for m in messages %}\n  {{ m.role }}\n{% endfor %}\n  {{ 'x' }}",
        "{{ messages[-1].reasoning_content }}/{{ messages[-1].thinking }}/{{ messages[-1].content is defined }}",
    ],
)
def test_environment_features_match_transformers(byte_tokenizer_dir: Path, hf_chatml: Any, source: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Sys ünïcode"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "reasoning": "because"},
    ]
    expected = hf_chatml.apply_chat_template(messages, chat_template=source, tokenize=False, custom_flag="on")
    special_tokens: dict[str, Any] = dict(Tokenizer.from_dir(byte_tokenizer_dir).special_tokens)
    rendered = ChatTemplate(source).render(messages, add_generation_prompt=False, custom_flag="on", **special_tokens)
    assert rendered == expected


def test_extra_variables_override_special_tokens(byte_tokenizer_dir: Path) -> None:
    ours = Tokenizer.from_dir(byte_tokenizer_dir)
    ours_template = ChatTemplate("{{ bos_token }}|{{ eos_token }}")
    assert ours_template.render([], bos_token="B", eos_token="E") == "B|E"
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


def test_template_cannot_reach_python_internals() -> None:
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])
    assert ChatTemplate("{{ messages.__class__ }}").render([]) == ""


def test_render_errors_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="boom"):
        ChatTemplate("{{ raise_exception('boom') }}").render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("source", "variables", "error"),
    [
        ("{{ 'Today ' + date_string }}", {"date_string": 5}, "TypeError"),
        ("{{ 1 // n }}", {"n": 0}, "ZeroDivisionError"),
        ("{{ messages[0].content.upper() + count }}", {"count": [1]}, "TypeError"),
    ],
)
def test_pythons_own_errors_in_a_template_are_chat_template_errors(
    source: str, variables: dict[str, Any], error: str
) -> None:
    """Values a caller gives (``chat_template_kwargs``) reach expressions Python evaluates; what they raise is
    the conversation's fault, as a template error is (a ValueError, the API's 400), never an uncaught error."""
    with pytest.raises(ChatTemplateError, match=f"failed to render: {error}"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}], **variables)


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("prefill", ["Sure,", '{"city": "Oslo", ', "  Indented"])
def test_continuing_the_final_message_matches_transformers(
    byte_tokenizer_dir: Path, hf_chatml: Any, tools: list[dict[str, Any]] | None, prefill: str
) -> None:
    messages = [{"role": "user", "content": "What is the weather?"}, {"role": "assistant", "content": prefill}]
    ours = Tokenizer.from_dir(byte_tokenizer_dir)
    expected = hf_chatml.apply_chat_template(
        messages, tools=tools, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    text = ours.apply_chat_template(messages, tools=tools, continue_final_message=True)
    assert text == expected and text.rstrip().endswith(prefill.strip())
    with pytest.raises(ValueError, match="no text to continue"):
        ours.apply_chat_template([*messages[:1], {"role": "assistant", "content": ""}], continue_final_message=True)
