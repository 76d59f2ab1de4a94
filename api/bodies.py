"""Response bodies and stream chunks in the exact shapes of OpenAI's chat completions, completions and models."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence

from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tool_calls import (
    DEFAULT_TOOL_CALL_PARSER,
    ParsedToolCalls,
    ToolCall,
    parse_tool_calls,
    random_tool_call_id,
)

from .protocol import JSON, ChatRequest

# OpenAI reports log probabilities that are -inf (or otherwise not finite) as this floor.
MIN_LOGPROB = -9999.0
OWNED_BY = "rayturn"

TokenText = Callable[[int], str]
"""The text of one token id, e.g. ``lambda i: tokenizer.decode([i], skip_special_tokens=False)``."""


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def openai_finish_reason(engine_reason: str | None, *, has_tool_calls: bool = False) -> str | None:
    """OpenAI's reason for the engine's: ``length`` stays, tool calls win, anything else ends as ``stop``."""
    if engine_reason is None:
        return None
    if has_tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, kv_store_tokens: int = 0) -> JSON:
    """OpenAI's usage object. ``prompt_tokens_details.kv_store_tokens`` (rayturn's own) counts the
    cached tokens whose KV came from the KV store rather than the serving replica's device."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "kv_store_tokens": kv_store_tokens},
    }


def assistant_output(
    text: str,
    request: ChatRequest,
    *,
    id_factory: Callable[[], str] = random_tool_call_id,
    parsed: ParsedToolCalls | None = None,
    parser: str = DEFAULT_TOOL_CALL_PARSER,
) -> ParsedToolCalls:
    """A finished completion's text split into content and tool calls, as the request allows; ``parsed``: the
    decode replica's split of it, when it made one (it does for every call that offered tools)."""
    if request.prompt_tools is None:
        return ParsedToolCalls(content=text, tool_calls=())
    if parsed is None:
        parsed = parse_tool_calls(text, parser=parser, tools=request.prompt_tools, id_factory=id_factory)
    if request.parallel_tool_calls:
        return parsed
    return ParsedToolCalls(content=parsed.content, tool_calls=parsed.tool_calls[:1])


def chat_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText) -> list[JSON]:
    """``logprobs.content`` of a chat choice: one entry per generated token."""
    return [
        {
            **_chat_token(entry.token_id, entry.logprob, token_text),
            "top_logprobs": [_chat_token(token_id, logprob, token_text) for token_id, logprob in entry.top],
        }
        for entry in logprobs
    ]


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> JSON:
    text = token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def completion_logprobs(logprobs: Sequence[TokenLogprob], token_text: TokenText, *, text_offset: int = 0) -> JSON:
    """``logprobs`` of a completion choice; offsets count characters from the start of the completion."""
    tokens = [token_text(entry.token_id) for entry in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(entry.logprob) for entry in logprobs],
        "top_logprobs": [
            {token_text(token_id): _finite(logprob) for token_id, logprob in entry.top} for entry in logprobs
        ],
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def chat_choice(
    index: int,
    *,
    content: str | None,
    tool_calls: Sequence[ToolCall] = (),
    finish_reason: str | None,
    logprobs: list[JSON] | None = None,
) -> JSON:
    """One choice of a chat completion; ``finish_reason`` is the engine's."""
    message: JSON = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [call.to_openai() for call in tool_calls]
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": openai_finish_reason(finish_reason, has_tool_calls=bool(tool_calls)),
    }


def chat_completion(*, response_id: str, model: str, created: int, choices: Sequence[JSON], usage: JSON) -> JSON:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": list(choices),
        "usage": usage,
    }


def completion_choice(index: int, *, text: str, finish_reason: str | None, logprobs: JSON | None = None) -> JSON:
    """One choice of a completion, or of a completion chunk while ``finish_reason`` is None."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": openai_finish_reason(finish_reason)}


def completion(*, response_id: str, model: str, created: int, choices: Sequence[JSON], usage: JSON) -> JSON:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": list(choices),
        "usage": usage,
    }


def chat_chunk_choice(
    index: int, *, delta: JSON, finish_reason: str | None = None, logprobs: list[JSON] | None = None
) -> JSON:
    """One choice of a chat chunk; ``finish_reason`` is already OpenAI's (see ``openai_finish_reason``)."""
    return {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }


def chat_chunk(
    *, response_id: str, model: str, created: int, choices: Sequence[JSON], include_usage: bool = False
) -> JSON:
    """A ``chat.completion.chunk``; with ``include_usage`` it carries ``usage: null`` as OpenAI's do."""
    return _chunk("chat.completion.chunk", response_id, model, created, list(choices), include_usage)


def chat_usage_chunk(*, response_id: str, model: str, created: int, usage: JSON) -> JSON:
    """The last chunk of a stream with ``include_usage``: no choices, the whole request's usage."""
    chunk = _chunk("chat.completion.chunk", response_id, model, created, [], False)
    return {**chunk, "usage": usage}


def completion_chunk(
    *, response_id: str, model: str, created: int, choices: Sequence[JSON], include_usage: bool = False
) -> JSON:
    """A streamed completion chunk; OpenAI gives it the ``text_completion`` object type too."""
    return _chunk("text_completion", response_id, model, created, list(choices), include_usage)


def completion_usage_chunk(*, response_id: str, model: str, created: int, usage: JSON) -> JSON:
    chunk = _chunk("text_completion", response_id, model, created, [], False)
    return {**chunk, "usage": usage}


def _chunk(object_type: str, response_id: str, model: str, created: int, choices: list[JSON], null_usage: bool) -> JSON:
    chunk: JSON = {"id": response_id, "object": object_type, "created": created, "model": model, "choices": choices}
    if null_usage:
        chunk["usage"] = None
    return chunk


def models_list(served_model: str, created: int) -> JSON:
    """The body of ``GET /v1/models``."""
    return {
        "object": "list",
        "data": [{"id": served_model, "object": "model", "created": created, "owned_by": OWNED_BY}],
    }
