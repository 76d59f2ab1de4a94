"""A call's class as clients name it on every API, and which naming wins (the classes: ``rayturn.engine.priority``).

    body field ``priority`` (HTTP) / ``GenerateRequest.priority`` (gRPC)
      > header / gRPC metadata ``x-rayturn-priority``
      > the caller's key's default (``server.tenant_priorities``)
      > the call's kind: a continuation when it continues a turn, interactive otherwise (decided on the replica)

Names are ``continuation``, ``interactive``, ``background`` and ``batch`` (the
same as background), in any case. The body field is an extension of every
HTTP API (OpenAI chat completions and completions, Anthropic Messages,
Responses; the official SDKs send it through ``extra_body``) and also takes
an integer, because vLLM's own ``priority`` field is one (its priority
scheduler runs lower values first, 0 by default): below 0 is a continuation,
0 says nothing (as vLLM's default, it falls through to the header and the
key's default), above 0 is background. The mapping keeps vLLM's order for
every call: a negative value never runs a call later than saying nothing
would, a positive one never earlier. A blank name says nothing either.

A name this module does not know is a 400 (gRPC: INVALID_ARGUMENT) whose
``param`` is ``priority`` and whose message names the classes; the header is
checked even when the body wins over it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rayturn.engine.priority import PRIORITY_NAMES, Priority

from .errors import invalid_request
from .json_fields import Fields, is_integer, type_error

PRIORITY_HEADER = "x-rayturn-priority"
PRIORITY_FIELD = "priority"
INTEGER_RULE = "an integer as vLLM's (< 0: continuation, 0: unset, > 0: background)"
# HTTP headers, or gRPC metadata (binary ``-bin`` entries arrive as bytes).
Headers = Mapping[str, str] | Iterable[tuple[str, str | bytes]]


def priority_name(value: str, source: str) -> str | None:
    """The class ``value`` names, as its canonical name; None when blank; a 400 naming ``source`` otherwise."""
    if not value.strip():
        return None
    try:
        return Priority.parse(value).value
    except ValueError:
        message = f"Invalid {source}: expected one of {', '.join(PRIORITY_NAMES)}, got {value.strip()[:40]!r}."
        raise invalid_request(message, param=PRIORITY_FIELD) from None


def vllm_priority(value: int) -> str | None:
    """The class of vLLM's integer ``priority`` (lower runs first, 0 is its default)."""
    if value < 0:
        return Priority.CONTINUATION.value
    if value > 0:
        return Priority.BACKGROUND.value
    return None


def body_priority(fields: Fields) -> str | None:
    """The body's ``priority``: a class name or vLLM's integer; None when absent, blank or 0."""
    value = fields.raw(PRIORITY_FIELD)
    if isinstance(value, str):
        return priority_name(value, f"'{PRIORITY_FIELD}'")
    if value is None or is_integer(value):
        number = fields.integer(PRIORITY_FIELD)  # an int64 at most, as every integer field
        return None if number is None else vllm_priority(number)
    raise type_error(PRIORITY_FIELD, f"one of {', '.join(PRIORITY_NAMES)}, or {INTEGER_RULE}", value)


def header_priority(headers: Headers) -> str | None:
    """The class ``x-rayturn-priority`` names in HTTP headers or gRPC metadata (names only); None when absent."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    for name, value in items:
        if name.lower() == PRIORITY_HEADER and isinstance(value, str):
            return priority_name(value, f"header {PRIORITY_HEADER!r}")
    return None


def requested_priority(body: str | None, headers: Headers) -> str | None:
    """What the call asks for: its body's (or request field's) class, else its header's; None when neither says."""
    said = header_priority(headers)
    return body if body is not None else said


def grpc_priority(field: str, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """A ``GenerateRequest``'s class: its ``priority`` field, else the ``x-rayturn-priority`` metadata key."""
    return requested_priority(priority_name(field, f"'{PRIORITY_FIELD}'"), metadata)
