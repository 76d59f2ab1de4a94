"""rayturn's gRPC API (``protos/rayturn.proto``) on the shared call pipeline.

Serve's gRPC proxy calls the ingress deployment's ``Generate``, ``Prewarm``, ``Tokenize``
and ``Health``, which hand over to ``GrpcService``. Every method checks the
caller's key first (``authorization: Bearer <key>`` or ``x-api-key``
metadata) when keys are set: UNAUTHENTICATED otherwise; then that its
request message decoded (``grpc_decoding``): INVALID_ARGUMENT otherwise. Errors set the
status on the context and raise, which Serve turns into that status:
INVALID_ARGUMENT for bad input, RESOURCE_EXHAUSTED for a full queue,
UNAVAILABLE for a failed replica (retry), never Ray's own error text.
Generated classes stay at this edge: a request becomes the chat form the
HTTP APIs share, or a raw prompt (``grpc_request``), then token ids and
engine ``SamplingParams``; the call's deltas become response messages
(``grpc_stream``)::

    GenerateRequest --> ChatRequest | RawPrompt       (grpc_request: 400s name the proto field)
                    --> its class: ``priority``, else the ``x-rayturn-priority`` metadata key (``priority``)
      ChatRequest   --> chat template with the tools, guide for a forced tool call, tool-call split
                        on the decode replica (shared with HTTP's chat start)
      RawPrompt     --> the text tokenized, or the ids checked against the vocabulary
                    --> Call --> decode pool --> deltas --> GenerateResponse stream (grpc_stream)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from rayturn.engine.token_bytes import token_display
from rayturn.messages import Call
from rayturn.protos import rayturn_pb2 as pb

from .errors import APIError, authentication_failed, client_error, invalid_request, outcome
from .grpc_decoding import SERVICER_FUNCTION, UndecodableRequest, decoded
from .grpc_request import RawPrompt, parse_generate_request
from .grpc_stream import GrpcStream
from .pipeline import CallPipeline, chain_steps, check_vocabulary, new_request_id
from .priority import grpc_priority
from .protocol import ChatRequest
from .session import (
    LifecycleHints,
    lifecycle_hints,
    optional_session_id,
    required_session_id,
    session_id_from_grpc_metadata,
)

_STATUS_BY_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
UNAUTHENTICATED_DETAILS = "invalid or missing API key; send it as 'authorization: Bearer <key>' or 'x-api-key' metadata"


__all__ = ["SERVICER_FUNCTION", "GrpcCallFailed", "GrpcService"]


class GrpcCallFailed(Exception):
    """Raised after the status is set on the context: Serve answers the call with that status."""


def _metadata(grpc_context: Any) -> list[tuple[str, Any]]:
    return list(grpc_context.invocation_metadata()) if grpc_context is not None else []


class GrpcService:
    """rayturn's gRPC service (``protos/rayturn.proto``) on the call pipeline; the ingress deployment exposes
    its methods to Serve's gRPC proxy by name."""

    def __init__(self, pipeline: CallPipeline) -> None:
        self.pipeline = pipeline

    def _fail(self, grpc_context: Any, api: str, err: APIError) -> GrpcCallFailed:
        self.pipeline.telemetry.requests.labels(api, outcome(err.status_code)).inc()
        code = _STATUS_BY_HTTP.get(err.status_code, grpc.StatusCode.INTERNAL)
        details = UNAUTHENTICATED_DETAILS if err.status_code == 401 else err.message
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(details)
        return GrpcCallFailed(details)

    def _tenant(self, grpc_context: Any) -> str:
        tenant = self.pipeline.tenant(_metadata(grpc_context))
        if tenant is None:
            raise authentication_failed()
        return tenant

    async def generate(
        self, request: pb.GenerateRequest | UndecodableRequest, grpc_context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        pipeline = self.pipeline
        request_id = new_request_id()
        try:
            tenant = self._tenant(grpc_context)
            request = decoded(request)
            metadata = _metadata(grpc_context)
            try:
                hints = lifecycle_hints(metadata)
                session_id = optional_session_id(request.session_id, "session_id") or session_id_from_grpc_metadata(
                    metadata
                )
            except ValueError as err:
                raise invalid_request(str(err), param=None) from err
            priority = grpc_priority(request.priority, metadata)
            parsed = parse_generate_request(request, pipeline.served_model)
            if isinstance(parsed, ChatRequest):
                call = await pipeline.chat_call(
                    request_id,
                    tenant,
                    parsed,
                    request.ByteSize(),
                    session_id,
                    hints,
                    max_tokens_param="sampling.max_tokens",
                    priority=priority,
                )
            else:
                call = await self._raw_call(request_id, parsed, tenant, session_id, hints, priority)
            stream = self._stream(call, parsed, prompt_ids=request.return_prompt_token_ids)
            result, steps, first = await pipeline.start(call)
        except Exception as err:  # anything else too: never Serve's INTERNAL with a traceback in it
            raise self._fail(grpc_context, "grpc", client_error(err, request_id)) from None
        try:
            async for deltas in chain_steps(first, steps):
                for delta in deltas:
                    yield stream.response(delta, result)
        except Exception as err:
            raise self._fail(grpc_context, "grpc", client_error(err, result.request_id)) from None
        pipeline.telemetry.requests.labels("grpc", "ok").inc()

    async def _raw_call(
        self,
        request_id: str,
        raw: RawPrompt,
        tenant: str,
        session_id: str | None,
        hints: LifecycleHints,
        priority: str | None,
    ) -> Call:
        """Unset ``max_tokens`` may fill the rest of the context."""
        pipeline = self.pipeline
        prompt_ids, params = await pipeline.raw_prompt(
            raw.prompt,
            raw.sampling,
            param=raw.param,
            default_max_tokens=pipeline.max_model_len,
            max_tokens_param="sampling.max_tokens",
        )
        return await pipeline.serve_request(
            request_id, prompt_ids, params, tenant, session_id, hints, priority=priority, cache_salt=raw.cache_salt
        )

    def _stream(self, call: Call, parsed: ChatRequest | RawPrompt, *, prompt_ids: bool) -> GrpcStream:
        params = call.params
        token_bytes = self.pipeline.token_bytes if params.logprobs else None
        return GrpcStream(
            n=params.n,
            tools=call.tools,
            parallel_tool_calls=parsed.parallel_tool_calls if isinstance(parsed, ChatRequest) else True,
            token_text=self._token_text,
            token_bytes=token_bytes,
            prompt_token_ids=call.prompt_token_ids if prompt_ids else None,
        )

    def _token_text(self, token_id: int) -> str:
        """A token as logprob answers name it: its text, or ``bytes:\\x..`` for part of a character."""
        return token_display(self.pipeline.token_bytes(token_id))

    async def prewarm(self, request: pb.PrewarmRequest | UndecodableRequest, grpc_context: Any) -> Any:
        request_id = new_request_id()
        try:
            tenant = self._tenant(grpc_context)
            request = decoded(request)
            try:
                session_id = required_session_id(
                    request.session_id.strip() or session_id_from_grpc_metadata(_metadata(grpc_context)), "session_id"
                )
            except ValueError as err:
                raise invalid_request(str(err), param="session_id") from err
            answer = await self.pipeline.prewarm(request_id, tenant, session_id)
        except Exception as err:
            raise self._fail(grpc_context, "grpc_prewarm", client_error(err, request_id)) from None
        self.pipeline.telemetry.requests.labels("grpc_prewarm", "ok").inc()
        return pb.PrewarmResponse(state=answer.state, replica_id=answer.replica_id or "")

    async def tokenize(self, request: pb.GenerateRequest | UndecodableRequest, grpc_context: Any) -> Any:
        """The prompt ids ``Generate`` would compute for ``request``: the same parse, template and cut; not run."""
        pipeline = self.pipeline
        request_id = new_request_id()
        try:
            self._tenant(grpc_context)
            request = decoded(request)
            parsed = parse_generate_request(request, pipeline.served_model)
            if isinstance(parsed, ChatRequest):
                prompt_ids = await pipeline.chat_prompt(parsed, request.ByteSize())
            else:
                prompt_ids = await pipeline.raw_prompt_ids(parsed.prompt, parsed.sampling, param=parsed.param)
                check_vocabulary(prompt_ids, pipeline.vocab_size, parsed.param)
        except Exception as err:
            raise self._fail(grpc_context, "grpc_tokenize", client_error(err, request_id)) from None
        pipeline.telemetry.requests.labels("grpc_tokenize", "ok").inc()
        return pb.TokenizeResponse(token_ids=prompt_ids, max_model_len=pipeline.max_model_len)

    async def health(self, request: pb.HealthRequest | UndecodableRequest, grpc_context: Any) -> Any:
        try:
            self._tenant(grpc_context)
            decoded(request)
        except APIError as err:
            raise self._fail(grpc_context, "grpc_health", err) from None
        status, body = await self.pipeline.health(detailed=True)
        details = {key: str(value) for key, value in body.get("details", {}).items()}
        for name, pool in body.get("pools", {}).items():
            details[f"{name}.replicas"] = str(pool["replicas"])
            details[f"{name}.target_replicas"] = str(pool["target_replicas"])
            for replica in pool.get("replica_states", ()):
                details[f"{name}.replica.{replica['replica_id']}"] = replica["state"]
        if "error" in body:
            details["error"] = str(body["error"])
        return pb.HealthResponse(status=status, details=details)
