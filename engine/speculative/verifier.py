"""Verifying drafts: which draft tokens the model itself would have picked, and what happens to the rest.

A decoding sequence with a draft of ``k`` tokens runs a chunk of ``1 + k``
tokens (its last token, then the draft) and gets logits at every position:
position ``i`` says what follows draft token ``i - 1``. The sampler picks a
token at each position exactly as it would have without a draft; draft token
``i`` is accepted while it equals the pick at position ``i``, and the pick at
the first mismatch (or after the last draft token: the bonus token) is
emitted too. Greedy picks are the argmax, so greedy output is the same with
or without drafts. Random picks at each position come from that position's
own distribution, which is the unspeculated distribution since every earlier
token is then one the sampler picked; a seeded sequence draws from its
generator only for the tokens it emits, in order, so its output does not
change either. Drafting sequences need no logits processing (``drafter.py``).

The emitted tokens go through the stop checks one by one (a stop ends the
sequence at that token). Before each token after the first, the draft token
it confirms counts as computed and a page it fills is cached; the pages past
the sequence's end are freed, so no page holding a rejected token's KV is
ever cached. Each emitted token's logprobs come from its own position.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from ..kv_cache_manager import KVCacheManager
from ..outputs import RequestOutput
from ..request import OnStop, RequestTable
from ..sampler import compute_logprobs, sample
from ..scheduler import ScheduledChunk
from ..sequence import Sequence, TokenLogprob
from .drafter import Drafter


def split_verified(
    sampled: list[ScheduledChunk], logits: torch.Tensor
) -> tuple[list[ScheduledChunk], torch.Tensor, list[tuple[ScheduledChunk, torch.Tensor]]]:
    """The chunks without a draft with their logits rows, and each chunk with a draft with its ``1 + k`` rows."""
    if not any(chunk.draft for chunk in sampled):
        return sampled, logits, []
    plain: list[ScheduledChunk] = []
    plain_rows: list[int] = []
    verified: list[tuple[ScheduledChunk, torch.Tensor]] = []
    row = 0
    for chunk in sampled:
        num_rows = 1 + len(chunk.draft)
        if chunk.draft:
            verified.append((chunk, logits[row : row + num_rows]))
        else:
            plain.append(chunk)
            plain_rows.append(row)
        row += num_rows
    return plain, logits[torch.tensor(plain_rows, dtype=torch.long, device=logits.device)], verified


def verify_drafts(
    verified: list[tuple[ScheduledChunk, torch.Tensor]],
    drafter: Drafter,
    requests: RequestTable,
    kv_cache: KVCacheManager,
    on_stop: OnStop,
) -> list[RequestOutput]:
    """Accept each draft's agreed tokens, emit them through the stop checks, roll back the rest."""
    seqs: list[Sequence] = []
    runs: list[list[int]] = []
    logprob_runs: list[list[TokenLogprob | None]] = []
    for chunk, logits in verified:
        seq = chunk.seq
        tokens = pick_tokens(logits, seq, chunk.draft)
        drafter.record(seq, len(chunk.draft), len(tokens) - 1)
        seqs.append(seq)
        runs.append(tokens)
        num_top = seq.params.logprobs
        if num_top is None:
            logprob_runs.append([None] * len(tokens))
        else:
            logprob_runs.append(list(compute_logprobs(logits[: len(tokens)], tokens, [num_top] * len(tokens))))

    def confirm_draft_token(seq: Sequence) -> None:
        seq.num_computed_tokens += 1
        kv_cache.cache_computed(seq)

    outputs = requests.append_runs(seqs, runs, logprob_runs, on_stop, confirm_draft_token)
    for seq in seqs:
        if not seq.is_finished:
            kv_cache.trim(seq)
    return outputs


def pick_tokens(logits: torch.Tensor, seq: Sequence, draft: Seq[int]) -> list[int]:
    """The tokens a draft yields: the accepted draft tokens, then the pick where it stopped agreeing.

    ``logits``: [1 + len(draft), vocab], row ``i`` predicting the token after draft token ``i - 1``.
    """
    params = seq.params
    if params.greedy or seq.generator is None:
        if params.greedy:
            picks = logits.argmax(dim=-1).tolist()
        else:
            picks = sample(logits, [params] * logits.shape[0], [None] * logits.shape[0])
        num_accepted = 0
        while num_accepted < len(draft) and picks[num_accepted] == draft[num_accepted]:
            num_accepted += 1
        return picks[: num_accepted + 1]
    tokens: list[int] = []
    for row in range(logits.shape[0]):  # one draw per emitted token, in order
        (token,) = sample(logits[row : row + 1], [params], [seq.generator])
        tokens.append(token)
        if row == len(draft) or token != draft[row]:
            break
    return tokens
