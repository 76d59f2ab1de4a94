"""Response bodies and stream chunks in the exact shapes of OpenAI's chat completions, completions and models."""

from __future__ import annotations

import codecs
import dataclasses
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.token_bytes import token_display
from rayturn.engine.tool_calls import (
    DEFAULT_TOOL_CALL_PARSER,
    ParsedToolCalls,
    ToolCall,
    parse_tool_calls,
    random_tool_call_id,
    splits_every_answer,
)

from .pages import cursor_page, query_cursor, query_limit
from .protocol import JSON, ChatRequest

# OpenAI reports log probabilities that are -inf (or otherwise not finite) as this floor.
MIN_LOGPROB = -9999.0
OWNED_BY = "rayturn"
# ``GET /v1/models``' page sizes, as Anthropic's models list takes them.
DEFAULT_MODELS_LIMIT = 20
MAX_MODELS_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class TokenNames:
    """How logprob answers name a token: OpenAI's way, its text or ``bytes:\\xe2\\x80`` when it holds part of
    a character (so no two tokens read alike), or vLLM's ``token_id:N`` (``return_tokens_as_token_ids``)."""

    token_bytes: Callable[[int], bytes]
    as_token_ids: bool = False

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else token_display(self.token_bytes(token_id))

    def with_token_ids(self, as_token_ids: bool) -> TokenNames:
        return TokenNames(self.token_bytes, as_token_ids)


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


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    kv_store_tokens: int = 0,
    reasoning_tokens: int | None = None,
) -> JSON:
    """OpenAI's usage object. ``prompt_tokens_details.kv_store_tokens`` (rayturn's own) counts the
    cached tokens whose KV came from the KV store rather than the serving replica's device;
    ``completion_tokens_details.reasoning_tokens`` is there when the answers were split into reasoning and the
    rest (``CallResult.reasoning_tokens``). The callers add rayturn's ``energy`` object
    (``energy.energy_usage``)."""
    body: JSON = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "kv_store_tokens": kv_store_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def splits_answer(request: ChatRequest, parser: str, reasoning: str | None = None) -> bool:
    """Whether a chat call's answer is split into prose and tool calls: it offered tools, the model's format
    (``parser``) marks up every answer (``splits_every_answer``), or the answer opens in reasoning (``reasoning``,
    ``rayturn.engine.reasoning.answer_reasoning``)."""
    return request.prompt_tools is not None or splits_every_answer(parser) or reasoning is not None


def assistant_output(
    text: str,
    request: ChatRequest,
    *,
    id_factory: Callable[[], str] = random_tool_call_id,
    parsed: ParsedToolCalls | None = None,
    parser: str = DEFAULT_TOOL_CALL_PARSER,
    reasoning: str | None = None,
) -> ParsedToolCalls:
    """A finished completion's text split into content and tool calls (after its ``reasoning``), as the request
    allows; ``parsed``: the decode replica's split of it, when it made one (it does for every call whose answer
    is split)."""
    if not splits_answer(request, parser, reasoning):
        return ParsedToolCalls(content=text, tool_calls=())
    if parsed is None:
        parsed = parse_tool_calls(
            text, parser=parser, tools=request.prompt_tools, id_factory=id_factory, reasoning=reasoning
        )
    if request.parallel_tool_calls:
        return parsed
    return dataclasses.replace(parsed, tool_calls=parsed.tool_calls[:1])


def chat_logprobs(logprobs: Sequence[TokenLogprob], names: TokenNames) -> list[JSON]:
    """``logprobs.content`` of a chat choice: one entry per generated token."""
    return [
        {
            **_chat_token(entry.token_id, entry.logprob, names),
            "top_logprobs": [_chat_token(token_id, logprob, names) for token_id, logprob in entry.top],
        }
        for entry in logprobs
    ]


def _chat_token(token_id: int, logprob: float, names: TokenNames) -> JSON:
    return {"token": names.name(token_id), "logprob": _finite(logprob), "bytes": list(names.token_bytes(token_id))}


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], names: TokenNames, *, text_offset: int = 0, unscored: int | None = None
) -> JSON:
    """``logprobs`` of a completion choice. ``unscored``: a leading token with no logprob (an echoed prompt's
    first token, which nothing predicts), listed with null logprob and alternatives. Offsets count characters
    of the text from ``text_offset``; a token that ends inside a character moves them once it is whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []

    def add(token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
        nonlocal text_offset
        offsets.append(text_offset)
        tokens.append(names.name(token_id))
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        text_offset += len(decoder.decode(names.token_bytes(token_id)))

    if unscored is not None:
        add(unscored, None, None)
    for entry in logprobs:
        add(entry.token_id, _finite(entry.logprob), _top_logprobs(entry.top, names, entry.token_id))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _top_logprobs(top: Sequence[tuple[int, float]], names: TokenNames, chosen: int) -> dict[str, float]:
    """The alternatives keyed by name, the chosen token under the name ``tokens`` gives it; should another
    share a name already taken, it goes by its id."""
    keys: dict[int, str] = {}
    taken: set[str] = set()
    for token_id, _ in sorted(top, key=lambda item: item[0] != chosen):  # the chosen token names itself first
        name = names.name(token_id)
        keys[token_id] = f"token_id:{token_id}" if name in taken else name
        taken.add(keys[token_id])
    return {keys[token_id]: _finite(logprob) for token_id, logprob in top}


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob | None], names: TokenNames) -> list[JSON | None]:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt token (the first None, nothing predicts
    it) the token and its alternatives by id, each with its logprob, its rank (1: the most likely; None when the
    token was not among the alternatives) and its text."""
    scored: list[JSON | None] = []
    for entry in entries:
        if entry is None:
            scored.append(None)
            continue
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(entry.top, start=1)}
        tokens = {entry.token_id: entry.logprob, **dict(entry.top)}
        scored.append(
            {
                str(token_id): {
                    "logprob": _finite(logprob),
                    "rank": ranks.get(token_id),
                    "decoded_token": names.name(token_id),
                }
                for token_id, logprob in tokens.items()
            }
        )
    return scored


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def chat_choice(
    index: int,
    *,
    content: str | None,
    tool_calls: Sequence[ToolCall] = (),
    finish_reason: str | None,
    logprobs: list[JSON] | None = None,
    reasoning: str | None = None,
) -> JSON:
    """One choice of a chat completion; ``finish_reason`` is the engine's. ``reasoning``: the model's reasoning,
    where its format marks it apart, in the message's ``reasoning`` (vLLM's field)."""
    message: JSON = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
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


def model_card(served_model: str, created: int, *, root: str, max_model_len: int) -> JSON:
    """One model as ``GET /v1/models/{id}`` shows it: OpenAI's fields, vLLM's ``root`` (the checkpoint it
    was loaded from) and ``max_model_len`` (the context calls may fill), and Anthropic's (``type``,
    ``display_name``, ``created_at``, ``lifecycle``, ``max_input_tokens``), so both SDKs read it whole."""
    return {
        "id": served_model,
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "type": "model",
        "display_name": served_model,
        "created_at": datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z"),
        "lifecycle": "active",
        "max_input_tokens": max_model_len,
    }


def models_list(cards: Sequence[JSON], query: Mapping[str, str]) -> JSON:
    """The body of ``GET /v1/models``: OpenAI's list, with the cursor fields of Anthropic's, paged by its query
    (``limit``, 1 to 1,000, 20 if not given; ``after_id`` or ``before_id``)."""
    limit = query_limit(query, maximum=MAX_MODELS_LIMIT, default=DEFAULT_MODELS_LIMIT)
    after, before = query_cursor(query, "after_id"), query_cursor(query, "before_id")
    return cursor_page(cards, limit=limit, after=after, before=before, what="listed model")
