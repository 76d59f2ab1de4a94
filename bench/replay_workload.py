"""The replay workload: recorded conversations turned into exact token streams, gaps and a send plan.

Pure and deterministic: the traces, the model's vocabulary, the two scales and
the seed fix every token id the replayer sends.

Tokens. A call's prompt is a shared tool/system prefix (one token stream, the
same in every conversation; each conversation takes as much of it as its
file's ``tool_tokens + system_tokens``, else ``DEFAULT_SHARED_PREFIX_TOKENS``;
none for Mooncake, whose global hash ids already mark shared blocks), then one
block of ``round(block_size * token_scale)`` tokens (at least 1) per hash id.
A block depends only on its hash id and its scope (the conversation, whose
sub-agents share its ids; Mooncake ids are global), so equal ids give equal
blocks. A call without hash ids (TraceLab) reuses ``prefix_tokens`` (scaled)
of the same agent's previous prompt and draws the rest fresh.

Gaps. An agent's next call goes out once its previous response has finished,
after the scaled gap the trace shows between them: the call's arrival minus
the previous call's end (``Call.end_s``), floored at 0. A main-agent call also
waits for every sub-agent that, in the trace, finished before it arrived, and
its gap then counts from the latest of those ends. A sub-agent starts after
the parent call it followed in the trace has finished, plus the scaled gap
between that call's end and the sub-agent's first arrival.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Literal

from rayturn.router.traces import TRACE_SUFFIXES, Call, Conversation, load_traces

CallKind = Literal["first", "within", "cross"]

DEFAULT_SHARED_PREFIX_TOKENS = 15_000
CONTEXT_FILL = 0.9  # the longest scaled prompt + output must fit this share of the context
# Auto device pages: the sessions' KV demand is this many decode pools (the goal is at least 2; a margin over it).
DEMAND_OVER_CAPACITY = 2.5


@dataclass(frozen=True, slots=True)
class TracedConversation:
    """A conversation and the real-token length of its shared tool/system prefix."""

    conversation: Conversation
    shared_prefix_tokens: int

    @property
    def conversation_id(self) -> str:
        return self.conversation.conversation_id


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The token ids a synthetic prompt may hold (no special or added tokens) and the model's context."""

    token_ids: tuple[int, ...]
    context_tokens: int


@dataclass(frozen=True, slots=True)
class Scale:
    token_scale: float
    time_scale: float

    def tokens(self, real_tokens: float) -> int:
        """A scaled token count, at least 1."""
        return max(1, round(real_tokens * self.token_scale))

    def seconds(self, real_s: float) -> float:
        return max(0.0, real_s) * self.time_scale


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


# -- reading ------------------------------------------------------------------


def read_traces(paths: Iterable[str | Path]) -> list[TracedConversation]:
    """Conversations of trace files or folders (folders: their trace files in name order), via ``load_traces``."""
    traced: list[TracedConversation] = []
    for path in _trace_files(paths):
        for conversation in load_traces([path]):
            if conversation.trace_format == "weka":
                prefix = _weka_prefix_tokens(path)
            elif conversation.trace_format == "mooncake":
                prefix = 0
            else:
                prefix = DEFAULT_SHARED_PREFIX_TOKENS
            traced.append(TracedConversation(conversation, prefix))
    return traced


def _trace_files(paths: Iterable[str | Path]) -> list[Path]:
    files: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES)))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such trace file or folder")
    return files


def _weka_prefix_tokens(path: Path) -> int:
    """``tool_tokens + system_tokens`` of a weka file; the default when either is absent."""
    data = json.loads(path.read_text())
    counts = []
    for key in ("tool_tokens", "system_tokens"):
        value = data.get(key)
        if value is None:
            return DEFAULT_SHARED_PREFIX_TOKENS
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: {key}: expected a non-negative integer, got {value!r}")
        counts.append(value)
    return sum(counts)


def pick_conversations(
    traced: Sequence[TracedConversation], limit: int | None, busiest_within_s: float | None = None
) -> list[TracedConversation]:
    """The first ``limit`` conversations, or (``busiest_within_s``) those opening the most turns that soon, in order."""
    if limit is None or limit >= len(traced):
        return list(traced)
    if busiest_within_s is None:
        return list(traced[:limit])

    def turns_in_window(item: TracedConversation) -> int:
        return sum(1 for call in item.conversation.calls if call.starts_turn and call.arrival_s <= busiest_within_s)

    chosen = set(heapq.nlargest(limit, range(len(traced)), key=lambda i: (turns_in_window(traced[i]), -i)))
    return [item for i, item in enumerate(traced) if i in chosen]


def model_vocabulary(model: str, max_model_len: int | None = None) -> Vocabulary:
    """A preset's or model directory's plain token ids and context (capped at ``max_model_len``)."""
    from rayturn.engine.config import ModelConfig
    from rayturn.engine.presets import PRESETS, preset_dir
    from rayturn.engine.tokenizer import Tokenizer

    model_dir = preset_dir(model) if model in PRESETS else Path(model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory")
    config = ModelConfig.from_file(model_dir / "config.json")
    backend = Tokenizer.from_dir(model_dir).backend
    special = set(backend.get_added_tokens_decoder())
    vocab_size = min(config.vocab_size, backend.get_vocab_size(with_added_tokens=True))
    context = config.max_model_len if max_model_len is None else min(config.max_model_len, max_model_len)
    return Vocabulary(tuple(i for i in range(vocab_size) if i not in special), context)


def with_context(model: str, context_tokens: int, root: Path) -> str:
    """A copy of a preset with a longer context (RoPE has no learned positions), under ``root``; its path.

    Long agent conversations outgrow the presets' contexts even at small token
    scales; a random-weight model's costs and KV shapes are what a replay
    measures, so stretching its context changes nothing else.
    """
    from rayturn.engine.presets import PRESETS, preset_dir

    if model not in PRESETS:
        raise ValueError(f"--context stretches a preset's context ({', '.join(PRESETS)}), not {model!r}")
    source = preset_dir(model)
    target = root / f"{source.name}-context{context_tokens}"
    config = json.loads((source / "config.json").read_text())
    if config["max_position_embeddings"] >= context_tokens:
        return model
    if not (target / "config.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            if item.name != "config.json":
                shutil.copy2(item, target / item.name)
        config["max_position_embeddings"] = context_tokens
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return str(target)


# -- scaling ------------------------------------------------------------------


def block_tokens(block_size: int, token_scale: float) -> int:
    return max(1, round(block_size * token_scale))


def scaled_prefix_tokens(item: TracedConversation, token_scale: float) -> int:
    return round(item.shared_prefix_tokens * token_scale)


def prompt_tokens(item: TracedConversation, call: Call, token_scale: float) -> int:
    """The length of the prompt ``TokenSynthesizer`` builds for ``call``."""
    prefix = scaled_prefix_tokens(item, token_scale)
    if call.hash_ids:
        return prefix + len(call.hash_ids) * block_tokens(item.conversation.block_size or 1, token_scale)
    return prefix + max(1, round(call.input_tokens * token_scale))


def call_tokens(item: TracedConversation, call: Call, token_scale: float) -> int:
    """Prompt plus output, scaled: what one call needs of the context."""
    return prompt_tokens(item, call, token_scale) + max(1, round(call.output_tokens * token_scale))


def auto_token_scale(traced: Sequence[TracedConversation], context_tokens: int) -> float:
    """The largest ``1/n`` whose longest call fits ``CONTEXT_FILL`` of the context.

    Blocks never shrink below one token, so past ``1/block_size`` nothing
    shrinks much; when even that does not fit, ``1/block_size`` is the answer
    and ``fit_to_context`` cuts the conversations that are too long.
    """
    budget = CONTEXT_FILL * context_tokens
    largest_block = max((item.conversation.block_size or 1 for item in traced), default=1)

    def fits(n: int) -> bool:
        return all(call_tokens(item, call, 1 / n) <= budget for item in traced for call in item.conversation.calls)

    low, high = 1, largest_block  # fits() only gets truer as n grows: a binary search for the smallest n
    if not fits(high):
        return 1 / high
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return 1 / low


@dataclass(frozen=True, slots=True)
class Fitted:
    """Conversations that fit the context: ``kept`` (some of them ``cut`` short) and the ``dropped`` ids."""

    kept: list[TracedConversation]
    cut: list[str]
    dropped: list[str]


def fit_to_context(traced: Sequence[TracedConversation], token_scale: float, context_tokens: int) -> Fitted:
    """Each conversation cut before its first call (any agent) that does not fit; dropped if that is its first."""
    budget = CONTEXT_FILL * context_tokens
    fitted = Fitted([], [], [])
    for item in traced:
        calls = item.conversation.calls
        end = next((i for i, call in enumerate(calls) if call_tokens(item, call, token_scale) > budget), len(calls))
        if end == 0:
            fitted.dropped.append(item.conversation_id)
        elif end < len(calls):
            fitted.cut.append(item.conversation_id)
        if end:
            conversation = Conversation(
                item.conversation_id,
                item.conversation.trace_format,
                calls[:end],
                item.conversation.block_size,
                item.conversation.start_epoch_s,
            )
            fitted.kept.append(TracedConversation(conversation, item.shared_prefix_tokens))
    return fitted


# -- tokens -------------------------------------------------------------------


@dataclass
class TokenSynthesizer:
    """Deterministic token ids: a shared prefix stream and one block per (scope, hash id)."""

    vocabulary: Sequence[int]
    seed: int = 0
    _prefix: list[int] = field(default_factory=list)
    _prefix_rng: random.Random | None = None
    _blocks: dict[tuple[str, int, int], tuple[int, ...]] = field(default_factory=dict)

    def prefix(self, num_tokens: int) -> tuple[int, ...]:
        """The first ``num_tokens`` of the shared stream (drawn in order, so shorter prefixes are prefixes)."""
        if self._prefix_rng is None:
            self._prefix_rng = random.Random(f"{self.seed}/shared-prefix")
        if num_tokens > len(self._prefix):
            self._prefix.extend(self._prefix_rng.choices(self.vocabulary, k=num_tokens - len(self._prefix)))
        return tuple(self._prefix[:num_tokens])

    def block(self, scope: str, hash_id: int, num_tokens: int) -> tuple[int, ...]:
        key = (scope, hash_id, num_tokens)
        if key not in self._blocks:
            rng = random.Random(f"{self.seed}/block/{scope}/{hash_id}")
            self._blocks[key] = tuple(rng.choices(self.vocabulary, k=num_tokens))
        return self._blocks[key]

    def fresh(self, scope: str, call_index: int, num_tokens: int) -> tuple[int, ...]:
        rng = random.Random(f"{self.seed}/fresh/{scope}/{call_index}")
        return tuple(rng.choices(self.vocabulary, k=num_tokens))


def block_scope(conversation: Conversation) -> str:
    """Where hash ids are unique: the conversation (sub-agents included), or the whole Mooncake file."""
    if conversation.trace_format == "mooncake":
        return "mooncake:" + conversation.conversation_id.rsplit(":", 1)[0]
    return conversation.conversation_id


def prompts(item: TracedConversation, synthesizer: TokenSynthesizer, token_scale: float) -> list[tuple[int, ...]]:
    """The prompt token ids of every call of the conversation, in its call order."""
    conversation = item.conversation
    scope = block_scope(conversation)
    prefix = synthesizer.prefix(scaled_prefix_tokens(item, token_scale))
    block_length = block_tokens(conversation.block_size or 1, token_scale)
    previous_body: dict[str | None, tuple[int, ...]] = {}
    result = []
    for index, call in enumerate(conversation.calls):
        if call.hash_ids:
            body = tuple(t for hash_id in call.hash_ids for t in synthesizer.block(scope, hash_id, block_length))
        else:
            length = prompt_tokens(item, call, token_scale) - len(prefix)
            before = previous_body.get(call.subagent_id, ())
            reused = min(round((call.prefix_tokens or 0) * token_scale), len(before), length)
            body = before[:reused] + synthesizer.fresh(scope, index, length - reused)
        previous_body[call.subagent_id] = body
        result.append(prefix + body)
    return result


# -- the plan -----------------------------------------------------------------


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


# -- KV demand ----------------------------------------------------------------


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def kv_demand_pages(plans: Sequence[ConversationPlan], page_size: int) -> int:
    """Each session's (sub-agents too) largest context in pages, the shared prefix counted once."""
    total = _pages(max((plan.prefix_tokens for plan in plans), default=0), page_size)
    for plan in plans:
        for agent in plan.agents:
            longest = max((len(c.token_ids) + c.max_tokens for c in agent.calls), default=plan.prefix_tokens)
            total += _pages(longest - plan.prefix_tokens, page_size)
    return total


def busiest_pages(plans: Sequence[ConversationPlan], page_size: int, concurrency: int) -> int:
    """Pages the running sequences need at the busiest moment: the ``concurrency`` largest per-conversation peaks.

    A conversation's peak is the most context (beyond the shared prefix) its
    calls hold at once on the trace's clock; the shared prefix counts once.
    """
    peaks = []
    for plan in plans:
        calls = [c for agent in plan.agents for c in agent.calls]
        own_pages = [_pages(len(c.token_ids) + c.max_tokens - plan.prefix_tokens, page_size) for c in calls]
        peak = 0
        for call in calls:
            running = (
                pages
                for c, pages in zip(calls, own_pages)
                if c is call or c.trace_arrival_s <= call.trace_arrival_s < c.trace_end_s
            )
            peak = max(peak, sum(running))
        peaks.append(peak)
    prefix = _pages(max((plan.prefix_tokens for plan in plans), default=0), page_size)
    return prefix + sum(heapq.nlargest(concurrency, peaks))


def auto_device_pages(demand_pages: int, busiest: int, decode_replicas: int) -> int:
    """Pages per decode replica: the sessions' demand ``DEMAND_OVER_CAPACITY`` times the pool's, but never fewer
    than a replica's share of the busiest moment (the router spreads sessions; a replica that gets more preempts)."""
    share = math.ceil(busiest / decode_replicas)
    return max(share, math.floor(demand_pages / (DEMAND_OVER_CAPACITY * decode_replicas)))
