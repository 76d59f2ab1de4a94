"""Errors in the OpenAI shape, and failures behind the ingress as a client sees them.

``APIError`` is an HTTP status plus OpenAI's ``{"error": {...}}`` body; the
constructors below name each kind. A replica that dies mid-call reaches the
ingress as one of Ray's errors, whose text names the actor's id, class,
process id and node. That belongs in the operator's log, not in an answer:
the client gets a 503 that says to retry (``Retry-After`` on HTTP,
UNAVAILABLE on gRPC), and the log line carries the details under the call's
request id. A replica refusing the call (its engine's ``ValueError``) stays a
400 with the engine's reason; a full decode queue, or a decode replica
refusing a new turn to keep room for tool continuations
(``ReplicaAtCapacity``), a 429 with ``Retry-After`` (gRPC:
RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from rayturn.messages import ReplicaAtCapacity

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's ``{"error": {...}}`` body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, *, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(message: str, *, param: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


def authentication_failed() -> APIError:
    message = "Invalid or missing API key; send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def route_not_found(method: str, path: str, status_code: int = 404) -> APIError:
    """A request no route answers: OpenAI's words for it (``Invalid URL (POST /v1/foo)``)."""
    if status_code == 405:
        return APIError(405, f"Method not allowed ({method} {path}).", code="method_not_allowed")
    if status_code != 404:
        return APIError(status_code, f"Request failed ({method} {path}).", code=None)
    return APIError(404, f"Invalid URL ({method} {path}).")


def model_not_found(model: str, served_model: str) -> APIError:
    message = f"The model '{model}' does not exist; this server serves '{served_model}'."
    return APIError(404, message, type="not_found_error", param="model", code="model_not_found")


def context_length_exceeded(prompt_tokens: int, max_model_len: int, *, param: str) -> APIError:
    """The prompt alone fills the context. OpenAI answers this with a 400, not a 413."""
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, your '{param}' resulted in "
        f"{prompt_tokens} tokens. Please reduce the length of the '{param}'."
    )
    return APIError(400, message, param=param, code="context_length_exceeded")


def rate_limited(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded")


def server_error(message: str, *, status_code: int = 500) -> APIError:
    return APIError(status_code, message, type="server_error")


def replica_unavailable() -> APIError:
    return APIError(
        503,
        "A replica failed while serving this request; it was not completed. Retry it.",
        type="server_error",
        code="replica_unavailable",
    )


def refused_reason(err: BaseException) -> str | None:
    """The engine's reason when a replica refused the request (its ``ValueError``), else None."""
    cause = err.cause if isinstance(err, RayTaskError) else err
    if isinstance(cause, ValueError) and not isinstance(cause, RayError):
        lines = str(cause).strip().splitlines()
        return lines[-1] if lines else "the request was refused"
    return None


def outcome(status_code: int) -> str:
    """The ``outcome`` label of ``rayturn_requests`` for a call answered with ``status_code``."""
    labels = {401: "unauthorized", 429: "overloaded", 503: "failed"}
    return labels.get(status_code, "error" if status_code >= 500 else "invalid")


def client_error(err: BaseException, request_id: str) -> APIError:
    """What the client is told about ``err``, raised while its call was served; the details go to the log."""
    if isinstance(err, APIError):
        return err
    cause = err.cause if isinstance(err, RayTaskError) else err
    if isinstance(err, BackPressureError) or isinstance(cause, ReplicaAtCapacity):
        return rate_limited("rayturn is at capacity; retry shortly")
    reason = refused_reason(err)
    if reason is not None:
        return invalid_request(reason, param=None)
    if isinstance(err, RecursionError):  # only a request's own nesting runs the ingress out of stack
        message = "The request nests too deeply to process (arrays, objects or schemas within each other)."
        return invalid_request(message, param=None, code="json_too_deep")
    if isinstance(err, RayError | DeploymentUnavailableError):
        logger.warning("request %s: a replica failed: %s: %s", request_id, type(err).__name__, err)
        return replica_unavailable()
    logger.error("request %s failed", request_id, exc_info=err)
    return server_error(f"The server failed to complete this request (request id {request_id}).")
