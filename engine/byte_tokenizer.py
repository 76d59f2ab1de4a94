"""Byte-level tokenizer for the built-in random-weight model presets.

Random-weight presets have no trained vocabulary, so they use the smallest
tokenizer that can still round-trip any text: one token per byte. It is a
byte-level BPE with no merges, the same machinery GPT-2 style tokenizers use,
so every UTF-8 byte maps to exactly one printable stand-in character of
``ByteLevel.alphabet()`` and that character is a token. Ids 0..255 are the byte
values themselves, which makes token ids easy to read in tests and traces.

The control tokens follow at ids 256 and up. The ChatML markers and the
begin/end-of-text markers are *special* (``decode`` drops them when asked to
skip special tokens); the ``<tool_call>`` tags are plain added tokens, so they
survive decoding and the tool-call parser can find them in the output text.

``save_byte_tokenizer`` writes the tokenizer in the Hugging Face layout
(``tokenizer.json`` + ``tokenizer_config.json``) so ``transformers`` loads the
same vocabulary and chat template as ``rayturn.engine.tokenizer.Tokenizer``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
TOOL_CALL_START_TOKEN = "<tool_call>"
TOOL_CALL_END_TOKEN = "</tool_call>"
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = IM_END_TOKEN

BYTE_VOCAB_SIZE = 256

# (token, is_special) in id order, starting right after the 256 byte tokens.
CONTROL_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS_TOKEN, True),
    (END_OF_TEXT_TOKEN, True),
    (IM_START_TOKEN, True),
    (IM_END_TOKEN, True),
    (TOOL_CALL_START_TOKEN, False),
    (TOOL_CALL_END_TOKEN, False),
    (PAD_TOKEN, True),
)

DEFAULT_MODEL_MAX_LENGTH = 32768

CHATML_TOOLS_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_content = render_content(messages[0].content) %}
{%- else %}
    {%- set system_content = none %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if system_content is not none %}
        {{- system_content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif system_content is not none %}
    {{- '<|im_start|>system\\n' + system_content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system'
            or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + render_content(message.content) }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unsupported message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def byte_alphabet_by_byte_value() -> list[str]:
    """The 256 ByteLevel stand-in characters, indexed by the byte each encodes."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    by_byte_value = sorted(alphabet, key=_byte_value_of_stand_in)
    if len(by_byte_value) != BYTE_VOCAB_SIZE:
        raise RuntimeError(f"ByteLevel alphabet has {len(by_byte_value)} chars, expected {BYTE_VOCAB_SIZE}")
    return by_byte_value


def _byte_value_of_stand_in(stand_in: str) -> int:
    """Invert GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to 256 + n."""
    codepoint = ord(stand_in)
    if codepoint < BYTE_VOCAB_SIZE:
        return codepoint
    return _unprintable_byte_values()[codepoint - BYTE_VOCAB_SIZE]


@cache
def _unprintable_byte_values() -> tuple[int, ...]:
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    return tuple(byte_value for byte_value in range(BYTE_VOCAB_SIZE) if byte_value not in printable)


def build_byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (ids 0..255 = byte values), then the control tokens."""
    vocab = {stand_in: byte_value for byte_value, stand_in in enumerate(byte_alphabet_by_byte_value())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    add_tokens(tokenizer, CONTROL_TOKENS)
    return tokenizer


def add_tokens(tokenizer: Tokenizer, tokens: Sequence[tuple[str, bool]]) -> None:
    """Add ``(token, is_special)`` entries in order: special ones as special tokens, the others as plain added
    tokens (which decoding keeps)."""
    for token, is_special in tokens:
        added = AddedToken(token, special=is_special, normalized=False)
        if is_special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])


def byte_tokenizer_config(chat_template: str, model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content matching ``build_byte_tokenizer``."""
    return tokenizer_config(BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, chat_template, model_max_length)


def tokenizer_config(
    bos_token: str | None, eos_token: str, pad_token: str, chat_template: str, model_max_length: int
) -> dict[str, Any]:
    """A preset's ``tokenizer_config.json``: its named special tokens, template and length; BOS and EOS are
    never added by encoding (the template writes what it needs)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }


def save_byte_tokenizer(
    directory: Path,
    chat_template: str,
    *,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the byte tokenizer into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(directory / "tokenizer.json"))
    config = byte_tokenizer_config(chat_template, model_max_length)
    config_text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (directory / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
