"""The ingress: OpenAI-compatible HTTP and rayturn's gRPC API in one Serve deployment.

Per call it authenticates the caller's key (its tenant), bounds and parses
the body, applies the chat template, tokenizes, computes the prompt's page
hashes (the routing hint the decode pool's router weighs against what each
replica holds; salted by tenant), finds the session id, and streams the
decode pool's per-step deltas back as SSE or gRPC messages
(``pipeline.CallPipeline``; gRPC in ``grpc_front``). Bad input is answered
here with a 4xx in the OpenAI error shape (gRPC: INVALID_ARGUMENT) and never
reaches a replica; a full decode queue answers 429, a failed replica 503.

Every HTTP answer from the decode pool carries the header ``x-rayturn-replica``:
the Serve id of the decode replica that served the call, so clients and tests
can see where a session's calls land.
"""

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from ray import serve

from rayturn.engine.sampling_params import SamplingParams
from rayturn.router.session import (
    SESSION_STATE_HEADER,
    LifecycleHints,
    classify_call,
    lifecycle_hints,
    required_session_id,
    session_id_from_headers,
)

from . import openai_api as oai
from .failures import RETRY_AFTER_S, client_error, outcome
from .grpc_front import GrpcFront
from .pipeline import CallPipeline, CallResult, Steps, chain_steps, new_request_id
from .request_limits import off_loop, parse_json, read_body

logger = logging.getLogger(__name__)

app = FastAPI(title="rayturn", docs_url=None, redoc_url=None, openapi_url=None)

# The response header naming the decode replica that served a call.
REPLICA_HEADER = "x-rayturn-replica"


def _error_response(err: oai.APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status_code in (429, 503) else None
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=headers)


def _replica_headers(result: CallResult) -> dict[str, str]:
    headers = {REPLICA_HEADER: result.replica_id} if result.replica_id else {}
    if result.session is not None:
        headers[SESSION_STATE_HEADER] = json.dumps(result.session, separators=(",", ":"))
    return headers


def _sse_response(events: AsyncIterator[str], result: CallResult) -> StreamingResponse:
    # The first step has arrived before the response starts, so the replica is known.
    headers = {"Cache-Control": "no-cache", **_replica_headers(result)}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _stream_failure(err: Exception, result: CallResult) -> str:
    """The SSE error event for a stream that failed after its headers went out (details only in the log)."""
    return oai.sse(client_error(err, result.request_id).to_dict())


@serve.ingress(app)
class Ingress:
    def __init__(self, decode: Any, prefill: Any, store_nodes: Any, settings: Mapping[str, Any]) -> None:
        self.pipeline = CallPipeline(decode, prefill, store_nodes, settings)
        self.grpc = GrpcFront(self.pipeline)
        self.served_model = self.pipeline.served_model
        self.telemetry = self.pipeline.telemetry
        self.created = int(time.time())

    # -- gRPC (Serve's gRPC proxy calls these by name) ----------------------

    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:
        async for response in self.grpc.generate(request, grpc_context):
            yield response

    async def Prewarm(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.grpc.prewarm(request, grpc_context)

    async def Health(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.grpc.health(request, grpc_context)

    # -- HTTP -------------------------------------------------------------

    def _authorize(self, request: Request) -> str:
        """The caller's tenant; a 401 when keys are set and the request presents no valid one."""
        tenant = self.pipeline.tenant(request.headers)
        if tenant is None:
            raise oai.authentication_failed()
        return tenant

    async def _json_body(self, request: Request) -> tuple[object, int]:
        """The parsed body and its size in bytes; 413 past ``server.max_request_bytes``, 400 if not JSON."""
        raw = await read_body(request.headers, request.stream(), self.pipeline.max_request_bytes)
        return await off_loop(len(raw), lambda: parse_json(raw)), len(raw)

    def _session(self, request: Request, body: Mapping[str, Any]) -> str | None:
        try:
            return session_id_from_headers(dict(request.headers), body)
        except ValueError as err:
            raise oai.invalid_request(str(err), param="user") from err

    def _failure(self, api: str, err: Exception, request_id: str) -> JSONResponse:
        api_error = client_error(err, request_id)
        self.telemetry.requests.labels(api, outcome(api_error.status_code)).inc()
        return _error_response(api_error)

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except oai.APIError as err:
            return self._failure("models", err, new_request_id())
        return JSONResponse(oai.models_list(self.served_model, self.created))

    @app.post("/v1/sessions/{session_id:path}/prewarm")  # session ids may hold slashes
    async def prewarm(self, session_id: str, request: Request) -> JSONResponse:
        """The session's user has started typing: bring its KV back to the device before the call."""
        request_id = new_request_id()
        try:
            tenant = self._authorize(request)
            try:
                session = required_session_id(session_id, "path")
            except ValueError as err:
                raise oai.invalid_request(str(err), param="session_id") from err
            answer = await self.pipeline.prewarm(request_id, tenant, session)
        except Exception as err:
            return self._failure("prewarm", err, request_id)
        self.telemetry.requests.labels("prewarm", "ok").inc()
        headers = {REPLICA_HEADER: answer["replica_id"]} if answer["replica_id"] else {}
        body = {"object": "session.prewarm", "session_id": session, "state": answer["state"]}
        return JSONResponse(body, status_code=202, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        request_id = new_request_id()
        try:
            tenant = self._authorize(request)
            body, num_bytes = await self._json_body(request)
            chat = oai.parse_chat_request(body, self.served_model)
            prompt_ids = await self.pipeline.chat_prompt(chat.messages, chat.prompt_tools, num_bytes)
            params = oai.to_sampling_params(
                chat.sampling,
                default_max_tokens=self.pipeline.max_model_len,
                prompt_tokens=len(prompt_ids),
                max_model_len=self.pipeline.max_model_len,
            )
            result, steps, first = await self._start(request_id, request, body, tenant, prompt_ids, params, chat)
            if chat.stream:
                return _sse_response(self._chat_stream(chat, steps, first, result), result)
            async for _ in chain_steps(first, steps):
                pass
        except Exception as err:
            return self._failure("chat", err, request_id)
        self.telemetry.requests.labels("chat", "ok").inc()
        return JSONResponse(self._chat_body(chat, result), headers=_replica_headers(result))

    async def _start(
        self,
        request_id: str,
        request: Request,
        body: object,
        tenant: str,
        prompt_ids: list[int],
        params: SamplingParams,
        chat: oai.ChatRequest | None = None,
    ) -> tuple[CallResult, Steps, Any]:
        """Send a validated call to the decode pool; returns its result, its steps and the first step."""
        assert isinstance(body, dict)  # the parsers accept only JSON objects
        try:
            hints = lifecycle_hints(dict(request.headers))
        except ValueError as err:
            raise oai.invalid_request(str(err), param=None) from err
        tools = False
        if chat is not None:
            tools = chat.prompt_tools is not None
            if hints.call is None:
                hints = LifecycleHints(classify_call(chat.messages), hints.after)
        serve_request = await self.pipeline.serve_request(
            request_id, prompt_ids, params, tenant, self._session(request, body), hints, tools
        )
        return await self.pipeline.start(serve_request)

    def _token_text(self, token_id: int) -> str:
        return self.pipeline.tokenizer.decode([token_id])

    def _chat_body(self, chat: oai.ChatRequest, result: CallResult) -> dict[str, Any]:
        choices = []
        for index, state in sorted(result.completions.items()):
            parsed = oai.assistant_output(state.text, chat)
            logprobs = oai.chat_logprobs(state.logprobs, self._token_text) if chat.sampling.logprobs else None
            choices.append(
                oai.chat_choice(
                    index,
                    content=parsed.content if parsed.content or not parsed.tool_calls else None,
                    tool_calls=parsed.tool_calls,
                    finish_reason=state.finish_reason,
                    logprobs=logprobs,
                )
            )
        return oai.chat_completion(
            response_id=oai.chat_completion_id(),
            model=self.served_model,
            created=int(time.time()),
            choices=choices,
            usage=result.usage(),
        )

    async def _chat_stream(
        self, chat: oai.ChatRequest, steps: Steps, first: Any, result: CallResult
    ) -> AsyncIterator[str]:
        response_id, created = oai.chat_completion_id(), int(time.time())
        states = {index: oai.ChatStreamState.for_request(chat, index) for index in range(chat.sampling.n)}

        def chunk(choices: list[dict[str, Any]]) -> str:
            return oai.sse(
                oai.chat_chunk(
                    response_id=response_id,
                    model=self.served_model,
                    created=created,
                    choices=choices,
                    include_usage=chat.include_usage,
                )
            )

        yield chunk([state.start() for state in states.values()])
        try:
            async for deltas in chain_steps(first, steps):
                texts, endings = [], []  # one choice per index per chunk: text first, then the finish
                for delta in deltas:
                    state = states[delta["index"]]
                    logprobs = (
                        oai.chat_logprobs(delta["logprobs"], self._token_text)
                        if chat.sampling.logprobs and delta["logprobs"]
                        else None
                    )
                    if delta["text"] or delta["finish_reason"] is None:
                        choice = state.push(delta["text"], logprobs)
                        logprobs = None
                        if choice is not None:
                            texts.append(choice)
                    if delta["finish_reason"] is not None:
                        endings.append(state.finish(delta["finish_reason"], logprobs))
                for choices in (texts, endings):
                    if choices:
                        yield chunk(choices)
        except Exception as err:  # after the headers went out, errors travel in the stream
            self.telemetry.requests.labels("chat", "failed").inc()
            yield _stream_failure(err, result)
            yield oai.SSE_DONE
            return
        if chat.include_usage:
            usage = result.usage()
            yield oai.sse(
                oai.chat_usage_chunk(response_id=response_id, model=self.served_model, created=created, usage=usage)
            )
        self.telemetry.requests.labels("chat", "ok").inc()
        yield oai.SSE_DONE

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        request_id = new_request_id()
        try:
            tenant = self._authorize(request)
            body, _ = await self._json_body(request)
            spec = oai.parse_completion_request(body, self.served_model)
            if isinstance(spec.prompt, str):
                prompt_ids = await self.pipeline.text_prompt(spec.prompt, param="prompt")
            else:
                prompt_ids = list(spec.prompt)
            # The length first: a prompt of a million ids is refused without walking them.
            params = oai.to_sampling_params(
                spec.sampling,
                default_max_tokens=16,
                prompt_tokens=len(prompt_ids),
                max_model_len=self.pipeline.max_model_len,
                prompt_param="prompt",
            )
            try:
                self.pipeline.check_prompt_ids(prompt_ids)
            except ValueError as err:
                raise oai.invalid_request(str(err), param="prompt") from err
            result, steps, first = await self._start(request_id, request, body, tenant, prompt_ids, params)
            if spec.stream:
                return _sse_response(self._completion_stream(spec, steps, first, result), result)
            async for _ in chain_steps(first, steps):
                pass
        except Exception as err:
            return self._failure("completions", err, request_id)
        self.telemetry.requests.labels("completions", "ok").inc()
        choices = [
            oai.completion_choice(
                index,
                text=state.text,
                finish_reason=state.finish_reason,
                logprobs=oai.completion_logprobs(state.logprobs, self._token_text) if spec.sampling.logprobs else None,
            )
            for index, state in sorted(result.completions.items())
        ]
        return JSONResponse(
            oai.completion(
                response_id=oai.completion_id(),
                model=self.served_model,
                created=int(time.time()),
                choices=choices,
                usage=result.usage(),
            ),
            headers=_replica_headers(result),
        )

    async def _completion_stream(
        self, spec: oai.CompletionRequest, steps: Steps, first: Any, result: CallResult
    ) -> AsyncIterator[str]:
        response_id, created = oai.completion_id(), int(time.time())
        offsets: dict[int, int] = {}
        try:
            async for deltas in chain_steps(first, steps):
                choices = []
                for delta in deltas:
                    logprobs = None
                    if spec.sampling.logprobs and delta["logprobs"]:
                        offset = offsets.get(delta["index"], 0)
                        logprobs = oai.completion_logprobs(delta["logprobs"], self._token_text, text_offset=offset)
                    offsets[delta["index"]] = offsets.get(delta["index"], 0) + len(delta["text"])
                    choices.append(
                        oai.completion_choice(
                            delta["index"], text=delta["text"], finish_reason=delta["finish_reason"], logprobs=logprobs
                        )
                    )
                yield oai.sse(
                    oai.completion_chunk(
                        response_id=response_id,
                        model=self.served_model,
                        created=created,
                        choices=choices,
                        include_usage=spec.include_usage,
                    )
                )
        except Exception as err:
            self.telemetry.requests.labels("completions", "failed").inc()
            yield _stream_failure(err, result)
            yield oai.SSE_DONE
            return
        if spec.include_usage:
            usage = result.usage()
            yield oai.sse(
                oai.completion_usage_chunk(
                    response_id=response_id, model=self.served_model, created=created, usage=usage
                )
            )
        self.telemetry.requests.labels("completions", "ok").inc()
        yield oai.SSE_DONE

    @app.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        """Every pool's replica counts for anyone (load balancers probe it); replica states, the model and the
        replicas' own reports only for a caller with a valid key, when keys are set."""
        detailed = self.pipeline.tenant(request.headers) is not None
        status, body = await self.pipeline.health(detailed)
        return JSONResponse({"status": status, **body}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(self.telemetry.registry).decode(), media_type="text/plain; version=0.0.4"
        )
