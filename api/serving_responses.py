"""``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/input_tokens`` (a prompt's count): one straight
pass from the body to the answer (under ``background``, made by a task: ``background_responses``).

body, its item references resolved (responses_items)
     --> ResponsesRequest (responses_request), after the conversation ``previous_response_id`` names (response_store)
     --> ChatRequest --> chat template + tokens (pipeline) --> SamplingParams (protocol)
     --> call, classified as user / tool continuation from its messages --> decode pool
     --> steps --> one response body, or Responses events (responses_stream)
     --> under ``store``: the response, its conversation and its items kept for the call that continues it
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rayturn.messages import Call

from .background_responses import (
    RUNNING,
    BackgroundRun,
    BackgroundRuns,
    event_stream,
    sse_events,
    starting_after,
    stream_query,
)
from .bodies import assistant_output, chat_logprobs, splits_answer
from .call_result import CompletionState
from .errors import APIError, client_error, invalid_request, outcome
from .pipeline import CallPipeline, CallResult, Steps, chain_steps
from .protocol import JSON, ChatRequest
from .response_store import StoredResponse, json_size
from .responses_bodies import (
    ResponseFrame,
    assistant_message,
    deleted,
    output_items,
    response_error,
    response_id,
    response_status,
    response_usage,
)
from .responses_items import items_page, listed_items, page_query
from .responses_request import ResponsesRequest, parse_input_tokens_request, parse_responses_request
from .responses_stream import ResponsesStream
from .serving import HTTPServing, replica_headers, sse_response
from .shared_responses import Responses, Snapshots

API = "responses"
# Reading and deleting stored responses, counted apart from the calls that make them.
STORE_API = "responses_store"
COUNT_API = "responses_input_tokens"
# The statuses of a response with an answer a later call can continue.
ANSWERED = ("completed", "incomplete")


@dataclass(frozen=True, slots=True)
class _Turn:
    """One call's request, the stored response it continues, and the frame its answer's bodies share."""

    request: ResponsesRequest
    chat: ChatRequest
    previous: StoredResponse | None
    tenant: str
    frame: ResponseFrame
    num_bytes: int  # the request body's size, the part of the stored entry this call adds before its answer
    inputs: tuple[JSON, ...]  # under ``store``: its input as the response lists it (``responses_items``)

    def items(self) -> tuple[JSON, ...]:
        """The items the response is made from: the conversation it continues, then its input."""
        return (*(self.previous.held_items() if self.previous is not None else ()), *self.inputs)


@dataclass(frozen=True, slots=True)
class _Read:
    """A body read as a response's (``ServingResponses._read``)."""

    tenant: str
    body: JSON  # its item references resolved
    num_bytes: int
    request: ResponsesRequest
    previous: StoredResponse | None  # the stored response it continues
    chat: ChatRequest


class ServingResponses(HTTPServing):
    def __init__(self, pipeline: CallPipeline, keeper: Any = None, runs: BackgroundRuns | None = None) -> None:
        """``keeper``: the application's ``responses`` deployment (several ingress replicas), else None."""
        super().__init__(pipeline)
        self.store = Responses(keeper)
        self.runs = BackgroundRuns() if runs is None else runs

    async def create(self, request: Request, request_id: str) -> Response:
        try:
            read = await self._read(request, parse_responses_request)
            parsed = read.request
            inputs = tuple(listed_items(read.body["input"])) if parsed.store else ()  # the body parsed
            prepared = await self.prepare_chat(
                request_id,
                request,
                read.tenant,
                read.chat,
                read.num_bytes,
                body_session=parsed.body_session,
                prompt_param="input",
                max_tokens_param="max_output_tokens",
            )
            frame = ResponseFrame(response_id(), int(time.time()), self.served_model, parsed.echo)
            turn = _Turn(parsed, read.chat, read.previous, read.tenant, frame, read.num_bytes, inputs)
            if parsed.background:
                return await self._background(turn, prepared)
            result, steps, first = await self.pipeline.start(prepared)
            if parsed.stream:
                return sse_response(sse_events(self._events(turn, steps, first, result)), result)
            async for _ in chain_steps(first, steps):
                pass
        except Exception as err:
            return self.failure(API, err, request_id)
        answer = await self._answer(turn, result)
        self.succeeded(API)
        return JSONResponse(answer, headers=replica_headers(result))

    async def input_tokens(self, request: Request, request_id: str) -> JSONResponse:
        """How many tokens the prompt of a response made from this body holds (the conversation it continues, its
        instructions, tools and input, cut as its ``truncation`` says), counted as a call counts them; nothing is
        generated or stored."""
        try:
            read = await self._read(request, parse_input_tokens_request)
            prompt_ids = await self.pipeline.chat_prompt(read.chat, read.num_bytes)
        except Exception as err:
            return self.failure(COUNT_API, err, request_id)
        self.succeeded(COUNT_API)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(prompt_ids)})

    async def _read(self, request: Request, parse: Callable[[object, str], ResponsesRequest]) -> _Read:
        """A body read as a response's: the caller's tenant, the body and its size, the request ``parse`` reads
        from it, the stored response it continues, and the chat they make."""
        tenant = self.authorize(request)
        body, num_bytes = await self.json_body(request)
        body = await self.store.resolve(body, tenant)
        parsed = parse(body, self.served_model)
        previous = await self._previous(parsed, tenant)
        chat = parsed.chat(previous.messages if previous is not None else ())
        return _Read(tenant, cast(JSON, body), num_bytes, parsed, previous, chat)

    async def retrieve(self, request: Request, response_id: str, request_id: str) -> Response:
        """The response as it stands; ``?stream=true`` (a streamed background response): its events after the
        sequence number ``starting_after``, live while it runs."""
        try:
            tenant = self.authorize(request)
            stream = stream_query(request.query_params.get("stream"))
            after = starting_after(request.query_params.get("starting_after"))
            run = self.runs.get(tenant, response_id)
            if run is None:
                found = await self._stored(tenant, response_id)
                body, streamed, events = found.body, found.streamed, self.store.follow(found, after)
            else:
                body, streamed, events = run.body, run.streamed, run.follow(after)
            if stream and not streamed:
                message = f"Response '{response_id}' was not made with 'background' and 'stream' both true."
                raise invalid_request(message + " Read it without 'stream'.", param="stream")
        except Exception as err:
            return self.failure(STORE_API, err, request_id)
        self.succeeded(STORE_API)
        return event_stream(events) if stream else JSONResponse(body)

    async def cancel(self, request: Request, response_id: str, request_id: str) -> JSONResponse:
        """Stop a background response still running; one already cancelled is answered as it is."""
        try:
            tenant = self.authorize(request)
            run = self.runs.get(tenant, response_id)
            if run is not None:
                await self.runs.cancel(run)
                body = run.body
            else:
                body = (await self._stored(tenant, response_id, cancel=True)).body
                if body["status"] != "cancelled":
                    message = (
                        f"Response '{response_id}' is {body['status']}; only a background response still running "
                        "can be cancelled."
                    )
                    raise invalid_request(message, param="response_id", code="response_not_running")
        except Exception as err:
            return self.failure(STORE_API, err, request_id)
        self.succeeded(STORE_API)
        return JSONResponse(body)

    async def delete(self, request: Request, response_id: str, request_id: str) -> JSONResponse:
        """Forget a stored response; a background one still running is cancelled first."""
        try:
            tenant = self.authorize(request)
            run = self.runs.get(tenant, response_id)
            if run is not None:
                await self.runs.cancel(run)
            found = await self._stored(tenant, response_id, cancel=True)
            await self.store.delete(found.tenant, found.response_id)
        except Exception as err:
            return self.failure(STORE_API, err, request_id)
        self.succeeded(STORE_API)
        return JSONResponse(deleted(response_id))

    async def input_items(self, request: Request, response_id: str, request_id: str) -> JSONResponse:
        """A page of the items a stored (or running background) response was made from."""
        try:
            tenant = self.authorize(request)
            limit, descending, after = page_query(request.query_params)
            run = self.runs.get(tenant, response_id)
            items = run.input_items if run is not None else (await self._stored(tenant, response_id)).items
            page = items_page(items, limit=limit, descending=descending, after=after)
        except Exception as err:
            return self.failure(STORE_API, err, request_id)
        self.succeeded(STORE_API)
        return JSONResponse(page)

    async def _stored(self, tenant: str, response_id: str, *, cancel: bool = False) -> StoredResponse:
        """The stored response (``cancel``: one another replica is computing, once it stopped), else a 404."""
        found = await self.store.get(tenant, response_id)
        if cancel and found is not None and found.body["status"] in RUNNING:
            found = await self.store.cancel(tenant, response_id)
        if found is None:
            message = f"No response with id '{response_id}' is stored here."
            raise APIError(404, message, param="response_id", code="response_not_found")
        return found

    async def _background(self, turn: _Turn, call: Call) -> Response:
        """Start a background response: answered now (``queued``, or its events as they come), computed by a task."""
        run = BackgroundRun(turn.tenant, turn.frame, streamed=turn.request.stream, input_items=turn.items())
        self.runs.add(run)
        # Contexts of their own: Serve cancels the calls a request made when its client goes, and finds them by
        # the request's context, which a task would otherwise inherit. So the run is stored queued (found by
        # every replica from then on) and computed whatever becomes of the connection, even while it is stored.
        loop = asyncio.get_running_loop()
        queued = loop.create_task(self._remember(turn, run.body), context=contextvars.Context())
        run.task = loop.create_task(self._run(run, turn, call, queued), context=contextvars.Context())
        run.task.add_done_callback(lambda _: self._ended(run, turn))  # even for a task cancelled before it ran
        if self.store.shared:  # a cancel that reaches another replica
            watching = loop.create_task(self.store.relay_cancel(run, self.runs, queued), context=contextvars.Context())
            run.saved.add_done_callback(lambda _: watching.cancel())
        await asyncio.shield(queued)
        return event_stream(run.follow(-1)) if run.streamed else JSONResponse(run.body)

    async def _run(self, run: BackgroundRun, turn: _Turn, call: Call, queued: asyncio.Task[None]) -> None:
        """Compute a background response once it is stored ``queued`` (``_ended`` stores its end)."""
        try:
            await asyncio.wait([queued])
            result, steps, first = await self.pipeline.start(call)
            run.update(turn.frame.body("in_progress", []))
            await self._remember(turn, run.body)
            if run.streamed:
                snapshots = Snapshots()
                async for event in self._events(turn, steps, first, result, store=False):
                    run.push(event)
                    if self.store.shared and snapshots.due():  # followed from the other replicas
                        await snapshots.store(self.store, run, lambda: self._remember(turn, run.body, run.events))
                run.update(run.events[-1]["response"])
            else:
                async for _ in chain_steps(first, steps):
                    pass
                run.update(await self._answer(turn, result, store=False))
                self.succeeded(API)
        except Exception as err:
            failure = client_error(err, call.request_id)
            self.telemetry.requests.labels(API, outcome(failure.status_code)).inc()
            run.update(turn.frame.body("failed", [], error=response_error(failure)))
            if run.streamed:
                run.push({"type": "response.failed", "sequence_number": len(run.events), "response": run.body})

    def _ended(self, run: BackgroundRun, turn: _Turn) -> None:
        """Whatever a background response's end, it is stored (with its events), then leaves the runs."""
        if run.running:  # its task was cancelled (before it ran, or after its last event) without ``cancel``
            run.cancelled()
        if run.body["status"] == "cancelled":
            self.telemetry.requests.labels(API, "cancelled").inc()
        saving = asyncio.ensure_future(self._remember(turn, run.body, run.events))
        saving.add_done_callback(lambda done: self.runs.saved(run, done))

    async def _previous(self, parsed: ResponsesRequest, tenant: str) -> StoredResponse | None:
        if parsed.previous_response_id is None:
            return None
        param = "previous_response_id"
        found = await self.store.get(tenant, parsed.previous_response_id)
        # The store says how it stands (its end may be stored before its run leaves this replica's runs); this
        # replica's runs, when the store has nothing of it (the keeper was away).
        if found is not None:
            running = found.body["status"] in RUNNING
        else:
            running = self.runs.get(tenant, parsed.previous_response_id) is not None
        if running:
            message = f"Previous response '{parsed.previous_response_id}' is still in progress; wait for it to end."
            raise invalid_request(message, param=param, code="previous_response_in_progress")
        if found is None:
            message = (
                f"Previous response with id '{parsed.previous_response_id}' not found. Responses are kept only when "
                f"'store' is true, for {self.store.ttl_s:g} s after their last use; send the whole 'input' instead."
            )
            raise invalid_request(message, param=param, code="previous_response_not_found")
        if found.body["status"] not in ANSWERED:
            message = f"Previous response '{parsed.previous_response_id}' is {found.body['status']}: it has no answer."
            raise invalid_request(message, param=param, code="previous_response_unanswered")
        return found

    async def _answer(self, turn: _Turn, result: CallResult, *, store: bool = True) -> JSON:
        """The answer's body; ``store``: kept too (a background run keeps it as it ends)."""
        state = result.completions.get(0, CompletionState())
        parsed = assistant_output(
            state.text,
            turn.chat,
            parsed=state.parsed_tool_calls(),
            parser=self.pipeline.guides.parser,
            reasoning=result.reasoning,
        )
        status = response_status(state.finish_reason)
        logprobs = chat_logprobs(state.logprobs, self.token_names) if turn.chat.sampling.logprobs else ()
        answer = turn.frame.body(status, output_items(parsed, status, logprobs), self._usage(result))
        if store:
            await self._remember(turn, answer)
        return answer

    async def _remember(self, turn: _Turn, answer: JSON, events: Sequence[JSON] = ()) -> None:
        """Store ``answer`` under ``store`` (with ``events``: a streamed background response's, to stream again)."""
        if not turn.request.store:
            return
        previous = turn.previous
        history = previous.messages if previous is not None else ()
        messages = (*history, *turn.request.input_messages, assistant_message(answer["output"]))
        # The request body bounds the echoed settings, the input items (references resolved) the input, held
        # twice (messages, items); the output is held twice too (body, messages).
        num_bytes = (previous.num_bytes if previous is not None else 0) + turn.num_bytes + 2 * json_size(turn.inputs)
        num_bytes += 2 * json_size(answer["output"]) + (json_size(events) if events else 0)
        streamed = turn.request.background and turn.request.stream
        stored = StoredResponse(
            turn.frame.response_id, turn.tenant, answer, messages, num_bytes, tuple(events), turn.items(), streamed
        )
        await self.store.put(stored)

    def _usage(self, result: CallResult) -> JSON:
        tokens = response_usage(
            result.prompt_tokens,
            result.completion_tokens,
            result.cached_tokens,
            result.loaded_tokens,
            result.reasoning_tokens or 0,
        )
        return {**tokens, "energy": result.energy()}

    async def _events(
        self, turn: _Turn, steps: Steps, first: Any, result: CallResult, *, store: bool = True
    ) -> AsyncIterator[JSON]:
        chat, names = turn.chat, self.token_names
        stream = ResponsesStream(
            turn.frame,
            parse_tools=splits_answer(chat, self.pipeline.guides.parser, result.reasoning),
            parallel_tool_calls=chat.parallel_tool_calls,
            parser=self.pipeline.guides.parser,
            reasoning=result.reasoning,
        )
        for event in stream.start():
            yield event
        finish_reason, held = None, None
        try:
            async for deltas in chain_steps(first, steps):
                for delta in deltas:
                    if chat.sampling.logprobs and delta.logprobs:
                        stream.score(chat_logprobs(delta.logprobs, names))
                    # The replica's split of the text into prose and tool calls (a call that offered tools).
                    pushed, last = (delta.tool_parse + (None, None))[:2]
                    if delta.text or delta.finish_reason is None:
                        for event in stream.push(delta.text, pushed):
                            yield event
                    if delta.finish_reason is not None:
                        finish_reason, held = delta.finish_reason, last
        except Exception as err:  # after the headers went out, errors travel in the stream
            self.telemetry.requests.labels(API, "failed").inc()
            yield stream.fail(response_error(client_error(err, result.request_id)))
            return
        events = stream.finish(finish_reason, self._usage(result), held)
        if store:  # before the last event: the client may continue at once
            await self._remember(turn, stream.response)
        for event in events:
            yield event
        self.succeeded(API)
