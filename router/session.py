"""Which session a call belongs to, and whether it continues a tool loop.

Routing keeps a session's KV where its calls land, so the ingress needs a
stable session id for every call. Clients name it in different places: our own
``x-session-id`` header, the native session header of the coding agent that
sent the call, or the OpenAI ``user`` field of the body. Each id is an opaque
string; the router only hashes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

CallKind = Literal["user", "tool_continuation"]

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

# gRPC metadata keys are lower case; `session_id` is what rayturn's own clients send.
GRPC_SESSION_KEYS: tuple[str, ...] = ("session_id", SESSION_HEADER)


def session_id_from_headers(headers: Mapping[str, str], body: Mapping[str, Any] | None = None) -> str | None:
    """The session id of an HTTP call, or None when the call names none.

    Header names match case-insensitively; empty values are skipped. A value
    longer than ``MAX_SESSION_ID_CHARS`` raises ValueError naming its source.
    """
    by_name = {name.lower(): value for name, value in headers.items()}
    for name in SESSION_HEADERS:
        session_id = _checked(by_name.get(name), name)
        if session_id is not None:
            return session_id
    if body is not None:
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise ValueError(f"body field 'user' must be a string, got {type(user).__name__}")
        return _checked(user, "user")
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


def _checked(value: str | None, source: str) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_SESSION_ID_CHARS:
        raise ValueError(f"session id in {source!r} is {len(value)} characters, the limit is {MAX_SESSION_ID_CHARS}")
    return value
