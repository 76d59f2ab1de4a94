"""The ingress: OpenAI-compatible HTTP and rayturn's gRPC API in one Serve deployment.

Per call it authenticates, validates, applies the chat template, tokenizes,
computes the prompt's page hashes (the routing hint the decode pool's router
weighs against what each replica holds), finds the session id, and streams
the decode pool's per-step deltas back as SSE or gRPC messages. Bad input is
answered here with a 4xx in the OpenAI error shape (gRPC: INVALID_ARGUMENT)
and never reaches a replica; a full decode queue answers 429.

Every HTTP answer from the decode pool carries the header ``x-rayturn-replica``:
the Serve id of the decode replica that served the call, so clients and tests
can see where a session's calls land.
"""

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from ray import serve
from ray.serve.exceptions import BackPressureError

from rayturn.engine.config import ModelConfig
from rayturn.engine.llm_engine import model_identity
from rayturn.engine.page_hash import hash_pages
from rayturn.engine.presets import PRESETS, preset_dir
from rayturn.engine.sampling_params import SamplingParams
from rayturn.engine.sequence import TokenLogprob
from rayturn.engine.tokenizer import Tokenizer
from rayturn.protos import rayturn_pb2 as pb
from rayturn.router.session import (
    SESSION_STATE_HEADER,
    LifecycleHints,
    classify_call,
    lifecycle_hints,
    required_session_id,
    session_id_from_grpc_metadata,
    session_id_from_headers,
)

from . import openai_api as oai

logger = logging.getLogger(__name__)

app = FastAPI(title="rayturn", docs_url=None, redoc_url=None)

# A routing hint carries the first 16 hex digits of each page hash.
PAGE_HASH_HEX = 16
# The response header naming the decode replica that served a call.
REPLICA_HEADER = "x-rayturn-replica"
NO_HINTS = LifecycleHints()


@dataclass
class CompletionState:
    """One completion's accumulated output, for non-streaming answers and usage."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class CallResult:
    completions: dict[int, CompletionState]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    loaded_tokens: int = 0
    path: str = "local"
    replica_id: str | None = None
    session: dict[str, Any] | None = None  # the decode replica's view of the session at arrival

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions.values())

    def usage(self) -> dict[str, Any]:
        return oai.usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.loaded_tokens)


class IngressMetrics:
    """Per-ingress-replica Prometheus metrics, served at ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rayturn_requests", "Calls by API and outcome", ["api", "outcome"], registry=self.registry
        )
        self.ttft = Histogram(
            "rayturn_time_to_first_token_seconds",
            "Time from arrival to the first token",
            ["path"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
            registry=self.registry,
        )
        self.itl = Histogram(
            "rayturn_inter_token_latency_seconds",
            "Time between streamed steps of one completion",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
            registry=self.registry,
        )
        self.e2e = Histogram(
            "rayturn_request_latency_seconds",
            "Arrival to last token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "rayturn_prompt_tokens", "Prompt tokens by where their KV came from", ["source"], registry=self.registry
        )
        self.completion_tokens = Counter("rayturn_completion_tokens", "Generated tokens", registry=self.registry)
        self.session_returns = Counter(
            "rayturn_session_returns",
            "Calls that start a new turn of a known session, by the session's KV state at arrival",
            ["state"],
            registry=self.registry,
        )
        self.session_idle = Counter(
            "rayturn_session_idle_seconds",
            "User idle time before returning turns, and the part the session's KV spent off the device",
            ["kv"],
            registry=self.registry,
        )

    def count_session(self, session: Mapping[str, Any] | None) -> None:
        if session is None or session.get("idle_s") is None:
            return
        self.session_returns.labels(session["state"]).inc()
        self.session_idle.labels("any").inc(session["idle_s"])
        self.session_idle.labels("off_device").inc(session["off_device_s"])


_NO_STEP = object()


async def _first_step(steps: AsyncIterator[list[dict[str, Any]]]) -> Any:
    """The first step of a call, so failures before any token become HTTP errors, not broken streams."""
    try:
        return await anext(steps)
    except StopAsyncIteration:
        return _NO_STEP
    except BackPressureError as err:
        raise oai.rate_limited(f"rayturn is at capacity; retry shortly ({err})") from err
    except ValueError as err:  # the engine refused the request (a replica's ValueError)
        raise oai.invalid_request(str(err).splitlines()[-1], param=None) from err


async def _announced(answer: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    """A decode replica's answer to an announcement; a full queue is a 429, a failed replica a 503."""
    try:
        return await answer
    except BackPressureError as err:
        raise oai.rate_limited(f"rayturn is at capacity; retry shortly ({err})") from err
    except Exception as err:  # the announcement is lost, nothing else: the call itself still comes
        raise oai.server_error(f"no decode replica took the announcement: {err}", status_code=503) from err


async def _chain(first: Any, steps: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[list[dict[str, Any]]]:
    if first is not _NO_STEP:
        yield first
        async for step in steps:
            yield step


def _grpc_fail(grpc_context: Any, code: grpc.StatusCode, details: str) -> None:
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)


def _error_response(err: oai.APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status_code)


def _replica_headers(result: CallResult) -> dict[str, str]:
    headers = {REPLICA_HEADER: result.replica_id} if result.replica_id else {}
    if result.session is not None:
        headers[SESSION_STATE_HEADER] = json.dumps(result.session, separators=(",", ":"))
    return headers


def _sse_response(events: AsyncIterator[str], result: CallResult) -> StreamingResponse:
    # The first step has arrived before the response starts, so the replica is known.
    headers = {"Cache-Control": "no-cache", **_replica_headers(result)}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


@serve.ingress(app)
class Ingress:
    def __init__(self, decode: Any, prefill: Any, store_nodes: Any, settings: Mapping[str, Any]) -> None:
        self.decode = decode
        self.prefill = prefill
        self.store_nodes = store_nodes
        model = settings["model"]
        model_dir = preset_dir(model) if model in PRESETS else Path(model)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        model_config = ModelConfig.from_file(model_dir / "config.json")
        limit = settings.get("max_model_len")
        self.max_model_len = min(limit or model_config.max_model_len, model_config.max_model_len)
        self.vocab_size = model_config.vocab_size
        self.model_id = model_identity(model_dir)
        self.page_size = int(settings["page_size"])
        self.served_model = str(settings["served_model_name"])
        self.api_keys = frozenset(settings.get("api_keys") or ())
        self.created = int(time.time())
        self.telemetry = IngressMetrics()

    # -- the pipeline shared by HTTP and gRPC -----------------------------

    def _serve_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        session_id: str | None,
        hints: LifecycleHints = NO_HINTS,
        tools: bool = False,
    ) -> dict[str, Any]:
        usable = (len(prompt_ids) - 1) // self.page_size
        hashes = hash_pages(prompt_ids[: usable * self.page_size], self.page_size, self.model_id)
        return {
            "call": hints.call,
            "after": hints.after,
            "tools": tools,
            "request_id": uuid.uuid4().hex,
            "prompt_token_ids": prompt_ids,
            "params": params,
            "cache_salt": "",
            "session_id": session_id,
            "page_hashes": [h.hex()[:PAGE_HASH_HEX] for h in hashes],
            "prompt_tokens": len(prompt_ids),
        }

    async def _steps(self, request: dict[str, Any], result: CallResult) -> AsyncIterator[list[dict[str, Any]]]:
        """The decode pool's per-step deltas, folded into ``result`` as they pass."""
        start = time.perf_counter()
        last = start
        first = True
        generator = self.decode.generate.options(stream=True).remote(request)
        done = False
        try:
            async for step in generator:
                now = time.perf_counter()
                if first:
                    self.telemetry.ttft.labels(step["path"]).observe(now - start)
                    first = False
                else:
                    self.telemetry.itl.observe(now - last)
                last = now
                result.prompt_tokens = step["prompt_tokens"]
                result.cached_tokens = step["cached_tokens"]
                result.loaded_tokens = step["loaded_tokens"]
                result.path = step["path"]
                result.replica_id = step.get("replica_id")
                if "session" in step:
                    result.session = step["session"]
                    self.telemetry.count_session(result.session)
                for delta in step["deltas"]:
                    state = result.completions.setdefault(delta["index"], CompletionState())
                    state.token_ids.extend(delta["token_ids"])
                    state.text += delta["text"]
                    if delta["logprobs"]:
                        state.logprobs.extend(delta["logprobs"])
                    state.finish_reason = delta["finish_reason"]
                yield step["deltas"]
            done = True
        finally:
            if not done:
                generator.cancel()
            self.telemetry.e2e.observe(time.perf_counter() - start)
            self._count_tokens(result)

    def _count_tokens(self, result: CallResult) -> None:
        local = result.cached_tokens - result.loaded_tokens
        self.telemetry.prompt_tokens.labels("device").inc(max(local, 0))
        self.telemetry.prompt_tokens.labels("store").inc(result.loaded_tokens)
        self.telemetry.prompt_tokens.labels("computed").inc(max(result.prompt_tokens - result.cached_tokens, 0))
        self.telemetry.completion_tokens.inc(result.completion_tokens)

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")

    # -- gRPC ---------------------------------------------------------------

    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:
        try:
            prompt_ids, params = self._grpc_inputs(request)
        except ValueError as err:
            self.telemetry.requests.labels("grpc", "invalid").inc()
            _grpc_fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise  # Serve answers with the status set above
        metadata = list(grpc_context.invocation_metadata()) if grpc_context is not None else []
        try:
            hints = lifecycle_hints(metadata)
        except ValueError as err:
            self.telemetry.requests.labels("grpc", "invalid").inc()
            _grpc_fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise
        session_id = request.session_id or session_id_from_grpc_metadata(metadata)
        serve_request = self._serve_request(prompt_ids, params, session_id, hints)
        result = CallResult(completions={})
        try:
            async for deltas in self._steps(serve_request, result):
                for delta in deltas:
                    response = pb.GenerateResponse(
                        index=delta["index"],
                        token_ids=delta["token_ids"],
                        text=delta["text"],
                        finish_reason=delta["finish_reason"] or "",
                    )
                    if delta["logprobs"]:
                        response.logprobs.token_logprobs.extend(lp.logprob for lp in delta["logprobs"])
                    if delta["finish_reason"] is not None:
                        response.usage.prompt_tokens = result.prompt_tokens
                        response.usage.completion_tokens = result.completion_tokens
                        response.usage.cached_tokens = result.cached_tokens
                    yield response
        except BackPressureError as err:
            self.telemetry.requests.labels("grpc", "overloaded").inc()
            _grpc_fail(grpc_context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded, retry later: {err}")
            raise
        self.telemetry.requests.labels("grpc", "ok").inc()

    def _grpc_inputs(self, request: Any) -> tuple[list[int], SamplingParams]:
        if request.model and request.model != self.served_model:
            raise ValueError(f"model {request.model!r} is not served here; this cluster serves {self.served_model!r}")
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise ValueError("text is empty")
            prompt_ids = self.tokenizer.encode(request.text)
        elif kind == "token_ids":
            prompt_ids = list(request.token_ids.ids)
        elif kind == "messages":
            messages = [
                {
                    k: v
                    for k, v in (
                        ("role", m.role),
                        ("content", m.content),
                        ("name", m.name),
                        ("tool_call_id", m.tool_call_id),
                    )
                    if v
                }
                for m in request.messages.messages
            ]
            if not messages:
                raise ValueError("messages is empty")
            prompt_ids = self.tokenizer.encode_chat(messages)
        else:
            raise ValueError("input is missing: set one of text, token_ids, messages")
        self._check_prompt(prompt_ids)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context is {self.max_model_len}")
        options = request.sampling
        room = self.max_model_len - len(prompt_ids)
        max_tokens = options.max_tokens if options.HasField("max_tokens") else room
        if max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens} exceeds the {room} tokens left in the context")
        params = SamplingParams(
            n=options.n or 1,
            max_tokens=max_tokens,
            temperature=options.temperature if options.HasField("temperature") else 1.0,
            top_p=options.top_p if options.HasField("top_p") else 1.0,
            top_k=options.top_k if options.HasField("top_k") else 0,
            seed=options.seed if options.HasField("seed") else None,
            stop=tuple(options.stop),
            stop_token_ids=tuple(options.stop_token_ids),
            ignore_eos=options.ignore_eos,
            logprobs=options.top_logprobs if options.logprobs else None,
        )
        return prompt_ids, params

    async def Prewarm(self, request: Any, grpc_context: Any = None) -> Any:
        metadata = list(grpc_context.invocation_metadata()) if grpc_context is not None else []
        try:
            session_id = required_session_id(
                request.session_id.strip() or session_id_from_grpc_metadata(metadata), "session_id"
            )
        except ValueError as err:
            self.telemetry.requests.labels("grpc_prewarm", "invalid").inc()
            _grpc_fail(grpc_context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise
        try:
            answer = await self._prewarm(session_id)
        except oai.APIError as err:
            overloaded = err.status_code == 429
            self.telemetry.requests.labels("grpc_prewarm", "overloaded" if overloaded else "failed").inc()
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if overloaded else grpc.StatusCode.UNAVAILABLE
            _grpc_fail(grpc_context, code, err.message)
            raise
        self.telemetry.requests.labels("grpc_prewarm", "ok").inc()
        return pb.PrewarmResponse(state=answer["state"], replica_id=answer["replica_id"] or "")

    async def _prewarm(self, session_id: str) -> dict[str, Any]:
        """Announce a session's next call to the decode replica that follows the session."""
        request = {"session_id": session_id, "page_hashes": [], "prompt_tokens": 0, "prewarm": True}
        return await _announced(self.decode.prewarm.remote(request))

    async def Health(self, request: Any, grpc_context: Any = None) -> Any:
        status, details = await self._health()
        return pb.HealthResponse(status=status, details={k: str(v) for k, v in details.items()})

    async def _health(self) -> tuple[str, dict[str, Any]]:
        details: dict[str, Any] = {"model": self.served_model, "model_id": self.model_id}
        status = "ok"
        pools: Sequence[tuple[str, Any]] = [("decode", self.decode), ("prefill", self.prefill)]
        for name, handle in pools:
            if handle is None:
                continue
            try:
                health = await handle.health.remote()
            except Exception as err:
                status = "degraded"
                details[f"{name}.error"] = str(err)
                continue
            if health.get("status") != "ok":
                status = "degraded"
            for key, value in health.items():
                details[f"{name}.{key}"] = value
        return status, details

    # -- HTTP -------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in self.api_keys:
            raise oai.authentication_failed()

    async def _json_body(self, request: Request) -> object:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise oai.invalid_request(f"We could not parse the JSON body of your request: {err}", param=None) from err

    def _session(self, request: Request, body: Mapping[str, Any]) -> str | None:
        try:
            return session_id_from_headers(dict(request.headers), body)
        except ValueError as err:
            raise oai.invalid_request(str(err), param="user") from err

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except oai.APIError as err:
            return _error_response(err)
        return JSONResponse(oai.models_list(self.served_model, self.created))

    @app.post("/v1/sessions/{session_id:path}/prewarm")  # session ids may hold slashes
    async def prewarm(self, session_id: str, request: Request) -> JSONResponse:
        """The session's user has started typing: bring its KV back to the device before the call."""
        try:
            self._authorize(request)
            try:
                session = required_session_id(session_id, "path")
            except ValueError as err:
                raise oai.invalid_request(str(err), param="session_id") from err
            answer = await self._prewarm(session)
        except oai.APIError as err:
            outcome = {401: "unauthorized", 429: "overloaded", 503: "failed"}.get(err.status_code, "invalid")
            self.telemetry.requests.labels("prewarm", outcome).inc()
            return _error_response(err)
        self.telemetry.requests.labels("prewarm", "ok").inc()
        headers = {REPLICA_HEADER: answer["replica_id"]} if answer["replica_id"] else {}
        body = {"object": "session.prewarm", "session_id": session, "state": answer["state"]}
        return JSONResponse(body, status_code=202, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            self._authorize(request)
            body = await self._json_body(request)
            chat = oai.parse_chat_request(body, self.served_model)
            try:
                prompt_ids = self.tokenizer.encode_chat(chat.messages, tools=chat.prompt_tools)
            except ValueError as err:
                raise oai.invalid_request(f"cannot apply the chat template: {err}", param="messages") from err
            params = oai.to_sampling_params(
                chat.sampling,
                default_max_tokens=self.max_model_len,
                prompt_tokens=len(prompt_ids),
                max_model_len=self.max_model_len,
            )
            result, steps, first = await self._start(request, body, prompt_ids, params, chat)
        except oai.APIError as err:
            self.telemetry.requests.labels("chat", "invalid").inc()
            return _error_response(err)
        if chat.stream:
            return _sse_response(self._chat_stream(chat, steps, first, result), result)
        async for _ in _chain(first, steps):
            pass
        self.telemetry.requests.labels("chat", "ok").inc()
        return JSONResponse(self._chat_body(chat, result), headers=_replica_headers(result))

    async def _start(
        self,
        request: Request,
        body: object,
        prompt_ids: list[int],
        params: SamplingParams,
        chat: oai.ChatRequest | None = None,
    ) -> tuple[CallResult, AsyncIterator[list[dict[str, Any]]], Any]:
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
        serve_request = self._serve_request(prompt_ids, params, self._session(request, body), hints, tools)
        result = CallResult(completions={})
        steps = self._steps(serve_request, result)
        return result, steps, await _first_step(steps)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

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
        self, chat: oai.ChatRequest, steps: AsyncIterator[list[dict[str, Any]]], first: Any, result: CallResult
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
            async for deltas in _chain(first, steps):
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
            logger.warning("chat stream failed: %s", err)
            yield oai.sse(oai.server_error(f"generation failed: {err}").to_dict())
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
        try:
            self._authorize(request)
            body = await self._json_body(request)
            spec = oai.parse_completion_request(body, self.served_model)
            prompt_ids = self.tokenizer.encode(spec.prompt) if isinstance(spec.prompt, str) else list(spec.prompt)
            try:
                self._check_prompt(prompt_ids)
            except ValueError as err:
                raise oai.invalid_request(str(err), param="prompt") from err
            params = oai.to_sampling_params(
                spec.sampling,
                default_max_tokens=16,
                prompt_tokens=len(prompt_ids),
                max_model_len=self.max_model_len,
                prompt_param="prompt",
            )
            result, steps, first = await self._start(request, body, prompt_ids, params)
        except oai.APIError as err:
            self.telemetry.requests.labels("completions", "invalid").inc()
            return _error_response(err)
        if spec.stream:
            return _sse_response(self._completion_stream(spec, steps, first, result), result)
        async for _ in _chain(first, steps):
            pass
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
        self, spec: oai.CompletionRequest, steps: AsyncIterator[list[dict[str, Any]]], first: Any, result: CallResult
    ) -> AsyncIterator[str]:
        response_id, created = oai.completion_id(), int(time.time())
        offsets: dict[int, int] = {}
        try:
            async for deltas in _chain(first, steps):
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
            logger.warning("completion stream failed: %s", err)
            yield oai.sse(oai.server_error(f"generation failed: {err}").to_dict())
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
    async def health(self) -> JSONResponse:
        status, details = await self._health()
        return JSONResponse({"status": status, "details": details}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(self.telemetry.registry).decode(), media_type="text/plain; version=0.0.4"
        )
