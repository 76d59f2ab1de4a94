"""``POST /v1/chat/completions``: one straight pass from the body to the answer or its stream.

body --> ChatRequest (chat_request) --> chat template + tokens (pipeline) --> SamplingParams (protocol)
     --> call, classified as user / tool continuation from its messages --> decode pool
     --> steps --> one chat.completion, or chat.completion.chunk events (streaming.ChatStreamState)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .bodies import (
    assistant_output,
    chat_choice,
    chat_chunk,
    chat_completion,
    chat_completion_id,
    chat_logprobs,
    chat_usage_chunk,
    usage,
)
from .chat_request import parse_chat_request
from .pipeline import CallResult, Steps, chain_steps
from .protocol import JSON, ChatRequest
from .serving import HTTPServing, replica_headers, sse_response, stream_failure
from .streaming import SSE_DONE, ChatStreamState, sse

API = "chat"


class ServingChat(HTTPServing):
    async def create(self, request: Request, request_id: str) -> Response:
        try:
            tenant = self.authorize(request)
            body, num_bytes = await self.json_body(request)
            chat = parse_chat_request(body, self.served_model)
            # ``prompt_cache_key`` names the session when a client sends it (before the older ``user``).
            session = (chat.prompt_cache_key, "prompt_cache_key") if chat.prompt_cache_key else (chat.user, "user")
            prepared = await self.prepare_chat(request_id, request, tenant, chat, num_bytes, body_session=session)
            result, steps, first = await self.pipeline.start(prepared)
            if chat.stream:
                return sse_response(self._stream(chat, steps, first, result), result)
            async for _ in chain_steps(first, steps):
                pass
        except Exception as err:
            return self.failure(API, err, request_id)
        self.succeeded(API)
        return JSONResponse(self._body(chat, result), headers=replica_headers(result))

    def _body(self, chat: ChatRequest, result: CallResult) -> JSON:
        names = self.token_names.with_token_ids(chat.return_tokens_as_token_ids)
        choices = []
        for index, state in sorted(result.completions.items()):
            parsed = assistant_output(
                state.text,
                chat,
                parsed=state.parsed_tool_calls(),
                parser=self.pipeline.guides.parser,
                reasoning=result.reasoning,
            )
            logprobs = chat_logprobs(state.logprobs, names) if chat.sampling.logprobs else None
            choice = chat_choice(
                index,
                content=parsed.content if parsed.content or not parsed.tool_calls else None,
                tool_calls=parsed.tool_calls,
                finish_reason=state.finish_reason,
                logprobs=logprobs,
                reasoning=parsed.reasoning if chat.include_reasoning else None,
            )
            if chat.return_token_ids:  # hidden reasoning hides its tokens too, as vLLM hides them
                hidden = not chat.include_reasoning and result.reasoning is not None
                choice["token_ids"] = None if hidden else state.token_ids
            choices.append(choice)
        body = chat_completion(
            response_id=chat_completion_id(),
            model=self.served_model,
            created=int(time.time()),
            choices=choices,
            usage=result.usage(),
        )
        return body | {"prompt_token_ids": list(result.prompt_token_ids)} if chat.return_token_ids else body

    async def _stream(self, chat: ChatRequest, steps: Steps, first: Any, result: CallResult) -> AsyncIterator[str]:
        response_id, created = chat_completion_id(), int(time.time())
        names = self.token_names.with_token_ids(chat.return_tokens_as_token_ids)
        parser = self.pipeline.guides.parser
        states = {
            index: ChatStreamState.for_request(chat, index, parser=parser, reasoning=result.reasoning)
            for index in range(chat.sampling.n)
        }

        answered = 0  # the answers' tokens so far, for vLLM's ``continuous_usage_stats``

        def chunk(choices: list[JSON], **extra: Any) -> str:
            body = chat_chunk(
                response_id=response_id,
                model=self.served_model,
                created=created,
                choices=choices,
                include_usage=chat.include_usage,
            )
            if chat.continuous_usage:
                body["usage"] = usage(result.prompt_tokens, answered, result.cached_tokens, result.loaded_tokens)
            return sse(body | extra)

        prompt_ids = {"prompt_token_ids": list(result.prompt_token_ids)} if chat.return_token_ids else {}
        yield chunk([state.start() for state in states.values()], **prompt_ids)
        try:
            async for deltas in chain_steps(first, steps):
                texts, endings = [], []  # one choice per index per chunk: text first, then the finish
                for delta in deltas:
                    answered += len(delta.token_ids)
                    state = states[delta.index]
                    state.hold_token_ids(delta.token_ids)
                    logprobs = (
                        chat_logprobs(delta.logprobs, names) if chat.sampling.logprobs and delta.logprobs else None
                    )
                    # The replica's split of the text into prose and tool calls (a call that offered tools).
                    pushed, held = (delta.tool_parse + (None, None))[:2]
                    if delta.text or delta.finish_reason is None:
                        choice = state.push(delta.text, logprobs, pushed)
                        logprobs = None
                        if choice is not None:
                            texts.append(choice)
                    if delta.finish_reason is not None:
                        endings.append(state.finish(delta.finish_reason, logprobs, held))
                for choices in (texts, endings):
                    if choices:
                        yield chunk(choices)
        except Exception as err:  # after the headers went out, errors travel in the stream
            self.telemetry.requests.labels(API, "failed").inc()
            yield stream_failure(err, result)
            yield SSE_DONE
            return
        if chat.include_usage:
            body = chat_usage_chunk(
                response_id=response_id, model=self.served_model, created=created, usage=result.usage()
            )
            yield sse(body)
        self.succeeded(API)
        yield SSE_DONE
