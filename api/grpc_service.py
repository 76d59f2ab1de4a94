"""rayturn's gRPC API (``protos/rayturn.proto``) on the shared call pipeline.

Serve's gRPC proxy calls the ingress deployment's ``Generate``, ``Prewarm``
and ``Health``, which hand over to ``GrpcService``. Every method checks the
caller's key first (``authorization: Bearer <key>`` or ``x-api-key``
metadata) when keys are set: UNAUTHENTICATED otherwise. Errors set the
status on the context and raise, which Serve turns into that status:
INVALID_ARGUMENT for bad input, RESOURCE_EXHAUSTED for a full queue,
UNAVAILABLE for a failed replica (retry), never Ray's own error text.
Generated classes stay here: requests become token ids and engine
``SamplingParams`` before anything else sees them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from rayturn.engine.sampling_params import SamplingParams
from rayturn.messages import Delta
from rayturn.protos import SERVICER_FUNCTION
from rayturn.protos import rayturn_pb2 as pb

from .errors import APIError, authentication_failed, client_error, invalid_request, outcome
from .pipeline import CallPipeline, CallResult, chain_steps, new_request_id
from .session import (
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

    async def generate(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        pipeline = self.pipeline
        request_id = new_request_id()
        try:
            tenant = self._tenant(grpc_context)
            metadata = _metadata(grpc_context)
            try:
                prompt_ids, params = await self._inputs(request)
                hints = lifecycle_hints(metadata)
                session_id = optional_session_id(request.session_id, "session_id") or session_id_from_grpc_metadata(
                    metadata
                )
            except ValueError as err:
                raise invalid_request(str(err), param=None) from err
            call = await pipeline.serve_request(request_id, prompt_ids, params, tenant, session_id, hints)
            result, steps, first = await pipeline.start(call)
        except Exception as err:  # anything else too: never Serve's INTERNAL with a traceback in it
            raise self._fail(grpc_context, "grpc", client_error(err, request_id)) from None
        try:
            async for deltas in chain_steps(first, steps):
                for delta in deltas:
                    yield self._response(delta, result)
        except Exception as err:
            raise self._fail(grpc_context, "grpc", client_error(err, result.request_id)) from None
        pipeline.telemetry.requests.labels("grpc", "ok").inc()

    @staticmethod
    def _response(delta: Delta, result: CallResult) -> Any:
        response = pb.GenerateResponse(
            index=delta.index,
            token_ids=delta.token_ids,
            text=delta.text,
            finish_reason=delta.finish_reason or "",
        )
        if delta.logprobs:
            response.logprobs.token_logprobs.extend(lp.logprob for lp in delta.logprobs)
        if delta.finish_reason is not None:
            response.usage.prompt_tokens = result.prompt_tokens
            response.usage.completion_tokens = result.completion_tokens
            response.usage.cached_tokens = result.cached_tokens
        return response

    async def _inputs(self, request: Any) -> tuple[list[int], SamplingParams]:
        pipeline = self.pipeline
        if request.model and request.model != pipeline.served_model:
            raise ValueError(
                f"model {request.model!r} is not served here; this cluster serves {pipeline.served_model!r}"
            )
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise ValueError("text is empty")
            prompt_ids = await pipeline.text_prompt(request.text, param="text")
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
            prompt_ids = await pipeline.chat_prompt(messages, None, request.ByteSize())
        else:
            raise ValueError("input is missing: set one of text, token_ids, messages")
        max_model_len = pipeline.max_model_len
        if len(prompt_ids) >= max_model_len:  # before walking the ids: a million of them are refused at once
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the model's context is {max_model_len}")
        pipeline.check_prompt_ids(prompt_ids)
        options = request.sampling
        room = max_model_len - len(prompt_ids)
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

    async def prewarm(self, request: Any, grpc_context: Any) -> Any:
        request_id = new_request_id()
        try:
            tenant = self._tenant(grpc_context)
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

    async def health(self, request: Any, grpc_context: Any) -> Any:
        try:
            self._tenant(grpc_context)
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
