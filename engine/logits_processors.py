"""What changes the logits of a row before any token is picked from them, greedy rows included.

In order, as vLLM: ``allowed_token_ids`` (every other token at -inf), the
``bad_words`` (the last token of each whose earlier tokens end the output, at
-inf), the ``logit_bias`` (added to the named tokens), the
repetition penalty (over every token of the sequence: prompt and output), the
frequency and presence penalties (over the output's tokens only: OpenAI's
``logit - count * frequency - (count > 0) * presence``), the ``min_tokens``
mask (stop token ids and EOS at -inf while the output is shorter), the guide's
mask (``guided.py``). Each returns a new tensor, so the raw logits stay as they
were for logprobs; a batch in which no row needs a step skips it.
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
    allowing = [i for i, seq in enumerate(seqs) if seq.params.allowed_token_ids is not None]
    if allowing:
        logits = allow_only(logits, allowing, [seqs[i].params.allowed_token_ids or () for i in allowing])
    allowed = logits
    banning = [(i, banned) for i, seq in enumerate(seqs) if seq.params.bad_words and (banned := banned_tokens(seq))]
    if banning:
        logits = mask_tokens(logits, [i for i, _ in banning], [banned for _, banned in banning])
    biased = [i for i, seq in enumerate(seqs) if seq.params.logit_bias]
    if biased:
        logits = apply_logit_bias(logits, biased, [seqs[i].params.logit_bias for i in biased])
    penalised = [i for i, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
    if penalised:
        logits = apply_repetition_penalty(
            logits,
            penalised,
            [seqs[i].token_ids for i in penalised],
            [seqs[i].params.repetition_penalty for i in penalised],
        )
    counted = [i for i, seq in enumerate(seqs) if seq.params.penalises_output and seq.num_output_tokens]
    if counted:
        logits = apply_output_penalties(
            logits,
            counted,
            [seqs[i].output_token_ids for i in counted],
            [seqs[i].params.frequency_penalty for i in counted],
            [seqs[i].params.presence_penalty for i in counted],
        )
    early = [i for i, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens]
    if early:
        logits = mask_tokens(logits, early, [_stop_ids(seqs[i], eos_token_ids) for i in early])
    guides = [seq.guide if seq.guide is not None and seq.guide.holds else None for seq in seqs]
    if any(guide is not None for guide in guides):
        logits = mask_guided_logits(logits, guides)
    if allowing or banning:
        logits = keep_a_choice(logits, allowed, sorted({*allowing, *(i for i, _ in banning)}))
    forced = [(i, token) for i, seq in enumerate(seqs) if (token := _forced(seq)) is not None]
    if forced:
        logits = force_tokens(logits, [i for i, _ in forced], [token for _, token in forced])
    return logits


def _forced(seq: Sequence) -> int | None:
    """The token a sequence whose reasoning spent its budget must take next (``thinking.py``), if any."""
    return seq.thinking.forced_token(seq.num_output_tokens) if seq.thinking is not None else None


def allow_only(logits: torch.Tensor, rows: Seq[int], token_ids: Seq[Seq[int]]) -> torch.Tensor:
    """A copy of ``logits`` in which row ``rows[i]`` keeps only the logits of ``token_ids[i]``, every other at -inf
    (every id is in the vocabulary: ``RequestLimits.check_request`` refuses a request naming one that is not)."""
    index, selected, keep = _named_in_rows(logits, rows, token_ids)
    out = logits.clone()
    out[index] = selected.masked_fill(~keep, float("-inf"))
    return out


def _named_in_rows(
    logits: torch.Tensor, rows: Seq[int], token_ids: Seq[Seq[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' index, their logits, and a mask of the same shape that is true at the tokens ``token_ids[i]``
    name in row ``rows[i]`` (one flat id array for all rows: numpy turns a long list into a tensor several times
    faster than torch)."""
    device = logits.device
    flat_ids = torch.from_numpy(np.concatenate([np.asarray(ids, dtype=np.int64) for ids in token_ids]))
    row_of_id = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(ids) for ids in token_ids]))
    index = torch.tensor(rows, device=device)
    selected = logits[index]
    named = torch.zeros_like(selected, dtype=torch.bool)
    named[row_of_id.to(device), flat_ids.to(device)] = True
    return index, selected, named


def keep_a_choice(logits: torch.Tensor, allowed: torch.Tensor, rows: Seq[int]) -> torch.Tensor:
    """``logits``, except that each row of ``rows`` the masks left with no token at all (the bad words, a guide or
    ``min_tokens`` banned every allowed token) takes its row of ``allowed`` (only ``allowed_token_ids`` applied):
    a row is never sampled from nothing."""
    index = torch.tensor(rows, device=logits.device)
    dead = ~torch.isfinite(logits[index]).any(dim=-1)
    if not bool(dead.any()):
        return logits
    out = logits.clone()
    out[index[dead]] = allowed[index[dead]]
    return out


def banned_tokens(seq: Sequence) -> list[int]:
    """The tokens ``seq``'s ``bad_words`` ban next: the last of each token sequence whose earlier tokens end the
    output so far (vLLM looks at the output only, so a word is never completed across the prompt's end)."""
    num_output = seq.num_output_tokens
    banned = []
    for word in seq.params.bad_words:
        before = len(word) - 1
        if before > num_output or (before and seq.token_ids[-1] != word[-2]):  # the last token decides most
            continue
        if before <= 1 or tuple(seq.token_ids[len(seq.token_ids) - before :]) == word[:-1]:
            banned.append(word[-1])
    return banned


def force_tokens(logits: torch.Tensor, rows: Seq[int], token_ids: Seq[int]) -> torch.Tensor:
    """A copy of ``logits`` in which row ``rows[i]`` allows only ``token_ids[i]`` (its logit 0, every other -inf,
    whatever masked it before)."""
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = float("-inf")
    out[index, torch.tensor(token_ids, device=logits.device)] = 0.0
    return out


def apply_repetition_penalty(
    logits: torch.Tensor, rows: Seq[int], token_ids: Seq[Seq[int]], penalties: Seq[float]
) -> torch.Tensor:
    """A copy of ``logits`` in which, for row ``rows[i]``, each token of ``token_ids[i]`` is penalised.

    A positive logit is divided by the penalty, any other multiplied by it
    (as in vLLM and transformers), so a penalty above 1 makes a seen token
    less likely whatever its sign.
    """
    index, selected, seen = _named_in_rows(logits, rows, token_ids)
    penalty = torch.tensor(penalties, dtype=logits.dtype, device=logits.device)[:, None]
    penalised = torch.where(selected > 0, selected / penalty, selected * penalty)
    out = logits.clone()
    out[index] = torch.where(seen, penalised, selected)
    return out


def apply_logit_bias(logits: torch.Tensor, rows: Seq[int], biases: Seq[Seq[tuple[int, float]]]) -> torch.Tensor:
    """A copy of ``logits`` with ``bias`` added to token ``token_id``'s logit in row ``rows[i]``, for each pair of
    ``biases[i]`` (every id is in the vocabulary: ``RequestLimits.check_request`` refuses a request naming one that
    is not)."""
    entries = [(row, token_id, bias) for row, pairs in zip(rows, biases) for token_id, bias in pairs]
    device = logits.device
    row_index = torch.tensor([row for row, _, _ in entries], device=device)
    token_index = torch.tensor([token_id for _, token_id, _ in entries], device=device)
    values = torch.tensor([bias for _, _, bias in entries], dtype=logits.dtype, device=device)
    out = logits.clone()
    out[row_index, token_index] += values  # each (row, token) at most once: a request's ids are distinct
    return out


def apply_output_penalties(
    logits: torch.Tensor,
    rows: Seq[int],
    output_ids: Seq[Seq[int]],
    frequency_penalties: Seq[float],
    presence_penalties: Seq[float],
) -> torch.Tensor:
    """A copy of ``logits`` in which row ``rows[i]`` loses, for each token of ``output_ids[i]``, its count times
    ``frequency_penalties[i]`` plus ``presence_penalties[i]`` once (OpenAI's frequency and presence penalties).

    The work is in the tokens the outputs hold, not in the vocabulary: each distinct (row, token) pair is
    numbered ``i * V + token`` and counted once, so 32 rows of a 150k-token vocabulary cost what their tokens do.
    """
    vocab_size = logits.shape[-1]
    # numpy turns a long list into an array several times faster than torch does.
    keys = np.concatenate([np.asarray(ids, dtype=np.int64) + i * vocab_size for i, ids in enumerate(output_ids)])
    pairs, counts = np.unique(keys, return_counts=True)
    which = torch.from_numpy(pairs // vocab_size)
    frequency = torch.tensor(frequency_penalties, dtype=logits.dtype)[which]
    presence = torch.tensor(presence_penalties, dtype=logits.dtype)[which]
    penalty = torch.from_numpy(counts).to(logits.dtype) * frequency + presence
    device = logits.device
    row_index = torch.tensor(rows)[which].to(device)
    token_index = torch.from_numpy(pairs % vocab_size).to(device)
    out = logits.clone()
    out[row_index, token_index] -= penalty.to(device)
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
