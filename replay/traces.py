"""Recorded agent traces, normalized to conversations of calls, turns and gaps.

Every trace format (``trace_files.py`` reads them) comes down to the same
model: a ``Conversation`` is one agent session's ``Call``s in arrival order;
its ``Turn``s open at each user message and hold every call it set off,
sub-agents included; its ``Gap``s are the idle between them, a tool running
inside a turn or a human thinking between turns. Times are seconds from the
conversation's first call.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

from rayturn.messages import CallKind

TraceFormat = Literal["weka", "mooncake", "tracelab"]
GapKind = Literal["tool", "think"]


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM call of a conversation.

    ``finish_reason`` uses the OpenAI names (``stop``, ``tool_calls``,
    ``length``); None when the response was cut off or the trace does not say.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    kind: CallKind
    duration_s: float | None = None
    finish_reason: str | None = None
    hash_ids: tuple[int, ...] = ()
    prefix_tokens: int | None = None
    tool_latency_s: float | None = None
    subagent_id: str | None = None

    @property
    def end_s(self) -> float:
        """When the response ended; the arrival when the duration is unknown."""
        return self.arrival_s + (self.duration_s or 0.0)

    @property
    def starts_turn(self) -> bool:
        return self.kind == "user" and self.subagent_id is None


@dataclass(frozen=True, slots=True)
class Turn:
    """A user message and every call it set off, sub-agents included."""

    index: int
    calls: tuple[Call, ...]

    @property
    def start_s(self) -> float:
        return self.calls[0].arrival_s

    @property
    def end_s(self) -> float:
        return max(call.end_s for call in self.calls)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class Gap:
    """Idle time of a session: a tool running (``tool``) or a human thinking (``think``)."""

    kind: GapKind
    start_s: float
    duration_s: float
    turn_index: int

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class Conversation:
    """One agent session: its calls in arrival order."""

    conversation_id: str
    trace_format: TraceFormat
    calls: tuple[Call, ...]
    block_size: int | None = None
    start_epoch_s: float | None = None

    def __post_init__(self) -> None:
        if not self.calls:
            raise ValueError(f"conversation {self.conversation_id!r} has no calls")
        if any(b.arrival_s < a.arrival_s for a, b in pairwise(self.calls)):
            raise ValueError(f"conversation {self.conversation_id!r}: calls are not in arrival order")

    def turns(self) -> tuple[Turn, ...]:
        """Calls split at each call that opens a user turn; the first turn opens with the first call."""
        groups: list[list[Call]] = []
        for call in self.calls:
            if not groups or call.starts_turn:
                groups.append([])
            groups[-1].append(call)
        return tuple(Turn(index, tuple(calls)) for index, calls in enumerate(groups))

    def think_gaps(self) -> tuple[Gap, ...]:
        """From the end of each turn to the next user message: the idle a predictor must guess."""
        turns = self.turns()
        return tuple(
            Gap("think", done.end_s, max(0.0, nxt.start_s - done.end_s), done.index) for done, nxt in pairwise(turns)
        )

    def tool_gaps(self) -> tuple[Gap, ...]:
        """From a response to the same agent's next call inside one turn: a tool running."""
        gaps: list[Gap] = []
        for turn in self.turns():
            last_by_agent: dict[str | None, Call] = {}
            for call in turn.calls:
                previous = last_by_agent.get(call.subagent_id)
                if previous is not None and call.kind == "tool_continuation":
                    duration_s = max(0.0, call.arrival_s - previous.end_s)
                    gaps.append(Gap("tool", previous.end_s, duration_s, turn.index))
                last_by_agent[call.subagent_id] = call
        return tuple(gaps)
