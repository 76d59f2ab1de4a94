"""The send plan of a recorded conversation: its agents' calls, each with its tokens, headers and scaled gap.

Gaps. An agent's next call goes out once its previous response has finished,
after the scaled gap the trace shows between them: the call's arrival minus
the previous call's end (``Call.end_s``), floored at 0. A main-agent call also
waits for every sub-agent that, in the trace, finished before it arrived, and
its gap then counts from the latest of those ends. A sub-agent starts after
the parent call it followed in the trace has finished, plus the scaled gap
between that call's end and the sub-agent's first arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

from rayturn.replay.scaling import Scale, scaled_prefix_tokens
from rayturn.replay.synthesis import TokenSynthesizer, prompts
from rayturn.replay.traces import Conversation
from rayturn.replay.workload import TracedConversation

CallKind = Literal["first", "within", "cross"]


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """One call as the replayer sends it."""

    conversation_id: str
    index: int  # position in the conversation, all agents, arrival order
    session_id: str
    kind: CallKind
    call_header: Literal["user", "tool"]
    after_header: Literal["user", "tool"]
    token_ids: tuple[int, ...]
    max_tokens: int
    gap_s: float  # scaled wait once what the call waits for has finished
    waits_for_subagents: tuple[int, ...] = ()  # main agent only: sub-agents to finish first
    trace_arrival_s: float = 0.0
    trace_end_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AgentPlan:
    """One agent's calls, replayed closed loop; a sub-agent starts after ``parent_call`` (a main-agent position)."""

    session_id: str
    calls: tuple[PlannedCall, ...]
    parent_call: int | None = None


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    conversation_id: str
    prefix_tokens: int  # scaled length of the shared prefix
    main: AgentPlan
    subagents: tuple[AgentPlan, ...] = ()

    @property
    def agents(self) -> tuple[AgentPlan, ...]:
        return (self.main, *self.subagents)

    @property
    def num_calls(self) -> int:
        return sum(len(agent.calls) for agent in self.agents)


def call_kinds(conversation: Conversation) -> list[CallKind]:
    """``first`` for the conversation's first call, ``cross`` for a call opening a user turn, else ``within``."""
    return [
        "first" if i == 0 else "cross" if call.starts_turn else "within" for i, call in enumerate(conversation.calls)
    ]


def plan_conversation(item: TracedConversation, synthesizer: TokenSynthesizer, scale: Scale) -> ConversationPlan:
    conversation = item.conversation
    calls = conversation.calls
    kinds = call_kinds(conversation)
    token_ids = prompts(item, synthesizer, scale.token_scale)
    main_positions = [i for i, call in enumerate(calls) if call.subagent_id is None]
    sub_positions: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        if call.subagent_id is not None:
            sub_positions.setdefault(call.subagent_id, []).append(i)

    def planned(i: int, gap_s: float, first_of_agent: bool, waits: tuple[int, ...] = ()) -> PlannedCall:
        call = calls[i]
        session_id = conversation.conversation_id
        if call.subagent_id is not None:
            session_id = f"{session_id}/{call.subagent_id}"
        return PlannedCall(
            conversation_id=conversation.conversation_id,
            index=i,
            session_id=session_id,
            kind=kinds[i],
            call_header="user" if call.starts_turn or first_of_agent else "tool",
            after_header="tool" if call.finish_reason == "tool_calls" else "user",
            token_ids=token_ids[i],
            max_tokens=scale.tokens(call.output_tokens),
            gap_s=scale.seconds(gap_s),
            waits_for_subagents=waits,
            trace_arrival_s=call.arrival_s,
            trace_end_s=call.end_s,
        )

    subagents = []
    sub_ends: list[float] = []
    sub_parents: list[int | None] = []
    for positions in sub_positions.values():
        first = calls[positions[0]]
        parent = max((p for p in main_positions if calls[p].arrival_s <= first.arrival_s), default=None)
        start_gap_s = first.arrival_s - (calls[parent].end_s if parent is not None else 0.0)
        agent_calls = [planned(positions[0], start_gap_s, True)]
        agent_calls += [planned(b, calls[b].arrival_s - calls[a].end_s, False) for a, b in pairwise(positions)]
        parent_index = None if parent is None else main_positions.index(parent)
        subagents.append(AgentPlan(agent_calls[0].session_id, tuple(agent_calls), parent_index))
        sub_ends.append(max(calls[p].end_s for p in positions))
        sub_parents.append(parent_index)

    main_calls = []
    for n, i in enumerate(main_positions):
        call = calls[i]
        waits = tuple(
            s
            for s, (end_s, parent) in enumerate(zip(sub_ends, sub_parents))
            if parent is not None and parent < n and end_s <= call.arrival_s
        )
        ready_s = max([calls[main_positions[n - 1]].end_s if n else call.arrival_s] + [sub_ends[s] for s in waits])
        main_calls.append(planned(i, call.arrival_s - ready_s, n == 0, waits))
    main = AgentPlan(conversation.conversation_id, tuple(main_calls))
    return ConversationPlan(
        conversation.conversation_id, scaled_prefix_tokens(item, scale.token_scale), main, tuple(subagents)
    )
