"""``POST /v1/completions``: one straight pass from the body to the answer or its stream.

body --> CompletionRequest (completion_request) --> per prompt: tokens (text tokenized, or the ids checked)
     --> SamplingParams --> call --> decode pool --> steps --> one text_completion, or text_completion chunks

A batch of prompts is a call per prompt, at most ``MAX_CONCURRENT_CALLS`` of a request's at a time; their
steps merge into one answer whose choices are indexed ``prompt_index * n + i``.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import TokenLogprob
from rayturn.messages import Delta

from .bodies import (
    TokenNames,
    completion,
    completion_choice,
    completion_chunk,
    completion_id,
    completion_logprobs,
    completion_usage_chunk,
    usage,
    vllm_prompt_logprobs,
)
from .completion_request import CompletionRequest, parse_completion_request
from .energy import summed_energy_usage
from .errors import invalid_request, server_error
from .pipeline import NO_STEP, CallResult, chain_steps
from .protocol import JSON
from .request_limits import off_loop
from .serving import HTTPServing, replica_headers, sse_response, stream_failure
from .streaming import SSE_DONE, sse

API = "completions"
# OpenAI's default for a completion that names no max_tokens.
DEFAULT_MAX_TOKENS = 16
# A batch's calls in flight at once: enough to fill a replica's batch, few enough not to flood its queue.
MAX_CONCURRENT_CALLS = 16
# Prompt scores one prompt may ask for, positions times (alternatives + 1): each is a Python object on its way
# through the decode replica and the ingress (a million is ~120 MB and seconds of serialising).
MAX_PROMPT_SCORES = 1 << 20


@dataclass(frozen=True, slots=True)
class _Prompt:
    """One prompt of a request, ready to send: its index, token ids, engine settings and text to echo."""

    index: int
    token_ids: list[int]
    params: SamplingParams
    text: str


@dataclass(frozen=True, slots=True)
class _Event:
    """What one prompt's call produced: its first step (``result`` set), a step, its end, or its failure."""

    prompt: int
    deltas: tuple[Delta, ...] = ()
    result: CallResult | None = None
    done: bool = False
    error: Exception | None = None


class ServingCompletion(HTTPServing):
    async def create(self, request: Request, request_id: str) -> Response:
        try:
            tenant = self.authorize(request)
            body, _ = await self.json_body(request)
            spec = parse_completion_request(body, self.served_model)
            prompts = [await self._prepare(spec, index, prompt) for index, prompt in enumerate(spec.prompts)]
            events = self._run(request, request_id, tenant, spec, prompts)
            results: dict[int, CallResult] = {}
            streaming = False
            try:
                first = await anext(events)  # a failure before any token is an API error, not a broken stream
                if first.error is not None:
                    raise first.error
                if spec.stream:
                    assert first.result is not None
                    streaming = True
                    return sse_response(self._stream(spec, prompts, first, events, results), first.result)
                await self._drain(first, events, results)
            finally:
                if not streaming:  # the stream closes its calls when it ends
                    await events.aclose()
        except Exception as err:
            return self.failure(API, err, request_id)
        self.succeeded(API)
        names = self.token_names.with_token_ids(spec.return_tokens_as_token_ids)
        choices = [
            self._choice(spec, prompts[number], results[number], index, names)
            for number in sorted(results)
            for index in sorted(results[number].completions)
        ]
        body = completion(
            response_id=completion_id(),
            model=self.served_model,
            created=int(time.time()),
            choices=choices,
            usage=_usage(spec, results.values()),
        )
        return JSONResponse(body, headers=replica_headers(results[min(results)]))

    async def _prepare(self, spec: CompletionRequest, index: int, prompt: str | tuple[int, ...]) -> _Prompt:
        param = spec.param(index)
        sampling = spec.sampling
        if not spec.generates:  # scoring only: the engine draws one token, which the answer leaves out
            sampling = dataclasses.replace(sampling, max_tokens=1)
        token_ids, params = await self.pipeline.raw_prompt(
            prompt, sampling, param=param, default_max_tokens=DEFAULT_MAX_TOKENS
        )
        if params.prompt_logprobs is not None:
            _check_score_size(len(token_ids), params.prompt_logprobs, param)
        text = prompt if isinstance(prompt, str) else ""
        if spec.echo and (not isinstance(prompt, str) or sampling.truncation is not None):  # what the model read
            skip = spec.sampling.skip_special_tokens
            tokenizer = self.pipeline.tokenizer
            text = await off_loop(len(token_ids) * 4, lambda: tokenizer.decode(token_ids, skip_special_tokens=skip))
        return _Prompt(index, token_ids, params, text)

    async def _run(
        self, request: Request, request_id: str, tenant: str, spec: CompletionRequest, prompts: Sequence[_Prompt]
    ) -> AsyncGenerator[_Event]:
        """Every prompt's call, at most ``MAX_CONCURRENT_CALLS`` at once, as one stream of events; a closed
        stream cancels the calls still running."""
        queue: asyncio.Queue[_Event] = asyncio.Queue()
        slots = asyncio.Semaphore(MAX_CONCURRENT_CALLS)
        session = (spec.user, "user")

        async def call(prompt: _Prompt) -> None:
            call_id = request_id if len(prompts) == 1 else f"{request_id}-{prompt.index}"
            end = _Event(prompt.index, done=True)
            try:
                async with slots:
                    result, steps, first = await self.start(
                        call_id,
                        request,
                        tenant,
                        prompt.token_ids,
                        prompt.params,
                        body_session=session,
                        priority=spec.priority,
                        cache_salt=spec.cache_salt,
                    )
                    if first is NO_STEP:
                        raise server_error(f"The call ended without an answer (request id {call_id}).")
                    queue.put_nowait(_Event(prompt.index, result=result))
                    async for deltas in chain_steps(first, steps):
                        queue.put_nowait(_Event(prompt.index, deltas=deltas))
            except BaseException as err:  # a cancelled call ends too, or the request would wait for it for ever
                end = _Event(prompt.index, error=err if isinstance(err, Exception) else server_error("cancelled"))
                if not isinstance(err, Exception):
                    raise
            finally:
                queue.put_nowait(end)

        # The first call in the request's context, every other in one of its own: Serve ties a handle call to
        # the request whose context makes it, and a second call from that context streaming at the same time is
        # never routed (Ray 2.60).
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(call(prompt), context=None if prompt.index == 0 else contextvars.Context())
            for prompt in prompts
        ]
        try:
            running = len(tasks)
            while running:
                event = await queue.get()
                running -= event.done or event.error is not None
                yield event
        finally:
            for task in tasks:
                task.cancel()
            # Their streams close (and the replicas stop their work) before the request ends.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _drain(self, first: _Event, events: AsyncIterator[_Event], results: dict[int, CallResult]) -> None:
        """Every call to its end (their results fill as the steps pass); the first failure fails the request."""
        event: _Event | None = first
        while event is not None:
            if event.error is not None:
                raise event.error
            if event.result is not None:
                results[event.prompt] = event.result
            event = await anext(events, None)

    def _choice(
        self, spec: CompletionRequest, prompt: _Prompt, result: CallResult, index: int, names: TokenNames
    ) -> JSON:
        state = result.completions[index]
        generated = state.text if spec.generates else ""
        logprobs = None
        if spec.sampling.logprobs:
            entries = list(state.logprobs) if spec.generates else []
            unscored = None
            if spec.echo:
                unscored, prompt_entries = _prompt_entries(prompt, result, spec.sampling.top_logprobs or 0)
                entries = prompt_entries + entries
            logprobs = completion_logprobs(entries, names, unscored=unscored)
        choice = completion_choice(
            prompt.index * spec.sampling.n + index,
            text=(prompt.text if spec.echo else "") + generated,
            finish_reason=state.finish_reason if spec.generates else "length",
            logprobs=logprobs,
        )
        if spec.return_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(_scores(prompt, result), names)
        if spec.return_token_ids:
            choice |= {"prompt_token_ids": prompt.token_ids, "token_ids": state.token_ids if spec.generates else []}
        return choice

    async def _stream(
        self,
        spec: CompletionRequest,
        prompts: Sequence[_Prompt],
        first: _Event,
        events: AsyncGenerator[_Event],
        results: dict[int, CallResult],
    ) -> AsyncIterator[str]:
        response_id, created = completion_id(), int(time.time())
        names = self.token_names.with_token_ids(spec.return_tokens_as_token_ids)
        offsets: dict[int, int] = {}  # characters sent per choice
        answered = 0  # the answers' tokens so far, for vLLM's ``continuous_usage_stats``
        event: _Event | None = first
        try:
            while event is not None:
                if event.error is not None:
                    raise event.error
                if event.result is not None:
                    results[event.prompt] = event.result
                answered += sum(len(delta.token_ids) for delta in event.deltas)
                choices = [
                    choice
                    for delta in event.deltas
                    if (choice := self._chunk_choice(spec, prompts[event.prompt], results, delta, offsets, names))
                ]
                if choices:
                    chunk = completion_chunk(
                        response_id=response_id,
                        model=self.served_model,
                        created=created,
                        choices=choices,
                        include_usage=spec.include_usage,
                    )
                    if spec.continuous_usage:  # the prompts begun so far, and every answer's tokens
                        chunk["usage"] = _usage(spec, results.values(), answered, energy=False)
                    yield sse(chunk)
                event = await anext(events, None)
        except Exception as err:
            self.telemetry.requests.labels(API, "failed").inc()
            yield stream_failure(err, results.get(first.prompt) or CallResult(completions={}))
            yield SSE_DONE
            return
        finally:
            await events.aclose()
        if spec.include_usage:
            body = completion_usage_chunk(
                response_id=response_id, model=self.served_model, created=created, usage=_usage(spec, results.values())
            )
            yield sse(body)
        self.succeeded(API)
        yield SSE_DONE

    def _chunk_choice(
        self,
        spec: CompletionRequest,
        prompt: _Prompt,
        results: dict[int, CallResult],
        delta: Delta,
        offsets: dict[int, int],
        names: TokenNames,
    ) -> JSON | None:
        """One choice of a chunk; an echoing answer's first chunk leads with the prompt (and its logprobs)."""
        index = prompt.index * spec.sampling.n + delta.index
        first = index not in offsets
        if not spec.generates and not first:
            return None
        text = delta.text if spec.generates else ""
        entries = list(delta.logprobs or ()) if spec.generates else []
        unscored = None
        if spec.echo and first:
            text = prompt.text + text
            if spec.sampling.logprobs:
                top = spec.sampling.top_logprobs or 0
                unscored, prompt_entries = _prompt_entries(prompt, results[prompt.index], top)
                entries = prompt_entries + entries
        logprobs = None
        if spec.sampling.logprobs and (entries or unscored is not None):
            logprobs = completion_logprobs(entries, names, text_offset=offsets.get(index, 0), unscored=unscored)
        offsets[index] = offsets.get(index, 0) + len(text)
        finish_reason = delta.finish_reason if spec.generates else "length"
        choice = completion_choice(index, text=text, finish_reason=finish_reason, logprobs=logprobs)
        if spec.return_prompt_logprobs and first:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(_scores(prompt, results[prompt.index]), names)
        if spec.return_token_ids:  # the prompt's on a choice's first chunk, then each chunk's new ones
            choice["prompt_token_ids"] = prompt.token_ids if first else None
            choice["token_ids"] = list(delta.token_ids) if spec.generates else []
        return choice


def _check_score_size(num_tokens: int, num_top: int, param: str) -> None:
    if num_tokens * (num_top + 1) > MAX_PROMPT_SCORES:
        most = MAX_PROMPT_SCORES // (num_top + 1)
        message = (
            f"Invalid '{param}': scoring a prompt of {num_tokens} tokens with {num_top} alternatives each is more "
            f"than this server returns; at most {most} tokens with {num_top} alternatives (fewer alternatives "
            "allow longer prompts)."
        )
        raise invalid_request(message, param=param)


def _scores(prompt: _Prompt, result: CallResult) -> tuple[TokenLogprob | None, ...]:
    scored = result.prompt_logprobs
    if scored is None or len(scored) != len(prompt.token_ids):
        raise server_error(f"The prompt's logprobs did not come back (request id {result.request_id}).")
    return scored


def _prompt_entries(prompt: _Prompt, result: CallResult, num_top: int) -> tuple[int, list[TokenLogprob]]:
    """An echoed prompt's logprobs, with the answer's number of alternatives: its first token (which nothing
    predicts) and the rest's entries."""
    entries = [dataclasses.replace(entry, top=entry.top[:num_top]) for entry in _scores(prompt, result)[1:] if entry]
    return prompt.token_ids[0], entries


def _usage(
    spec: CompletionRequest, results: Iterable[CallResult], answered: int | None = None, *, energy: bool = True
) -> JSON:
    """The whole request's usage: every prompt's call added up (a scored-only prompt generated nothing);
    ``answered``: the answers' tokens streamed so far, instead of the calls' whole count."""
    calls = list(results)
    if answered is None:
        answered = sum(result.completion_tokens for result in calls)
    tokens = usage(
        sum(result.prompt_tokens for result in calls),
        answered if spec.generates else 0,
        sum(result.cached_tokens for result in calls),
        sum(result.loaded_tokens for result in calls),
    )
    return {**tokens, "energy": summed_energy_usage(calls)} if energy else tokens
