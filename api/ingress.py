"""The ingress: the OpenAI, Anthropic Messages and OpenAI Responses HTTP APIs and rayturn's gRPC API in one
Serve deployment.

Per call it authenticates the caller's key (its tenant), bounds and parses
the body, applies the chat template, tokenizes, computes the prompt's page
hashes once (the routing hint the decode pool's router weighs against what
each replica holds, and what every replica and engine on the call's path
uses; salted by tenant), finds the session id, and streams the decode pool's
per-step deltas back as SSE or gRPC messages. Each API is one module:
``serving_chat``, ``serving_completion``, ``serving_messages`` (Anthropic),
``serving_responses`` (Responses), ``serving_tokens`` (vLLM's ``/tokenize``
and ``/detokenize``), ``grpc_service``, on the shared
``pipeline.CallPipeline``. Bad input is answered here with a 4xx in the
error shape of its API (gRPC: INVALID_ARGUMENT) and never reaches a replica; a
full decode queue answers 429, a failed replica 503 (Anthropic: 529).

``GET /openapi.json`` is the HTTP APIs' OpenAPI document with the request
schemas of every route (``openapi``); it names the served model, so it asks
for a key when keys are set, as ``/v1/models`` does.

Every HTTP call's id (its log lines, a 5xx answer's message) starts with the ``x-request-id`` Serve's proxy
echoes: the client's, else one the proxy mints (``request_ids``).

Every HTTP answer from the decode pool carries the header ``x-rayturn-replica``:
the Serve id of the decode replica that served the call, so clients and tests
can see where a session's calls land.
"""

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayturn import __version__
from rayturn.router.replica_logs import follow_serve_logging

from .anthropic_bodies import anthropic_status, error_body
from .bodies import model_card, models_list
from .errors import APIError, invalid_request, model_not_found, route_not_found
from .grpc_service import GrpcService
from .openapi import openapi_document
from .pipeline import CallPipeline
from .request_ids import RequestIdMiddleware, request_id_of
from .serving import REPLICA_HEADER, HTTPServing
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_messages import ServingMessages
from .serving_responses import ServingResponses
from .serving_tokens import ServingTokens
from .session import required_session_id
from .settings import IngressSettings

__all__ = ["REPLICA_HEADER", "Ingress", "app"]

app = FastAPI(title="rayturn", docs_url=None, redoc_url=None, openapi_url=None)
ANTHROPIC_ROUTE = "/v1/messages"
# The header every Anthropic client sends (the API version it speaks).
ANTHROPIC_VERSION_HEADER = "anthropic-version"


def error_for_path(path: str, api_error: APIError, headers: dict[str, str] | None = None) -> Response:
    """``api_error`` in OpenAI's error shape (``{"error": {...}}``), or under Anthropic's ``/v1/messages``
    (``GET /v1/messages``, ``/v1/messages/batches``) in Anthropic's."""
    if path == ANTHROPIC_ROUTE or path.startswith(f"{ANTHROPIC_ROUTE}/"):
        return JSONResponse(error_body(api_error), status_code=anthropic_status(api_error), headers=headers)
    return JSONResponse(api_error.to_dict(), status_code=api_error.status_code, headers=headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
    """A route or method that does not exist, in its API's error shape, not FastAPI's."""
    api_error = route_not_found(request.method, request.url.path, err.status_code)
    return error_for_path(request.url.path, api_error, dict(err.headers or {}) or None)


app.add_middleware(RequestIdMiddleware, failure=error_for_path)


@serve.ingress(app)
class Ingress:
    def __init__(
        self, decode: Any, prefill: Any, store_nodes: Any, settings: IngressSettings, responses: Any = None
    ) -> None:
        """``responses``: the ``responses`` deployment every ingress replica keeps its responses in (several
        replicas: ``shared_responses``), else None (this replica keeps its own)."""
        follow_serve_logging()
        self.pipeline = CallPipeline(decode, prefill, store_nodes, settings)
        self.pipeline.telemetry.keep_up()  # counted live in Ray's metrics as long as this replica runs
        self.pipeline.energy.keeper = responses  # several ingress replicas: sessions' joules counted there
        self.http = HTTPServing(self.pipeline)
        self.chat = ServingChat(self.pipeline)
        self.completion = ServingCompletion(self.pipeline)
        self.messages = ServingMessages(self.pipeline)
        self.responses = ServingResponses(self.pipeline, responses)
        self.tokens = ServingTokens(self.pipeline)
        self.grpc = GrpcService(self.pipeline)
        self.created = int(time.time())
        pipeline = self.pipeline
        reasoning = pipeline.reasoning_parser is not None
        self.openapi = openapi_document(
            pipeline.served_model, pipeline.vocab_size, reasoning=reasoning, max_model_len=pipeline.max_model_len
        )

    # -- gRPC (Serve's gRPC proxy calls these by name) ----------------------

    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:
        async for response in self.grpc.generate(request, grpc_context):
            yield response

    async def Prewarm(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.grpc.prewarm(request, grpc_context)

    async def Health(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.grpc.health(request, grpc_context)

    async def Tokenize(self, request: Any, grpc_context: Any = None) -> Any:
        return await self.grpc.tokenize(request, grpc_context)

    # -- HTTP -------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.chat.create(request, request_id_of(request))

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.completion.create(request, request_id_of(request))

    # Anthropic's Messages API (Claude Code adds ``?beta=true``; query and ``anthropic-*`` headers are not read).
    @app.post(ANTHROPIC_ROUTE)
    async def create_message(self, request: Request) -> Response:
        return await self.messages.create(request, request_id_of(request))

    @app.post(f"{ANTHROPIC_ROUTE}/count_tokens")
    async def count_tokens(self, request: Request) -> Response:
        return await self.messages.count_tokens(request, request_id_of(request))

    @app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        return await self.responses.create(request, request_id_of(request))

    @app.post("/v1/responses/input_tokens")
    async def count_input_tokens(self, request: Request) -> Response:
        return await self.responses.input_tokens(request, request_id_of(request))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        return await self.responses.retrieve(request, response_id, request_id_of(request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request) -> JSONResponse:
        return await self.responses.cancel(request, response_id, request_id_of(request))

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(self, response_id: str, request: Request) -> JSONResponse:
        return await self.responses.input_items(request, response_id, request_id_of(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request) -> JSONResponse:
        return await self.responses.delete(request, response_id, request_id_of(request))

    # vLLM's tokenizer endpoints, at the root as vLLM serves them.
    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self.tokens.tokenize(request, request_id_of(request))

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self.tokens.detokenize(request, request_id_of(request))

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self.http.authorize(request)
            return JSONResponse(models_list([self._model_card()], request.query_params))
        except APIError as err:
            return self._models_failure(request, err)

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes (``org/name``)
    async def model(self, model_id: str, request: Request) -> JSONResponse:
        try:
            self.http.authorize(request)
            if model_id != self.pipeline.served_model:
                raise model_not_found(model_id, self.pipeline.served_model)
        except APIError as err:
            return self._models_failure(request, err)
        return JSONResponse(self._model_card())

    def _models_failure(self, request: Request, err: APIError) -> JSONResponse:
        """An error of the models routes, in Anthropic's shape for Anthropic's clients (they send its version)."""
        serving = self.messages if ANTHROPIC_VERSION_HEADER in request.headers else self.http
        return serving.failure("models", err, request_id_of(request))

    def _model_card(self) -> dict[str, Any]:
        pipeline = self.pipeline
        return model_card(
            pipeline.served_model, self.created, root=pipeline.model_root, max_model_len=pipeline.max_model_len
        )

    @app.get("/openapi.json")
    async def openapi_json(self, request: Request) -> JSONResponse:
        try:
            self.http.authorize(request)
        except APIError as err:
            return self.http.failure("openapi", err, request_id_of(request))
        return JSONResponse(self.openapi)

    @app.post("/v1/sessions/{session_id:path}/prewarm")  # session ids may hold slashes
    async def prewarm(self, session_id: str, request: Request) -> JSONResponse:
        """The session's user has started typing: bring its KV back to the device before the call."""
        request_id = request_id_of(request)
        try:
            tenant = self.http.authorize(request)
            try:
                session = required_session_id(session_id, "path")
            except ValueError as err:
                raise invalid_request(str(err), param="session_id") from err
            answer = await self.pipeline.prewarm(request_id, tenant, session)
        except Exception as err:
            return self.http.failure("prewarm", err, request_id)
        self.http.succeeded("prewarm")
        headers = {REPLICA_HEADER: answer.replica_id} if answer.replica_id else {}
        body = {"object": "session.prewarm", "session_id": session, "state": answer.state}
        return JSONResponse(body, status_code=202, headers=headers)

    @app.get("/health")
    async def health(self, request: Request) -> JSONResponse:
        """Every pool's replica counts for anyone (load balancers probe it); replica states, the model and the
        replicas' own reports only for a caller with a valid key, when keys are set."""
        detailed = self.pipeline.tenant(request.headers) is not None
        status, body = await self.pipeline.health(detailed)
        return JSONResponse({"status": status, **body}, status_code=200 if status == "ok" else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(self, request: Request) -> JSONResponse:
        """SageMaker's health probe (GET or POST), as vLLM serves it: the answer of ``/health``."""
        return await self.health(request)

    @app.get("/version")
    async def version(self, request: Request) -> JSONResponse:
        """The server's version, as vLLM's ``/version`` (``{"version": ...}``); with keys set, for a valid key."""
        try:
            self.http.authorize(request)
        except APIError as err:
            return self.http.failure("version", err, request_id_of(request))
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        registry = self.pipeline.telemetry.registry
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")
