"""``POST /tokenize`` and ``POST /detokenize`` request bodies (vLLM's tokenizer endpoints), validated.

``/tokenize`` takes one of two forms, as vLLM's does:

- ``prompt``: a text, tokenized as ``/v1/completions`` tokenizes one
  (``add_special_tokens``, default true: the tokenizer's BOS and the like);
- ``messages`` (with ``tools``, ``tool_choice`` and ``chat_template_kwargs``): a chat, rendered by the
  model's chat template as ``/v1/chat/completions`` renders it, so the ids are
  the prompt a chat call with the same messages computes;
  ``add_generation_prompt`` (default true), ``continue_final_message``, and
  ``add_special_tokens`` (default false: the template writes its own).

``return_token_strs`` adds each id's vocabulary entry. Neither form refuses a
text longer than the context: the answer's ``count`` beside ``max_model_len``
says whether it fits. ``/detokenize`` takes ``tokens``, ids of the vocabulary,
and returns their text with special tokens kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chat_request import (
    chat_messages,
    chat_template_kwargs,
    chat_tool_choice,
    chat_tools,
    check_open_final_message,
)
from .errors import invalid_request
from .json_fields import Fields, body_fields, is_integer, type_error
from .protocol import JSON, model_field, shown_tools
from .sampling_fields import reject_unsupported

# Fields that shape a chat's rendering: with ``prompt`` they would be silently meaningless, so they are refused.
CHAT_ONLY_FIELDS = ("tools", "tool_choice", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# vLLM's tokenizer fields this server does not honour (the chat completions API refuses them too).
UNSUPPORTED_TOKENIZE_FIELDS: dict[str, object] = {
    "chat_template": None,
    "mm_processor_kwargs": None,
    "media_io_kwargs": None,
}


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """What to tokenize: ``prompt`` (a text), or ``messages`` rendered with ``tools`` by the chat template."""

    prompt: str | None
    messages: list[JSON] | None
    tools: list[JSON] | None
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    return_token_strs: bool
    template_kwargs: JSON | None = None


def parse_tokenize_request(body: object, served_model: str) -> TokenizeRequest:
    fields = body_fields(body)
    model_field(fields, served_model)
    reject_unsupported(fields, UNSUPPORTED_TOKENIZE_FIELDS, " for tokenize")
    return_token_strs = fields.boolean("return_token_strs") or False
    has_prompt, has_messages = fields.raw("prompt") is not None, fields.raw("messages") is not None
    if has_prompt and has_messages:
        message = "Invalid body: give either 'prompt' (a text) or 'messages' (a chat), not both."
        raise invalid_request(message, param="messages")
    if not has_messages:
        if not has_prompt:
            raise invalid_request("Missing required parameter: 'prompt' or 'messages'.", param="prompt")
        for name in CHAT_ONLY_FIELDS:
            if fields.raw(name) is not None:
                raise invalid_request(f"Invalid '{name}': it goes with 'messages', not 'prompt'.", param=name)
        add_special_tokens = fields.boolean("add_special_tokens")
        return TokenizeRequest(
            prompt=fields.required_string("prompt"),
            messages=None,
            tools=None,
            add_generation_prompt=False,
            continue_final_message=False,
            add_special_tokens=True if add_special_tokens is None else add_special_tokens,
            return_token_strs=return_token_strs,
        )
    messages = chat_messages(fields)
    tools = chat_tools(fields)
    tool_choice = chat_tool_choice(fields, tools)
    continues = fields.boolean("continue_final_message") or False
    generation_prompt = fields.boolean("add_generation_prompt")
    if continues and generation_prompt:
        message = "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true."
        raise invalid_request(message, param="continue_final_message")
    if continues:
        check_open_final_message(messages)
    return TokenizeRequest(
        prompt=None,
        messages=messages,
        tools=shown_tools(tools, tool_choice),
        add_generation_prompt=not continues if generation_prompt is None else generation_prompt,
        continue_final_message=continues,
        add_special_tokens=fields.boolean("add_special_tokens") or False,
        return_token_strs=return_token_strs,
        template_kwargs=chat_template_kwargs(fields),
    )


def parse_detokenize_request(body: object, served_model: str, vocab_size: int) -> list[int]:
    """The ``tokens`` to turn back into text: ids of the ``vocab_size``-token vocabulary (an empty list is "")."""
    fields = body_fields(body)
    model_field(fields, served_model)
    tokens = fields.present("tokens")
    if not isinstance(tokens, list):
        raise type_error("tokens", "an array of token ids", tokens)
    return [_token_id(fields, i, value, vocab_size) for i, value in enumerate(tokens)]


def _token_id(fields: Fields, index: int, value: object, vocab_size: int) -> int:
    param = fields.path(f"tokens[{index}]")
    if not is_integer(value):
        raise type_error(param, "a token id (an integer)", value)
    assert isinstance(value, int | float)
    if not 0 <= value < vocab_size:
        message = f"Invalid '{param}': token id {int(value)} is out of the vocabulary [0, {vocab_size})."
        raise invalid_request(message, param=param)
    return int(value)
