"""Server-sent events, and the chat stream's per-choice state (content and tool calls as they arrive)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from rayturn.engine.tool_calls import (
    DEFAULT_TOOL_CALL_PARSER,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    random_tool_call_id,
)

from .bodies import chat_chunk_choice, openai_finish_reason, splits_answer
from .protocol import JSON, ChatRequest

SSE_DONE = "data: [DONE]\n\n"


def sse(data: JSON) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChatStreamState:
    """Turns one choice's text deltas into chat chunk choices, with its tool calls pulled out.

    Without tools every delta passes straight through (unless the model's
    format marks up every answer, ``bodies.splits_answer``). With tools the text
    is split by ``rayturn.engine.tool_calls.ToolCallStream``: text that may
    belong to a ``<tool_call>`` block is held back until the block is decided,
    so the stream yields the same tool calls and the same (stripped) content as
    the whole answer would. The decode replica runs that split already (a call
    whose answer is split carries it in its deltas, ``Delta.tool_parse``); given
    here, it is used as is and nothing is parsed twice. Logprob entries given
    with a delta go out with the next chunk this choice emits, and so do its
    token ids (``hold_token_ids``, vLLM's ``return_token_ids``): the chunks'
    ``token_ids`` together are the answer's, however its text was held back.
    """

    __slots__ = (
        "_hide_token_ids",
        "_index",
        "_parallel_tool_calls",
        "_pending_logprobs",
        "_pending_token_ids",
        "_role_sent",
        "_show_reasoning",
        "_stream",
        "_tool_calls",
    )

    def __init__(
        self,
        index: int,
        *,
        parse_tools: bool,
        parallel_tool_calls: bool = True,
        id_factory: Callable[[], str] = random_tool_call_id,
        parser: str = DEFAULT_TOOL_CALL_PARSER,
        reasoning: str | None = None,
        show_reasoning: bool = True,
        token_ids: bool = False,
    ) -> None:
        self._index = index
        self._show_reasoning = show_reasoning  # the request's ``include_reasoning``
        self._stream = ToolCallStream(parser, id_factory=id_factory, reasoning=reasoning) if parse_tools else None
        self._parallel_tool_calls = parallel_tool_calls
        self._role_sent = False
        self._tool_calls: list[ToolCall] = []
        self._pending_logprobs: list[JSON] | None = None
        # The token ids not sent yet; None: the chunks carry none. Hidden reasoning hides them (as vLLM does).
        self._pending_token_ids: list[int] | None = [] if token_ids else None
        self._hide_token_ids = not show_reasoning and reasoning is not None

    @classmethod
    def for_request(
        cls,
        request: ChatRequest,
        index: int,
        *,
        id_factory: Callable[[], str] = random_tool_call_id,
        parser: str = DEFAULT_TOOL_CALL_PARSER,
        reasoning: str | None = None,
    ) -> ChatStreamState:
        return cls(
            index,
            parse_tools=splits_answer(request, parser, reasoning),
            parallel_tool_calls=request.parallel_tool_calls,
            id_factory=id_factory,
            parser=parser,
            reasoning=reasoning,
            show_reasoning=request.include_reasoning,
            token_ids=request.return_token_ids,
        )

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return tuple(self._tool_calls)

    def start(self) -> JSON:
        """The opening choice, ``{"role": "assistant", "content": ""}``, sent before any text."""
        self._role_sent = True
        return chat_chunk_choice(self._index, delta={"role": "assistant", "content": ""})

    def push(
        self, text: str, logprobs: Sequence[JSON] | None = None, parsed: ToolCallDelta | None = None
    ) -> JSON | None:
        """The chunk choice for a text delta, or None when nothing can be sent yet; ``parsed``: the replica's
        split of ``text``."""
        self._hold_logprobs(logprobs)
        if self._stream is None:
            return self._choice(text, [], None)
        piece = parsed if parsed is not None else self._stream.push(text)
        return self._choice(piece.content, self._record(piece.tool_calls), None, piece.reasoning)

    def finish(
        self, engine_finish_reason: str, logprobs: Sequence[JSON] | None = None, parsed: ToolCallDelta | None = None
    ) -> JSON:
        """The final chunk choice: whatever was held, then ``finish_reason``; ``parsed``: the replica's decision
        on what it held."""
        self._hold_logprobs(logprobs)
        content, calls, reasoning = "", [], ""
        if self._stream is not None:
            piece = parsed if parsed is not None else self._stream.finish()
            content, calls, reasoning = piece.content, self._record(piece.tool_calls), piece.reasoning
        reason = openai_finish_reason(engine_finish_reason, has_tool_calls=bool(self._tool_calls))
        choice = self._choice(content, calls, reason, reasoning)
        assert choice is not None
        return choice

    def hold_token_ids(self, token_ids: Sequence[int]) -> None:
        """A delta's token ids, sent with the next chunk this choice emits (when the request asked for them)."""
        if self._pending_token_ids is not None:
            self._pending_token_ids.extend(token_ids)

    def _hold_logprobs(self, logprobs: Sequence[JSON] | None) -> None:
        if logprobs is not None:
            self._pending_logprobs = (self._pending_logprobs or []) + list(logprobs)

    def _choice(self, content: str, calls: list[JSON], reason: str | None, reasoning: str = "") -> JSON | None:
        reasoning = reasoning if self._show_reasoning else ""
        if not content and not calls and not reasoning and reason is None:
            return None
        delta: JSON = {}
        if not self._role_sent:
            delta["role"] = "assistant"
            self._role_sent = True
        if reasoning:  # vLLM's field for a reasoning model's chain of thought
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        logprobs, self._pending_logprobs = self._pending_logprobs, None
        choice = chat_chunk_choice(self._index, delta=delta, finish_reason=reason, logprobs=logprobs)
        if self._pending_token_ids is not None:
            choice["token_ids"] = None if self._hide_token_ids else self._pending_token_ids
            self._pending_token_ids = []
        return choice

    def _record(self, calls: Sequence[ToolCall]) -> list[JSON]:
        """The tool-call deltas for ``calls``; surplus calls under ``parallel_tool_calls=false`` are dropped."""
        deltas = []
        for call in calls:
            if self._tool_calls and not self._parallel_tool_calls:
                break
            self._tool_calls.append(call)
            deltas.append({"index": len(self._tool_calls) - 1, **call.to_openai()})
        return deltas
