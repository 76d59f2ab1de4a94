"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

A sequence asks for them with ``SamplingParams.prompt_logprobs``. Until its
whole prompt is scored (``Sequence.needs_prompt_logprobs``) it computes every
prompt position itself: it takes no prefix-cache hits and loads no pages from
the KV store (its own pages are still cached as they fill, for others). Each
prompt chunk the model runner runs for it yields the hidden states of the
chunk's positions; position ``p``'s logits score prompt token ``p + 1``, so
chunked prefill scores a prompt over several steps. The logits are made and
reduced to python floats a block of rows at a time, so no vocabulary-sized
tensor outlives its block. A request's forks are made after its prompt ran and
share its scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampler import compute_logprobs
from .sequence import Sequence, TokenLogprob

# Rows of logits made at once: a block is this many rows times the vocabulary, in float32.
ROWS_PER_BLOCK = 256


@dataclass(frozen=True, slots=True)
class PromptScores:
    """One chunk's prompt scores: ``entries[i]`` scores prompt token ``first_position + i``."""

    seq: Sequence
    first_position: int
    entries: list[TokenLogprob]

    def record(self) -> None:
        self.seq.add_prompt_logprobs(self.first_position, self.entries)


def scored_positions(seq: Sequence, start: int, end: int) -> range:
    """The positions among ``[start, end)`` whose logits score a prompt token of ``seq`` it still needs."""
    if not seq.needs_prompt_logprobs:
        return range(0)
    return range(start, min(end, seq.num_prompt_tokens - 1))


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, seq: Sequence, positions: range
) -> PromptScores:
    """Score the prompt tokens after ``positions`` from their hidden states ``hidden`` [len(positions), H]."""
    targets = seq.token_ids[positions.start + 1 : positions.stop + 1]
    num_top = seq.params.prompt_logprobs or 0
    entries: list[TokenLogprob] = []
    for first in range(0, len(targets), ROWS_PER_BLOCK):
        block_targets = targets[first : first + ROWS_PER_BLOCK]
        logits = compute_logits(hidden[first : first + ROWS_PER_BLOCK])
        entries.extend(compute_logprobs(logits, block_targets, [num_top] * len(block_targets)))
    return PromptScores(seq, positions.start + 1, entries)
