"""Anthropic Messages response bodies, stream events and errors, in Anthropic's exact shapes.

A streamed answer is this sequence of server-sent events (each ``event: <type>``
then ``data: <json>``)::

    message_start  ping
    ( content_block_start  content_block_delta*  content_block_stop )*   thinking_delta / text_delta /
                                                                          input_json_delta
    message_delta (stop_reason, usage)  message_stop

Text streams as it is decided, and so does the model's reasoning where its
format marks it apart (harmony's analysis channel), as ``thinking`` blocks
(with an empty ``signature``: nothing is signed); a tool call is one ``tool_use`` block whose
``input`` arrives as one ``input_json_delta`` once the call has closed (the
decode replica decides a call only when its block is complete).

Usage: ``cache_read_input_tokens`` are the prompt tokens served from a cache
(this replica's device or host memory, or the KV store);
``cache_creation_input_tokens`` the prompt's other full pages, computed by
this call and cached from now on; ``input_tokens`` the rest (the partial last
page). The three add up to the prompt, as in Anthropic's accounting.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from rayturn.engine.tool_calls import TOOL_CALL_ID_PREFIX, ToolCall

from .errors import APIError
from .json_fields import json_in_text
from .protocol import JSON

TOOL_USE_ID_PREFIX = "toolu_"
# Anthropic's status for "overloaded": the server is busy or a replica failed; retry.
OVERLOADED_STATUS = 529
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    OVERLOADED_STATUS: "overloaded_error",
}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call: ToolCall) -> str:
    """The ``toolu_`` id of a call whose id the decode replica drew as ``call_<hex>``."""
    return TOOL_USE_ID_PREFIX + call.id.removeprefix(TOOL_CALL_ID_PREFIX)


def stop_reason(finish_reason: str | None, stop: str | int | None, *, called_tools: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for the engine's finish."""
    if called_tools:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def messages_usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, page_size: int) -> JSON:
    full_page_tokens = max(prompt_tokens - 1, 0) // page_size * page_size
    created = max(full_page_tokens - cached_tokens, 0)
    return {
        "input_tokens": max(prompt_tokens - cached_tokens - created, 0),
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


def text_block(text: str) -> JSON:
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> JSON:
    """A ``thinking`` block: the model's reasoning; its ``signature`` is empty (nothing is signed)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call: ToolCall, *, streaming: bool = False) -> JSON:
    """A ``tool_use`` block; streamed, its ``input`` starts empty and arrives as ``input_json_delta``."""
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {} if streaming else _input(call)}


def _input(call: ToolCall) -> Any:
    value = json_in_text(call.arguments)
    return value if isinstance(value, dict) else {}


def message_body(
    *,
    response_id: str,
    model: str,
    content: Sequence[JSON],
    stop: tuple[str | None, str | None],
    usage: JSON,
) -> JSON:
    return {
        "id": response_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": list(content),
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def count_tokens_body(input_tokens: int) -> JSON:
    return {"input_tokens": input_tokens}


def event(data: JSON) -> str:
    """One server-sent event: its ``type`` as the event name, the data as compact JSON."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def anthropic_status(err: APIError) -> int:
    """Anthropic's status for one of rayturn's errors: a failed or overloaded pool is its 529."""
    return OVERLOADED_STATUS if err.status_code == 503 else err.status_code


def error_body(err: APIError) -> JSON:
    status = anthropic_status(err)
    kind = _ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class MessageStream:
    """Turns a call's deltas into Messages stream events: thinking, text and tool_use blocks in order."""

    __slots__ = ("_called_tools", "_index", "_open", "model", "response_id")

    def __init__(self, response_id: str, model: str) -> None:
        self.response_id = response_id
        self.model = model
        self._index = 0
        self._open: str | None = None  # the kind of the block open now: "text", "thinking" or None
        self._called_tools = False

    @property
    def called_tools(self) -> bool:
        return self._called_tools

    def start(self, usage: JSON) -> list[str]:
        message = message_body(
            response_id=self.response_id, model=self.model, content=[], stop=(None, None), usage=usage
        )
        return [event({"type": "message_start", "message": message}), event({"type": "ping"})]

    def text(self, text: str) -> list[str]:
        return self._streamed("text", text, text_block(""), {"type": "text_delta", "text": text})

    def thinking(self, thinking: str) -> list[str]:
        return self._streamed(
            "thinking", thinking, thinking_block(""), {"type": "thinking_delta", "thinking": thinking}
        )

    def _streamed(self, kind: str, text: str, empty_block: JSON, delta: JSON) -> list[str]:
        """A delta of a block of ``kind`` streamed as it comes: the block of another kind open closes first."""
        if not text:
            return []
        events = []
        if self._open != kind:
            events.extend(self._close_open())
            events.append(self._block_start(empty_block))
            self._open = kind
        events.append(event({"type": "content_block_delta", "index": self._index, "delta": delta}))
        return events

    def tool_calls(self, calls: Sequence[ToolCall]) -> list[str]:
        events = []
        for call in calls:
            events.extend(self._close_open())
            self._called_tools = True
            events.append(self._block_start(tool_use_block(call, streaming=True)))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(_input(call), ensure_ascii=False)}
            events.append(event({"type": "content_block_delta", "index": self._index, "delta": delta}))
            events.append(self._block_stop())
        return events

    def finish(self, stop: tuple[str | None, str | None], usage: JSON) -> list[str]:
        events = self._close_open()
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        events.append(event({"type": "message_delta", "delta": delta, "usage": usage}))
        events.append(event({"type": "message_stop"}))
        return events

    def _block_start(self, block: JSON) -> str:
        return event({"type": "content_block_start", "index": self._index, "content_block": block})

    def _block_stop(self) -> str:
        stop = event({"type": "content_block_stop", "index": self._index})
        self._index += 1
        return stop

    def _close_open(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [self._block_stop()]
