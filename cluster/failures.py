"""Failures behind the ingress, as a client sees them: clean, in the API's shape, retryable when they are.

A replica that dies mid-call reaches the ingress as one of Ray's errors,
whose text names the actor's id, class, process id and node. That belongs in
the operator's log, not in an answer: the client gets a 503 that says to
retry (``Retry-After`` on HTTP, UNAVAILABLE on gRPC), and the log line
carries the details under the call's request id. A replica refusing the call
(its engine's ``ValueError``) stays a 400 with the engine's reason, and a
full decode queue a 429.
"""

from __future__ import annotations

import logging

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from . import openai_api as oai

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


def replica_unavailable() -> oai.APIError:
    return oai.APIError(
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


def client_error(err: BaseException, request_id: str) -> oai.APIError:
    """What the client is told about ``err``, raised while its call was served; the details go to the log."""
    if isinstance(err, oai.APIError):
        return err
    if isinstance(err, BackPressureError):
        return oai.rate_limited("rayturn is at capacity; retry shortly")
    reason = refused_reason(err)
    if reason is not None:
        return oai.invalid_request(reason, param=None)
    if isinstance(err, RayError | DeploymentUnavailableError):
        logger.warning("request %s: a replica failed: %s: %s", request_id, type(err).__name__, err)
        return replica_unavailable()
    logger.error("request %s failed", request_id, exc_info=err)
    return oai.server_error(f"The server failed to complete this request (request id {request_id}).")
