"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API on the shared call pipeline.

body --> MessagesRequest (anthropic_request: the chat form) --> chat template + tokens (pipeline)
     --> SamplingParams (max_tokens capped to the room left) --> call, a tool continuation when the last
         message returns tool results --> decode pool --> steps --> one message, or the Messages events
         (anthropic_bodies.MessageStream)

Errors come in Anthropic's shape with its status codes: 400, 401, 404, 413, 429, and 529 (overloaded) where
the OpenAI APIs answer 503. Every answer carries ``request-id``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rayturn.engine.tool_calls import ToolCall

from .anthropic_bodies import (
    MessageStream,
    anthropic_status,
    count_tokens_body,
    error_body,
    event,
    message_body,
    message_id,
    messages_usage,
    stop_reason,
    text_block,
    thinking_block,
    tool_use_block,
)
from .anthropic_request import MessagesRequest, parse_count_tokens_request, parse_messages_request
from .bodies import assistant_output, splits_answer
from .call_result import CompletionState
from .errors import RETRY_AFTER_S, client_error, outcome
from .pipeline import CallResult, Steps, chain_steps
from .protocol import JSON
from .serving import HTTPServing, replica_headers, sse_response
from .session import classify_call

API = "messages"
REQUEST_ID_HEADER = "request-id"


class ServingMessages(HTTPServing):
    async def create(self, request: Request, request_id: str) -> Response:
        try:
            tenant = self.authorize(request)
            body, num_bytes = await self.json_body(request)
            parsed = parse_messages_request(body, self.served_model)
            chat = parsed.chat
            assert isinstance(body, dict)
            prepared = await self.prepare_chat(
                request_id,
                request,
                tenant,
                chat,
                num_bytes,
                body_session=(parsed.session_id, "metadata.user_id"),
                max_tokens=parsed.max_tokens,  # capped, not refused, when the context has less room
                call=classify_call(body["messages"]),  # tool_result blocks: a tool continuation
            )
            result, steps, first = await self.pipeline.start(prepared)
            if chat.stream:
                events = self._stream(parsed, steps, first, result)
                return sse_response(events, result, {REQUEST_ID_HEADER: request_id})
            async for _ in chain_steps(first, steps):
                pass
        except Exception as err:
            return self.failure(API, err, request_id)
        self.succeeded(API)
        headers = {REQUEST_ID_HEADER: request_id, **replica_headers(result)}
        return JSONResponse(self._body(parsed, result), headers=headers)

    async def count_tokens(self, request: Request, request_id: str) -> Response:
        try:
            self.authorize(request)
            body, num_bytes = await self.json_body(request)
            chat = parse_count_tokens_request(body, self.served_model)
            prompt_ids = await self.pipeline.chat_prompt(chat, num_bytes)
        except Exception as err:
            return self.failure("count_tokens", err, request_id)
        self.succeeded("count_tokens")
        return JSONResponse(count_tokens_body(len(prompt_ids)), headers={REQUEST_ID_HEADER: request_id})

    def failure(self, api: str, err: Exception, request_id: str) -> JSONResponse:
        api_error = client_error(err, request_id)
        self.telemetry.requests.labels(api, outcome(api_error.status_code)).inc()
        headers = {REQUEST_ID_HEADER: request_id}
        if api_error.status_code in (429, 503):
            headers["Retry-After"] = str(RETRY_AFTER_S)
        return JSONResponse(error_body(api_error), status_code=anthropic_status(api_error), headers=headers)

    def _usage(self, result: CallResult, *, energy: bool = True) -> JSON:
        """The call's usage; with rayturn's ``energy`` (``rayturn.api.energy``) once the call has ended."""
        tokens = messages_usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens, self.page_size)
        return {**tokens, "energy": result.energy()} if energy else tokens

    @property
    def page_size(self) -> int:
        return self.pipeline.page_size

    def _body(self, parsed: MessagesRequest, result: CallResult) -> JSON:
        state = result.completions.get(0, CompletionState())
        output = assistant_output(
            state.text,
            parsed.chat,
            parsed=state.parsed_tool_calls(),
            parser=self.pipeline.guides.parser,
            reasoning=result.reasoning,
        )
        content = [thinking_block(output.reasoning)] if output.reasoning else []
        content += [text_block(output.content)] if output.content else []
        content += [tool_use_block(call) for call in output.tool_calls]
        stop = stop_reason(state.finish_reason, state.stop_reason, called_tools=bool(output.tool_calls))
        return message_body(
            response_id=message_id(), model=self.served_model, content=content, stop=stop, usage=self._usage(result)
        )

    async def _stream(
        self, parsed: MessagesRequest, steps: Steps, first: Any, result: CallResult
    ) -> AsyncIterator[str]:
        stream = MessageStream(message_id(), self.served_model)
        for line in stream.start({**self._usage(result, energy=False), "output_tokens": 0}):
            yield line
        parse_tools = splits_answer(parsed.chat, self.pipeline.guides.parser, result.reasoning)
        one_call = not parsed.chat.parallel_tool_calls
        finish: tuple[str | None, str | int | None] = (None, None)
        try:
            async for deltas in chain_steps(first, steps):
                for delta in deltas:
                    if delta.index != 0:
                        continue
                    pieces: list[tuple[str, str, tuple[ToolCall, ...]]]
                    if not parse_tools:
                        pieces = [("", delta.text, ())]
                    else:
                        pieces = [(piece.reasoning, piece.content, piece.tool_calls) for piece in delta.tool_parse]
                    for thinking, text, calls in pieces:
                        for line in stream.thinking(thinking):
                            yield line
                        for line in stream.text(text):
                            yield line
                        if one_call and stream.called_tools:
                            calls = ()
                        for line in stream.tool_calls(calls[:1] if one_call else calls):
                            yield line
                    if delta.finish_reason is not None:
                        finish = (delta.finish_reason, delta.stop_reason)
        except Exception as err:  # after the headers went out, errors travel in the stream
            self.telemetry.requests.labels(API, "failed").inc()
            yield event(error_body(client_error(err, result.request_id)))
            return
        stop = stop_reason(finish[0], finish[1], called_tools=stream.called_tools)
        for line in stream.finish(stop, self._usage(result)):
            yield line
        self.succeeded(API)
