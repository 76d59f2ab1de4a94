"""Which session a call belongs to, and whether it continues a tool loop.

Routing keeps a session's KV where its calls land, so the ingress needs a
stable session id for every call. Clients name it in different places: our own
``x-session-id`` header, the native session header of the coding agent that
sent the call, or the OpenAI ``user`` field of the body. Each id is an opaque
string; the router only hashes it.

Clients may also say where a call sits in its session's life cycle, so the
decode replica's KV-residency planner need not guess (the same keys work as
gRPC metadata):

- ``x-rayturn-call: user | tool``: this call carries a new user message (a
  turn starts after the human's think time) or a tool's result (the agent is
  back after running a tool). Without it, chat calls are classified from their
  messages and other calls from how the session's previous call ended.
- ``x-rayturn-after: tool | user``: what follows this call's answer: the agent
  runs a tool and calls again within seconds (``tool``), or the turn is over
  and the human reads and thinks (``user``). Without it, an answer that calls
  tools means ``tool`` and any other answer ``user``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rayturn.messages import CallKind, NextStep

_Hint = TypeVar("_Hint", bound=str)

MAX_SESSION_ID_CHARS = 256

SESSION_HEADER = "x-session-id"

# Session headers that coding agents send on their own, in the order they are
# trusted when a call carries several. Each one names a single conversation
# and stays the same for all of its calls.
AGENT_SESSION_HEADERS: tuple[str, ...] = (
    # Claude Code (v2.1.86 and later): one UUID per session on every call.
    "x-claude-code-session-id",
    # OpenAI Codex CLI: its conversation id (codex-api `build_conversation_headers`).
    "session_id",
    # Newer Codex releases send the same id under a hyphenated name.
    "session-id",
    # OpenCode, towards providers other than its own (next to `X-Session-Id`).
    "x-session-affinity",
    # OpenCode, towards its own hosted providers.
    "x-opencode-session",
)

SESSION_HEADERS: tuple[str, ...] = (SESSION_HEADER, *AGENT_SESSION_HEADERS)

CALL_HEADER = "x-rayturn-call"
AFTER_HEADER = "x-rayturn-after"
# The response header with the session's KV state when the call arrived (JSON; calls that name a session).
SESSION_STATE_HEADER = "x-rayturn-session"
_CALL_HINTS: dict[str, CallKind] = {"user": "user", "tool": "tool_continuation"}
_AFTER_HINTS: dict[str, NextStep] = {"tool": "tool", "user": "user"}

# gRPC metadata keys are lower case; `session_id` is what rayturn's own clients send.
GRPC_SESSION_KEYS: tuple[str, ...] = ("session_id", SESSION_HEADER)


def session_id_from_headers(headers: Mapping[str, str], body: Mapping[str, Any] | None = None) -> str | None:
    """The session id of an HTTP call, or None when the call names none.

    Header names match case-insensitively; empty values are skipped. A value
    longer than ``MAX_SESSION_ID_CHARS`` raises ValueError naming its source.
    """
    sent = header_session(headers)
    if sent is not None:
        return _checked(*sent)
    if body is not None:
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise ValueError(f"body field 'user' must be a string, got {type(user).__name__}")
        return _checked(user, "user")
    return None


def header_session(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """The first session header (in ``SESSION_HEADERS`` order) with a non-blank value: (its value as sent, its
    name), so an error about the value names the header; None when the call sends none. Names match
    case-insensitively."""
    by_name = {name.lower(): value for name, value in headers.items()}
    for name in SESSION_HEADERS:
        value = by_name.get(name)
        if value is not None and value.strip():
            return value, name
    return None


def session_id_from_grpc_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The session id of a gRPC call from its invocation metadata, or None."""
    by_key: dict[str, str] = {}
    for key, value in metadata:
        # Binary (`-bin`) entries arrive as bytes and cannot carry a session id.
        if isinstance(value, str):
            by_key.setdefault(key.lower(), value)
    for key in GRPC_SESSION_KEYS:
        session_id = _checked(by_key.get(key), key)
        if session_id is not None:
            return session_id
    return None


@dataclass(frozen=True, slots=True)
class LifecycleHints:
    """What a client said about a call's place in its session (None: not said)."""

    call: CallKind | None = None
    after: NextStep | None = None


def lifecycle_hints(headers: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> LifecycleHints:
    """The ``x-rayturn-call`` / ``x-rayturn-after`` hints of HTTP headers or gRPC metadata.

    Names match case-insensitively; an unknown value raises ValueError naming the header.
    """
    items = headers.items() if isinstance(headers, Mapping) else headers
    by_name = {name.lower(): value for name, value in items if isinstance(value, str)}
    return LifecycleHints(
        call=_hint(by_name.get(CALL_HEADER), CALL_HEADER, _CALL_HINTS),
        after=_hint(by_name.get(AFTER_HEADER), AFTER_HEADER, _AFTER_HINTS),
    )


def _hint(value: str | None, name: str, known: Mapping[str, _Hint]) -> _Hint | None:
    if value is None or not value.strip():
        return None
    hint = known.get(value.strip().lower())
    if hint is None:
        raise ValueError(f"header {name!r} must be one of {', '.join(known)}, got {value.strip()[:40]!r}")
    return hint


def classify_call(messages: Sequence[Mapping[str, Any]]) -> CallKind:
    """``tool_continuation`` when the last message returns a tool result, else ``user``.

    A tool continuation comes back within seconds, while a user message may
    follow minutes of thinking; the KV-residency planner treats them apart.
    """
    if not messages:
        return "user"
    last = messages[-1]
    role = last.get("role")
    # `function` is the role of a tool result in OpenAI's older function-calling API.
    if role in ("tool", "function"):
        return "tool_continuation"
    content = last.get("content")
    # Anthropic's Messages API returns tool results as parts of a user message.
    if (
        role == "user"
        and isinstance(content, list)
        and any(isinstance(part, Mapping) and part.get("type") == "tool_result" for part in content)
    ):
        return "tool_continuation"
    return "user"


def optional_session_id(value: str | None, source: str) -> str | None:
    """A session id a call may name: stripped, None when empty; ValueError naming ``source`` when too long."""
    return _checked(value, source)


def required_session_id(value: str | None, source: str) -> str:
    """A session id that must be there: stripped, non-empty, at most ``MAX_SESSION_ID_CHARS``; else ValueError."""
    session_id = _checked(value, source)
    if session_id is None:
        raise ValueError(f"a session id is required in {source!r}")
    return session_id


def _checked(value: str | None, source: str) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_SESSION_ID_CHARS:
        raise ValueError(f"session id in {source!r} is {len(value)} characters, the limit is {MAX_SESSION_ID_CHARS}")
    return value
