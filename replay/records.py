"""One replayed call as measured, and the decode replica's view of its session (the ``x-rayturn-session`` header)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from rayturn.api.session import SESSION_STATE_HEADER
from rayturn.decode.lifecycle.session import Phase
from rayturn.replay.plans import CallKind

SESSION_STATES = tuple(phase.value for phase in Phase)


@dataclass(frozen=True, slots=True)
class SessionView:
    """The decode replica's view of a call's session when it arrived (the ``x-rayturn-session`` header)."""

    call: Literal["user", "tool"]
    state: str
    idle_s: float | None
    off_device_s: float | None
    resident_pages: int
    session_pages: int


@dataclass(frozen=True, slots=True)
class CallRecord:
    conversation_id: str
    call_index: int
    kind: CallKind
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    store_tokens: int = 0  # loaded from the KV store; part of cached_tokens
    ttft_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    session: SessionView | None = None
    error: str = ""


def parse_session_header(value: str | None) -> SessionView | None:
    """The ``x-rayturn-session`` header, or None without one; ValueError naming the bad field."""
    if value is None:
        return None
    try:
        data = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{SESSION_STATE_HEADER}: invalid JSON ({err}): {value!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{SESSION_STATE_HEADER}: expected a JSON object, got {value!r}")

    def need(key: str) -> Any:
        if key not in data:
            raise ValueError(f"{SESSION_STATE_HEADER}: missing {key!r} in {value!r}")
        return data[key]

    def seconds(key: str) -> float | None:
        seconds_value = data.get(key)
        if seconds_value is None:
            return None
        if isinstance(seconds_value, bool) or not isinstance(seconds_value, int | float) or seconds_value < 0:
            raise ValueError(f"{SESSION_STATE_HEADER}: {key}: expected seconds >= 0, got {seconds_value!r}")
        return float(seconds_value)

    def pages(key: str) -> int:
        count = need(key)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{SESSION_STATE_HEADER}: {key}: expected a page count, got {count!r}")
        return count

    call, state = need("call"), need("state")
    if call not in ("user", "tool"):
        raise ValueError(f"{SESSION_STATE_HEADER}: call: expected 'user' or 'tool', got {call!r}")
    if state not in SESSION_STATES:
        raise ValueError(f"{SESSION_STATE_HEADER}: state: expected one of {', '.join(SESSION_STATES)}, got {state!r}")
    return SessionView(
        call, state, seconds("idle_s"), seconds("off_device_s"), pages("resident_pages"), pages("session_pages")
    )


def record_dict(record: CallRecord) -> dict[str, Any]:
    """A record for the JSON file, latencies rounded."""
    data = asdict(record)
    data["ttft_s"] = round(record.ttft_s, 5)
    data["itl_s"] = [round(gap, 5) for gap in record.itl_s]
    return data
