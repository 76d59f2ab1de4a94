"""Each HTTP call's request id, tied to the ``x-request-id`` header that Serve's proxy answers with.

Serve's HTTP proxy gives every request an ``x-request-id``: the client's own (``X-Request-Id``, as a proxy
in front or a tracing client sends it), else one it mints, and every answer carries it back in the same
header, where the ``openai`` SDK reads it (``response._request_id``, ``APIStatusError.request_id``). The
call's own id starts with that value, then a dash and a minted suffix, so two calls sent with the same value
stay apart: it is the id in rayturn's log lines, in a 5xx answer's message and in Anthropic's
``request-id`` header, so what a client reports is what an operator finds. A value longer than
``MAX_CLIENT_ID`` characters, or with a character outside printable ASCII (a space included), is a 400 in
the route's API shape naming the header: the value goes into log lines, so it is checked before it reaches
one. A request that did not pass Serve's proxy and names none gets a minted id.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError, invalid_request
from .pipeline import new_request_id

REQUEST_ID_HEADER = "x-request-id"
MAX_CLIENT_ID = 128
_CLIENT_ID = re.compile(r"[!-~]+")  # printable ASCII, no space
# The scope's ``state`` key holding the call's id (``request.state.request_id``).
_STATE_KEY = "request_id"


def client_request_id(value: str | None) -> str | None:
    """The client's ``X-Request-Id``, checked; None when it sent none. A bad one is a 400 naming the header."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_CLIENT_ID:
        message = f"The header 'x-request-id' must be 1-{MAX_CLIENT_ID} characters long; it has {len(value)}."
        raise invalid_request(message, param="x-request-id", code="invalid_request_id")
    if _CLIENT_ID.fullmatch(value) is None:
        bad = "".join(dict.fromkeys(c for c in value if _CLIENT_ID.fullmatch(c) is None))  # in order, once each
        message = f"The header 'x-request-id' may hold only printable ASCII characters, no spaces; it holds {bad!r}."
        raise invalid_request(message, param="x-request-id", code="invalid_request_id")
    return value


def call_request_id(client_id: str | None) -> str:
    """The call's own id: the client's value and a minted suffix, or a minted id when it sent none."""
    return new_request_id() if client_id is None else f"{client_id}-{new_request_id()[:12]}"


def request_id_of(request: Request) -> str:
    """The id ``RequestIdMiddleware`` gave this call (a fresh one for a request that did not pass it)."""
    call_id = request.scope.get("state", {}).get(_STATE_KEY)
    return call_id if isinstance(call_id, str) else new_request_id()


class RequestIdMiddleware:
    """Gives every HTTP call its id (``request_id_of``) from its ``x-request-id``, checked.

    ``failure(path, err)`` answers a bad header in the error shape of the API ``path`` belongs to.
    """

    def __init__(self, app: ASGIApp, failure: Callable[[str, APIError], Response]) -> None:
        self.app = app
        self.failure = failure

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            client_id = client_request_id(Headers(scope=scope).get(REQUEST_ID_HEADER))
        except APIError as err:
            await self.failure(scope["path"], err)(scope, receive, send)
            return
        scope.setdefault("state", {})[_STATE_KEY] = call_request_id(client_id)
        await self.app(scope, receive, send)
