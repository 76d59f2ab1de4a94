"""``POST /v1/completions``: one straight pass from the body to the answer or its stream.

body --> CompletionRequest (protocol) --> tokens (text tokenized, or the ids checked) --> SamplingParams
     --> call --> decode pool --> steps --> one text_completion, or text_completion chunk events
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .bodies import (
    completion,
    completion_choice,
    completion_chunk,
    completion_id,
    completion_logprobs,
    completion_usage_chunk,
)
from .errors import invalid_request
from .pipeline import CallResult, Steps, chain_steps
from .protocol import CompletionRequest, parse_completion_request, to_sampling_params
from .serving import HTTPServing, replica_headers, sse_response, stream_failure
from .streaming import SSE_DONE, sse

API = "completions"
# OpenAI's default for a completion that names no max_tokens.
DEFAULT_MAX_TOKENS = 16


class ServingCompletion(HTTPServing):
    async def create(self, request: Request, request_id: str) -> Response:
        try:
            tenant = self.authorize(request)
            body, _ = await self.json_body(request)
            spec = parse_completion_request(body, self.served_model)
            if isinstance(spec.prompt, str):
                prompt_ids = await self.pipeline.text_prompt(spec.prompt, param="prompt")
            else:
                prompt_ids = list(spec.prompt)
            # The length first: a prompt of a million ids is refused without walking them.
            params = to_sampling_params(
                spec.sampling,
                default_max_tokens=DEFAULT_MAX_TOKENS,
                prompt_tokens=len(prompt_ids),
                max_model_len=self.pipeline.max_model_len,
                prompt_param="prompt",
            )
            try:
                self.pipeline.check_prompt_ids(prompt_ids)
            except ValueError as err:
                raise invalid_request(str(err), param="prompt") from err
            session = (spec.user, "user")
            result, steps, first = await self.start(
                request_id, request, tenant, prompt_ids, params, body_session=session
            )
            if spec.stream:
                return sse_response(self._stream(spec, steps, first, result), result)
            async for _ in chain_steps(first, steps):
                pass
        except Exception as err:
            return self.failure(API, err, request_id)
        self.succeeded(API)
        choices = [
            completion_choice(
                index,
                text=state.text,
                finish_reason=state.finish_reason,
                logprobs=completion_logprobs(state.logprobs, self.token_text) if spec.sampling.logprobs else None,
            )
            for index, state in sorted(result.completions.items())
        ]
        body = completion(
            response_id=completion_id(),
            model=self.served_model,
            created=int(time.time()),
            choices=choices,
            usage=result.usage(),
        )
        return JSONResponse(body, headers=replica_headers(result))

    async def _stream(
        self, spec: CompletionRequest, steps: Steps, first: Any, result: CallResult
    ) -> AsyncIterator[str]:
        response_id, created = completion_id(), int(time.time())
        offsets: dict[int, int] = {}
        try:
            async for deltas in chain_steps(first, steps):
                choices = []
                for delta in deltas:
                    logprobs = None
                    if spec.sampling.logprobs and delta.logprobs:
                        offset = offsets.get(delta.index, 0)
                        logprobs = completion_logprobs(delta.logprobs, self.token_text, text_offset=offset)
                    offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
                    choices.append(
                        completion_choice(
                            delta.index, text=delta.text, finish_reason=delta.finish_reason, logprobs=logprobs
                        )
                    )
                yield sse(
                    completion_chunk(
                        response_id=response_id,
                        model=self.served_model,
                        created=created,
                        choices=choices,
                        include_usage=spec.include_usage,
                    )
                )
        except Exception as err:
            self.telemetry.requests.labels(API, "failed").inc()
            yield stream_failure(err, result)
            yield SSE_DONE
            return
        if spec.include_usage:
            usage = result.usage()
            yield sse(
                completion_usage_chunk(response_id=response_id, model=self.served_model, created=created, usage=usage)
            )
        self.succeeded(API)
        yield SSE_DONE
