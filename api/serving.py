"""What every HTTP route of the ingress does around its own API: key, body, session, start, failure.

    request --> tenant (401)  --> JSON body (413 / 400) --> API's own parse and prompt
            --> routing and life-cycle hints, the class asked for (body, else header: ``priority``)
            --> ``CallPipeline.start`` --> the API's answer or stream

The API modules (``serving_chat``, ``serving_completion``) hold only their
own wire format; this one holds the steps they share, so each API's call is
one straight pass.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from rayturn.engine.prefix_pins import Retention
from rayturn.engine.sampling_params import SamplingParams
from rayturn.messages import Call, CallKind

from .bodies import TokenNames
from .errors import RETRY_AFTER_S, APIError, authentication_failed, client_error, invalid_request, outcome
from .pipeline import CallPipeline, CallResult, Steps
from .priority import requested_priority
from .protocol import ChatRequest
from .request_limits import check_json_media_type, off_loop, parse_json, read_body
from .session import (
    SESSION_STATE_HEADER,
    LifecycleHints,
    header_session,
    lifecycle_hints,
    optional_session_id,
)
from .streaming import sse

# The response header naming the decode replica that served a call.
REPLICA_HEADER = "x-rayturn-replica"
NO_CACHE = {"Cache-Control": "no-cache"}


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status_code in (429, 503) else None
    return JSONResponse(err.to_dict(), status_code=err.status_code, headers=headers)


def replica_headers(result: CallResult) -> dict[str, str]:
    headers = {REPLICA_HEADER: result.replica_id} if result.replica_id else {}
    if result.session is not None:
        headers[SESSION_STATE_HEADER] = json.dumps(result.session, separators=(",", ":"))
    return headers


def sse_response(
    events: AsyncIterator[str], result: CallResult, headers: Mapping[str, str] | None = None
) -> StreamingResponse:
    # The first step has arrived before the response starts, so the replica is known.
    headers = {**NO_CACHE, **(headers or {}), **replica_headers(result)}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def stream_failure(err: Exception, result: CallResult) -> str:
    """The SSE error event for a stream that failed after its headers went out (details only in the log)."""
    return sse(client_error(err, result.request_id).to_dict())


class HTTPServing:
    """The steps every HTTP API of the ingress shares, on one replica's call pipeline."""

    def __init__(self, pipeline: CallPipeline) -> None:
        self.pipeline = pipeline
        self.telemetry = pipeline.telemetry
        self.served_model = pipeline.served_model

    def authorize(self, request: Request) -> str:
        """The caller's tenant; a 401 when keys are set and the request presents no valid one."""
        tenant = self.pipeline.tenant(request.headers)
        if tenant is None:
            raise authentication_failed()
        return tenant

    async def json_body(self, request: Request) -> tuple[object, int]:
        """The parsed body and its size in bytes; 415 unless sent as JSON, 413 past ``server.max_request_bytes``,
        400 if not JSON."""
        check_json_media_type(request.headers)
        raw = await read_body(request.headers, request.stream(), self.pipeline.max_request_bytes)
        return await off_loop(len(raw), lambda: parse_json(raw)), len(raw)

    def failure(self, api: str, err: Exception, request_id: str) -> JSONResponse:
        api_error = client_error(err, request_id)
        self.telemetry.requests.labels(api, outcome(api_error.status_code)).inc()
        return error_response(api_error)

    def succeeded(self, api: str) -> None:
        self.telemetry.requests.labels(api, "ok").inc()

    async def start(
        self,
        request_id: str,
        request: Request,
        tenant: str,
        prompt_ids: list[int],
        params: SamplingParams,
        hints: LifecycleHints | None = None,
        tools: bool = False,
        body_session: tuple[str | None, str] = (None, "user"),
        retention: Retention | None = None,
        tool_specs: Sequence[Mapping[str, Any]] = (),
        priority: str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[CallResult, Steps, Any]:
        """Send a validated call to the decode pool; returns its result, its steps and the first step.

        ``hints``: what the API itself knows of the call's place in its session; the client's headers win.
        ``body_session``: (the session id the body names, the field it came from: OpenAI ``user`` or
        ``prompt_cache_key``, Anthropic ``metadata.user_id``); a session header wins over it.
        ``priority``: the class the body names; it wins over the ``x-rayturn-priority`` header.
        ``cache_salt``: the call's own prefix-cache salt (``rayturn.api.tenants``).
        """
        session_id, said = self.call_context(request, body_session)
        if hints is not None:
            said = LifecycleHints(said.call or hints.call, said.after or hints.after)
        asked = requested_priority(priority, request.headers)
        call = await self.pipeline.serve_request(
            request_id,
            prompt_ids,
            params,
            tenant,
            session_id,
            said,
            tools,
            retention,
            tool_specs,
            priority=asked,
            cache_salt=cache_salt,
        )
        return await self.pipeline.start(call)

    def call_context(self, request: Request, body_session: tuple[str | None, str]) -> tuple[str | None, LifecycleHints]:
        """The call's session id (a session header, else the body's) and what its headers say of its kind."""
        try:
            said = lifecycle_hints(dict(request.headers))
        except ValueError as err:
            raise invalid_request(str(err), param=None) from err
        # A session header wins over the body; a bad value is blamed on where it came from.
        value, source = header_session(dict(request.headers)) or body_session
        try:
            session_id = optional_session_id(value, source)
        except ValueError as err:
            raise invalid_request(str(err), param=source) from err
        return session_id, said

    async def prepare_chat(
        self,
        request_id: str,
        request: Request,
        tenant: str,
        chat: ChatRequest,
        num_bytes: int,
        *,
        body_session: tuple[str | None, str],
        max_tokens: int | None = None,
        call: CallKind | None = None,
        prompt_param: str = "messages",
        max_tokens_param: str = "max_tokens",
    ) -> Call:
        """A chat-shaped call (``CallPipeline.chat_call``), checked and tokenized, not yet sent."""
        session_id, said = self.call_context(request, body_session)
        return await self.pipeline.chat_call(
            request_id,
            tenant,
            chat,
            num_bytes,
            session_id,
            said,
            max_tokens=max_tokens,
            call=call,
            prompt_param=prompt_param,
            max_tokens_param=max_tokens_param,
            priority=requested_priority(chat.priority, request.headers),
        )

    @property
    def token_names(self) -> TokenNames:
        return TokenNames(self.pipeline.token_bytes)
