"""What changes the logits of a row before any token is picked from them, greedy rows included.

In order: the repetition penalty (on the raw logits, over every token of the
sequence: prompt and output), the ``min_tokens`` mask (stop token ids and EOS
at -inf while the output is shorter), the guide's mask (``guided.py``). Each
returns a new tensor, so the raw logits stay as they were for logprobs; a
batch in which no row needs a step skips it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet

import numpy as np
import torch

from .guided import mask_guided_logits
from .sequence import Sequence


def process_logits(logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: AbstractSet[int]) -> torch.Tensor:
    """The logits [B, V] each sequence (row) picks its next token from."""
    penalised = [i for i, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
    if penalised:
        logits = apply_repetition_penalty(
            logits,
            penalised,
            [seqs[i].token_ids for i in penalised],
            [seqs[i].params.repetition_penalty for i in penalised],
        )
    early = [i for i, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens]
    if early:
        logits = mask_tokens(logits, early, [_stop_ids(seqs[i], eos_token_ids) for i in early])
    guides = [seq.guide for seq in seqs]
    if any(guide is not None for guide in guides):
        logits = mask_guided_logits(logits, guides)
    return logits


def apply_repetition_penalty(
    logits: torch.Tensor, rows: Seq[int], token_ids: Seq[Seq[int]], penalties: Seq[float]
) -> torch.Tensor:
    """A copy of ``logits`` in which, for row ``rows[i]``, each token of ``token_ids[i]`` is penalised.

    A positive logit is divided by the penalty, any other multiplied by it
    (as in vLLM and transformers), so a penalty above 1 makes a seen token
    less likely whatever its sign.
    """
    device = logits.device
    # One flat id array for all rows (numpy turns a long list into a tensor several times faster than torch).
    flat_ids = torch.from_numpy(np.concatenate([np.asarray(ids, dtype=np.int64) for ids in token_ids]))
    row_of_id = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(ids) for ids in token_ids]))
    index = torch.tensor(rows, device=device)
    selected = logits[index]
    seen = torch.zeros_like(selected, dtype=torch.bool)
    seen[row_of_id.to(device), flat_ids.to(device)] = True
    penalty = torch.tensor(penalties, dtype=logits.dtype, device=device)[:, None]
    penalised = torch.where(selected > 0, selected / penalty, selected * penalty)
    out = logits.clone()
    out[index] = torch.where(seen, penalised, selected)
    return out


def mask_tokens(logits: torch.Tensor, rows: Seq[int], token_ids: Seq[Seq[int]]) -> torch.Tensor:
    """A copy of ``logits`` with the tokens ``token_ids[i]`` of row ``rows[i]`` at -inf.

    Ids beyond the vocabulary are skipped.
    """
    vocab_size = logits.shape[-1]
    pairs = [(row, token) for row, ids in zip(rows, token_ids) for token in ids if token < vocab_size]
    if not pairs:
        return logits
    index = torch.tensor(pairs, device=logits.device)
    out = logits.clone()
    out[index[:, 0], index[:, 1]] = float("-inf")
    return out


def _stop_ids(seq: Sequence, eos_token_ids: AbstractSet[int]) -> list[int]:
    """The tokens that would end ``seq``: its stop token ids, and EOS unless it ignores EOS."""
    ids = set(seq.params.stop_token_ids)
    if not seq.params.ignore_eos:
        ids |= eos_token_ids
    return sorted(ids)
