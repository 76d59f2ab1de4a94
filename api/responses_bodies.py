"""Responses' answer bodies in OpenAI's shapes: the response object, its output items, usage and errors."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rayturn.engine.tool_calls import ParsedToolCalls, ToolCall

from .chat_request import decoded_arguments
from .errors import APIError
from .protocol import JSON

RESPONSE_ID_PREFIX = "resp_"
# The ``include`` value that asks for the answer's log probabilities (``output_text.logprobs``).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# Every value OpenAI's ``include`` takes (any other is a 400). The others name hosted tools' outputs, input
# images and encrypted reasoning, none of which this server makes: they change nothing in the answer.
INCLUDABLE = (
    OUTPUT_LOGPROBS,
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)
_ID_RANDOM_BYTES = 24


def response_id() -> str:
    return RESPONSE_ID_PREFIX + secrets.token_hex(_ID_RANDOM_BYTES)


def message_item_id() -> str:
    return "msg_" + secrets.token_hex(_ID_RANDOM_BYTES)


def function_call_item_id() -> str:
    return "fc_" + secrets.token_hex(_ID_RANDOM_BYTES)


def function_call_output_item_id() -> str:
    return "fco_" + secrets.token_hex(_ID_RANDOM_BYTES)


def reasoning_item_id() -> str:
    return "rs_" + secrets.token_hex(_ID_RANDOM_BYTES)


def response_status(engine_finish_reason: str | None) -> str:
    """``incomplete`` when the answer ran out of ``max_output_tokens`` (or the context), else ``completed``."""
    return "incomplete" if engine_finish_reason == "length" else "completed"


@dataclass(frozen=True, slots=True)
class ResponseFrame:
    """What every body of one response repeats: its id, creation time, model and the request's settings."""

    response_id: str
    created_at: int
    model: str
    echo: Mapping[str, Any]

    def body(
        self, status: str, output: Sequence[JSON], usage: JSON | None = None, *, error: JSON | None = None
    ) -> JSON:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": list(output),
            "usage": usage,
            **self.echo,
        }


def output_text_part(text: str, logprobs: Sequence[JSON] = ()) -> JSON:
    """A message's text; ``logprobs``: its tokens' (``bodies.chat_logprobs``'s shape, OpenAI's here too)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def delta_logprobs(logprobs: Sequence[JSON]) -> list[JSON]:
    """Log probabilities as a text event carries them: without the tokens' ``bytes``."""
    return [
        {
            "token": entry["token"],
            "logprob": entry["logprob"],
            "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]],
        }
        for entry in logprobs
    ]


def message_item(item_id: str, text: str | None, status: str, logprobs: Sequence[JSON] = ()) -> JSON:
    """An assistant message item; ``text`` None: one just opened, before its text part."""
    content = [] if text is None else [output_text_part(text, logprobs)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def reasoning_text_part(text: str) -> JSON:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> JSON:
    """A reasoning item: the model's reasoning, where its format marks it apart (harmony's analysis channel), as
    its ``reasoning_text`` content, with no summary; ``text`` None: one just opened, before its part."""
    content = [] if text is None else [reasoning_text_part(text)]
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def function_call_item(item_id: str, call: ToolCall, status: str, *, arguments: str | None = None) -> JSON:
    """A function call item; the tool call's id is its ``call_id``, the one ``function_call_output`` answers."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
    }


def output_items(parsed: ParsedToolCalls, status: str, logprobs: Sequence[JSON] = ()) -> list[JSON]:
    """A whole answer's items: its reasoning (when the model's format marks it apart), its prose as one message (an
    empty one when there are no calls), then its calls. ``logprobs``: every answer token's, on the message (as the
    chat API lists them all, reasoning and call tokens included); an answer of calls alone has no message for them.

    A call is an item only once its block closed, so calls are always complete; under ``incomplete`` the prose
    holds what was cut short (an unclosed call stays text), as the streamed answer reports it.
    """
    calls = parsed.tool_calls
    items = [reasoning_item(reasoning_item_id(), parsed.reasoning, status)] if parsed.reasoning else []
    if parsed.content or not calls:
        items.append(message_item(message_item_id(), parsed.content or "", status, logprobs))
    for call in calls:
        items.append(function_call_item(function_call_item_id(), call, "completed"))
    return items


def response_usage(
    input_tokens: int, output_tokens: int, cached_tokens: int = 0, kv_store_tokens: int = 0, reasoning_tokens: int = 0
) -> JSON:
    """Responses' usage; ``input_tokens_details.kv_store_tokens`` (rayturn's own) counts the cached tokens whose
    KV came from the KV store, as in the chat API's usage; ``reasoning_tokens`` the answer's reasoning
    (``CallResult.reasoning_tokens``). Nothing is written to an explicit cache."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": 0,
            "kv_store_tokens": kv_store_tokens,
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def response_error(err: APIError) -> JSON:
    """The ``error`` of a response that failed after its stream started."""
    if err.status_code == 429:
        code = "rate_limit_exceeded"
    elif err.status_code < 500:
        code = "invalid_prompt"
    else:
        code = "server_error"
    return {"code": code, "message": err.message}


def assistant_message(output: Sequence[JSON]) -> JSON:
    """An answer's items as the chat message a later call's history holds (the shape ``responses_input`` makes
    of the same items sent back), so both ways of continuing render the same prompt."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": decoded_arguments(item["arguments"])},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    reasoning = "\n\n".join(
        part["text"] for item in output if item["type"] == "reasoning" for part in item["content"] if part["text"]
    )
    message: JSON = {"role": "assistant"}
    if text or not calls:
        message["content"] = text
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def deleted(response_id: str) -> JSON:
    """The body of ``DELETE /v1/responses/{id}``."""
    return {"id": response_id, "object": "response", "deleted": True}
