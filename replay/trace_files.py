"""Trace files of each recorded format, read into conversations (``traces.py``).

``load_traces`` reads files (or every trace file in a folder) and detects the
format of each file from its content:

* ``weka`` -- one JSON object per Claude Code conversation (``requests``, with
  sub-agents nested as ``type: "subagent"`` entries). A call opens a user turn
  when its new input carries user text (``"text" in input_types``), including
  a tool result sent together with a message (the user interrupted a tool or
  answered a permission prompt); a call whose new input is only tool results
  continues the turn. A sub-agent's calls never open a turn: they run inside
  the parent's turn, from ``t - duration_ms`` (its entry's ``t`` is when it
  finished; one launched asynchronously records no duration and starts at
  ``t``) on the parent's clock. ``api_time`` is the call's duration where
  recorded; streamed calls without it count as taking no time, so the gap after
  them is an upper bound.
* ``mooncake`` -- JSON lines of chat requests with global block hashes and no
  session ids. Requests are chained into conversations: a request continues the
  earlier request whose full prompt blocks (two or more; the first block is the
  system prompt every request shares) it repeats as a prefix, each request
  continuing at most one. Every request is a user turn; durations are unknown.
* ``tracelab`` -- JSON lines, one LLM round per line (``session_id``,
  ``round_index``, ``prefix_tokens``, ``newly_append_tokens``,
  ``output_tokens``, ``timing_events``, ``tools``). A round opens a user turn
  when its timing events hold a ``user_message``; otherwise it continues after
  the tool results it lists. It arrives at its latest input event and ends at
  its last model-output event; the tool latency before it is the longest
  latency of the previous round's tools (runner-reported, else wall clock).

Times are seconds from the conversation's first call. A malformed file raises
ValueError naming the file and the field.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

from rayturn.messages import CallKind

from .traces import Call, Conversation

TRACE_SUFFIXES = (".json", ".jsonl", ".jsonl.gz")

MOONCAKE_BLOCK_SIZE = 512

# A Mooncake request must repeat at least this many full blocks of an earlier
# one to continue it: every request shares the first (system prompt) block.
MOONCAKE_MIN_LINK_BLOCKS = 2

WEKA_FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}

TRACELAB_INPUT_EVENTS = frozenset({"user_message", "tool_result"})
TRACELAB_OUTPUT_EVENTS = frozenset({"reasoning", "text", "tool_call", "usage_report"})


def load_traces(paths: Iterable[str | Path]) -> list[Conversation]:
    """Conversations from trace files; a folder stands for its trace files, in name order."""
    conversations: list[Conversation] = []
    for path in _expand(paths):
        conversations.extend(read_trace(path))
    return conversations


def read_trace(path: str | Path) -> list[Conversation]:
    """The conversations of one trace file, its format detected from its content."""
    path = Path(path)
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        rows = list(_json_lines(path))
        if not rows:
            raise ValueError(f"{path}: empty trace file")
        first = rows[0][1]
        if "timing_events" in first or "round_index" in first:
            return _read_tracelab(path, rows)
        if "timestamp" in first and "hash_ids" in first:
            return _read_mooncake(path, rows)
        raise ValueError(f"{path}: unknown trace format (line {rows[0][0]} has keys {sorted(first)})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON: {error}") from None
    if isinstance(data, dict) and "requests" in data:
        return [_read_weka(path, data)]
    raise ValueError(f"{path}: unknown trace format (expected a JSON object with 'requests')")


def _expand(paths: Iterable[str | Path]) -> Iterator[Path]:
    for item in paths:
        path = Path(item)
        if path.is_dir():
            yield from sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
        elif path.is_file():
            yield path
        else:
            raise ValueError(f"{path}: no such trace file or folder")


def _json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {number}: invalid JSON: {error}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {number}: expected a JSON object")
            yield number, row


def _field(where: str, key: str) -> str:
    """The path of ``key`` inside ``where``: ``requests[3].t``, ``line 7: timestamp``."""
    if not where:
        return key
    if where.startswith("line ") and where[5:].isdigit():
        return f"{where}: {key}"
    return f"{where}.{key}"


class _Fields:
    """Typed field access that names the file and field in every error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> ValueError:
        return ValueError(f"{self.path}: {where}: {problem}")

    def get(self, row: Mapping[str, Any], key: str, where: str) -> Any:
        if key not in row:
            raise self.fail(_field(where, key), "missing key")
        return row[key]

    def number(self, row: Mapping[str, Any], key: str, where: str) -> float:
        value = self.get(row, key, where)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.fail(_field(where, key), f"expected a number, got {value!r}")
        return float(value)

    def optional_number(self, row: Mapping[str, Any], key: str, where: str) -> float | None:
        return None if row.get(key) is None else self.number(row, key, where)

    def count(self, row: Mapping[str, Any], key: str, where: str) -> int:
        value = self.get(row, key, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(_field(where, key), f"expected a non-negative integer, got {value!r}")
        return value

    def text(self, row: Mapping[str, Any], key: str, where: str) -> str:
        value = self.get(row, key, where)
        if not isinstance(value, str):
            raise self.fail(_field(where, key), f"expected a string, got {value!r}")
        return value

    def optional_text(self, row: Mapping[str, Any], key: str, where: str) -> str | None:
        return None if row.get(key) is None else self.text(row, key, where)

    def items(self, row: Mapping[str, Any], key: str, where: str, kind: type) -> list[Any]:
        value = self.get(row, key, where)
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, kind) for v in value):
            raise self.fail(_field(where, key), f"expected a list of {kind.__name__}")
        return value

    def rows(self, row: Mapping[str, Any], key: str, where: str) -> list[Mapping[str, Any]]:
        return self.items(row, key, where, dict)


def _read_weka(path: Path, data: Mapping[str, Any]) -> Conversation:
    fields = _Fields(path)
    conversation_id = fields.text(data, "id", "")
    block_size = data.get("block_size")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
        raise fields.fail("block_size", f"expected an integer, got {block_size!r}")
    calls: list[Call] = []
    _weka_calls(fields, fields.rows(data, "requests", ""), "requests", 0.0, None, calls)
    if not calls:
        raise fields.fail("requests", "no calls")
    calls.sort(key=lambda call: call.arrival_s)
    return Conversation(conversation_id, "weka", tuple(calls), block_size=block_size)


def _weka_calls(
    fields: _Fields,
    requests: Sequence[Mapping[str, Any]],
    where: str,
    offset_s: float,
    subagent_id: str | None,
    calls: list[Call],
) -> None:
    previous_t = -math.inf
    for index, request in enumerate(requests):
        at = f"{where}[{index}]"
        t = fields.number(request, "t", at)
        if t < previous_t:
            raise fields.fail(_field(at, "t"), f"time goes backwards ({t} after {previous_t})")
        previous_t = t
        if fields.text(request, "type", at) == "subagent":
            agent_id = fields.text(request, "agent_id", at)
            duration_ms = fields.optional_number(request, "duration_ms", at) or 0.0  # None: launched async
            start_s = offset_s + t - duration_ms / 1000.0
            _weka_calls(fields, fields.rows(request, "requests", at), _field(at, "requests"), start_s, agent_id, calls)
            continue
        input_types = fields.items(request, "input_types", at, str)
        kind: CallKind = "user" if "text" in input_types else "tool_continuation"
        think_time_s = fields.optional_number(request, "think_time", at)
        calls.append(
            Call(
                arrival_s=offset_s + t,
                input_tokens=fields.count(request, "in", at),
                output_tokens=fields.count(request, "out", at),
                kind=kind,
                duration_s=fields.optional_number(request, "api_time", at),
                finish_reason=WEKA_FINISH_REASONS.get(fields.optional_text(request, "stop", at) or ""),
                hash_ids=tuple(fields.items(request, "hash_ids", at, int)),
                tool_latency_s=think_time_s if kind == "tool_continuation" else None,
                subagent_id=subagent_id,
            )
        )


def _read_mooncake(path: Path, rows: Sequence[tuple[int, dict[str, Any]]]) -> list[Conversation]:
    fields = _Fields(path)
    chains: list[list[Call]] = []
    first_lines: list[int] = []
    # Last full prompt block of a chain's latest request -> (chain, block position).
    open_ends: dict[int, tuple[int, int]] = {}
    previous_ms = -math.inf
    for number, row in rows:
        at = f"line {number}"
        timestamp_ms = fields.number(row, "timestamp", at)
        if timestamp_ms < previous_ms:
            raise fields.fail(_field(at, "timestamp"), f"time goes backwards ({timestamp_ms} after {previous_ms})")
        previous_ms = timestamp_ms
        input_tokens = fields.count(row, "input_length", at)
        hash_ids = tuple(fields.items(row, "hash_ids", at, int))
        chain = None
        for position in range(len(hash_ids) - 1, MOONCAKE_MIN_LINK_BLOCKS - 2, -1):
            end = open_ends.get(hash_ids[position])
            if end is not None and end[1] == position and chains[end[0]][-1].input_tokens <= input_tokens:
                chain = end[0]
                del open_ends[hash_ids[position]]
                break
        call = Call(
            arrival_s=timestamp_ms / 1000.0,
            input_tokens=input_tokens,
            output_tokens=fields.count(row, "output_length", at),
            kind="user",
            hash_ids=hash_ids,
        )
        if chain is None:
            chain = len(chains)
            chains.append([])
            first_lines.append(number)
        chains[chain].append(call)
        full_blocks = min(input_tokens // MOONCAKE_BLOCK_SIZE, len(hash_ids))
        if full_blocks >= MOONCAKE_MIN_LINK_BLOCKS:
            open_ends[hash_ids[full_blocks - 1]] = (chain, full_blocks - 1)
    stem = path.name.split(".")[0]
    conversations = []
    for first_line, calls in zip(first_lines, chains):
        start_s = calls[0].arrival_s
        shifted = tuple(replace(call, arrival_s=call.arrival_s - start_s) for call in calls)
        conversations.append(Conversation(f"{stem}:{first_line}", "mooncake", shifted, block_size=MOONCAKE_BLOCK_SIZE))
    return conversations


@dataclass(frozen=True, slots=True)
class _Round:
    round_index: int
    line: int
    arrival_epoch_s: float
    end_epoch_s: float | None
    kind: CallKind
    finish_reason: str | None
    input_tokens: int
    prefix_tokens: int
    output_tokens: int
    longest_tool_s: float | None


def _read_tracelab(path: Path, rows: Sequence[tuple[int, dict[str, Any]]]) -> list[Conversation]:
    fields = _Fields(path)
    sessions: dict[str, list[_Round]] = {}
    for number, row in rows:
        at = f"line {number}"
        session_id = fields.text(row, "session_id", at)
        sessions.setdefault(session_id, []).append(_tracelab_round(fields, row, number))
    conversations = []
    for session_id, rounds in sessions.items():
        rounds.sort(key=lambda r: (r.round_index, r.line))
        for before, after in pairwise(rounds):
            if after.arrival_epoch_s < before.arrival_epoch_s:
                raise fields.fail(
                    _field(f"line {after.line}", "timing_events"),
                    f"session {session_id!r} round {after.round_index} arrives before round {before.round_index}",
                )
        start = rounds[0].arrival_epoch_s
        calls = []
        for index, r in enumerate(rounds):
            tool_latency_s = rounds[index - 1].longest_tool_s if index and r.kind == "tool_continuation" else None
            calls.append(
                Call(
                    arrival_s=r.arrival_epoch_s - start,
                    input_tokens=r.input_tokens,
                    output_tokens=r.output_tokens,
                    kind=r.kind,
                    duration_s=None if r.end_epoch_s is None else r.end_epoch_s - r.arrival_epoch_s,
                    finish_reason=r.finish_reason,
                    prefix_tokens=r.prefix_tokens,
                    tool_latency_s=tool_latency_s,
                )
            )
        conversations.append(Conversation(session_id, "tracelab", tuple(calls), start_epoch_s=start))
    return conversations


def _tracelab_round(fields: _Fields, row: Mapping[str, Any], line: int) -> _Round:
    at = f"line {line}"
    prefix_tokens = fields.count(row, "prefix_tokens", at)
    appended_tokens = fields.count(row, "newly_append_tokens", at)
    inputs: list[float] = []
    outputs: list[float] = []
    user_message = tool_call = False
    for index, event in enumerate(fields.rows(row, "timing_events", at)):
        event_at = _field(at, f"timing_events[{index}]")
        event_type = fields.text(event, "event_type", event_at)
        if event.get("timestamp") is None:
            continue
        epoch_s = _epoch_s(fields, event["timestamp"], _field(event_at, "timestamp"))
        user_message = user_message or event_type == "user_message"
        tool_call = tool_call or event_type == "tool_call"
        if event_type in TRACELAB_INPUT_EVENTS:
            inputs.append(epoch_s)
        elif event_type in TRACELAB_OUTPUT_EVENTS:
            outputs.append(epoch_s)
    if not inputs and not outputs:
        raise fields.fail(_field(at, "timing_events"), "no event with a timestamp")
    arrival = max(inputs) if inputs else min(outputs)
    end = max(outputs) if outputs and max(outputs) >= arrival else None
    tool_latencies_s = []
    for index, tool in enumerate(fields.rows(row, "tools", at) if "tools" in row else []):
        tool_at = _field(at, f"tools[{index}]")
        latency_ms = fields.optional_number(tool, "tool_internal_latency_ms", tool_at)
        if latency_ms is None:
            latency_ms = fields.optional_number(tool, "tool_wall_latency_ms", tool_at)
        if latency_ms is not None:
            tool_latencies_s.append(latency_ms / 1000.0)
    return _Round(
        round_index=fields.count(row, "round_index", at),
        line=line,
        arrival_epoch_s=arrival,
        end_epoch_s=end,
        kind="user" if user_message else "tool_continuation",
        finish_reason=("tool_calls" if tool_call else "stop") if outputs else None,
        input_tokens=prefix_tokens + appended_tokens,
        prefix_tokens=prefix_tokens,
        output_tokens=fields.count(row, "output_tokens", at),
        longest_tool_s=max(tool_latencies_s) if tool_latencies_s else None,
    )


def _epoch_s(fields: _Fields, value: Any, where: str) -> float:
    """Epoch seconds from an ISO 8601 timestamp (UTC when it names no zone) or a number of seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise fields.fail(where, f"not an ISO 8601 timestamp: {value!r}") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return moment.timestamp()
    raise fields.fail(where, f"expected a timestamp, got {value!r}")
