"""Scaling a recorded conversation to the served model: token counts, the token scale that fits, cutting to fit.

A block of ``block_size`` trace tokens becomes ``round(block_size * token_scale)``
tokens (at least 1); seconds are multiplied by the time scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayturn.replay.traces import Call, Conversation
from rayturn.replay.workload import TracedConversation

CONTEXT_FILL = 0.9  # the longest scaled prompt + output must fit this share of the context


@dataclass(frozen=True, slots=True)
class Scale:
    token_scale: float
    time_scale: float

    def tokens(self, real_tokens: float) -> int:
        """A scaled token count, at least 1."""
        return max(1, round(real_tokens * self.token_scale))

    def seconds(self, real_s: float) -> float:
        return max(0.0, real_s) * self.time_scale


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
