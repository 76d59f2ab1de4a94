"""Exact prompt token ids for a recorded conversation: pure and deterministic.

A call's prompt is a shared tool/system prefix (one token stream, the same in
every conversation; each conversation takes as much of it as its
``TracedConversation.shared_prefix_tokens``), then one block of
``round(block_size * token_scale)`` tokens (at least 1) per hash id. A block
depends only on its hash id and its scope (the conversation, whose sub-agents
share its ids; Mooncake ids are global), so equal ids give equal blocks. A
call without hash ids (TraceLab) reuses ``prefix_tokens`` (scaled) of the same
agent's previous prompt and draws the rest fresh. The vocabulary and the seed
fix every token id.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from rayturn.replay.scaling import block_tokens, prompt_tokens, scaled_prefix_tokens
from rayturn.replay.traces import Conversation
from rayturn.replay.workload import TracedConversation


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
