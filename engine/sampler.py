"""Turns logits into tokens: greedy, temperature, min-p, top-k, top-p, seeds, logprobs.

Rows are grouped so the common cases stay batched: greedy rows share one
argmax, unseeded random rows share one multinomial draw; only rows with their
own seed draw from their own generator, which is what makes a seeded request
reproducible regardless of its batch mates. The repetition penalty and the
masks (``min_tokens``, a guide) change a row's logits first
(``logits_processors.py``); logprobs come from the raw logits.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from collections.abc import Set as AbstractSet

import torch

from .logits_processors import process_logits
from .sampling_params import SamplingParams
from .sequence import Sequence, TokenLogprob


def apply_min_p(logits: torch.Tensor, min_ps: Seq[float]) -> torch.Tensor:
    """``logits`` [B, V] with each row's tokens less likely than ``min_ps[row]`` times its best at -inf."""
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor(min_ps, dtype=probs.dtype, device=logits.device)[:, None]
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def _filter(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with min-p, then top-k / top-p, masked to -inf. [B, V] float32."""
    temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperatures[:, None]
    min_ps = [p.min_p for p in params]
    if any(min_ps):  # min-p before top-k / top-p, as vLLM
        logits = apply_min_p(logits, min_ps)
    vocab_size = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p for p in params]
    if all(k == vocab_size for k in top_ks) and all(p == 1.0 for p in top_ps):
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device)[None, :]
    k_tensor = torch.tensor(top_ks, device=logits.device)[:, None]
    drop = ranks >= k_tensor
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest set whose mass reaches top_p: drop a token when the
    # mass before it already reaches top_p (the best token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    p_tensor = torch.tensor(top_ps, dtype=probs.dtype, device=logits.device)[:, None]
    drop |= mass_before >= p_tensor
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def sample(
    logits: torch.Tensor,
    params: Seq[SamplingParams],
    generators: Seq[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` [B, V] float32."""
    num_rows = logits.shape[0]
    tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        tokens[rows] = logits[rows].argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filter(logits[rows], [params[i] for i in random_rows]).softmax(dim=-1)
        unseeded = [j for j, i in enumerate(random_rows) if generators[i] is None]
        if unseeded:
            picked = torch.multinomial(probs[unseeded], 1).squeeze(-1)
            tokens[rows[unseeded]] = picked
        for j, i in enumerate(random_rows):
            generator = generators[i]
            if generator is not None:
                tokens[i] = torch.multinomial(probs[j].cpu(), 1, generator=generator).item()
    return tokens.tolist()


def compute_logprobs(logits: torch.Tensor, token_ids: Seq[int], num_top: Seq[int]) -> list[TokenLogprob]:
    """The chosen token's log-probability and the ``num_top[i]`` best alternatives, per row."""
    logprobs = logits.log_softmax(dim=-1)
    most = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0].long())
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(-1).tolist()
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(
            token_id=token_ids[i],
            logprob=chosen[i],
            top=tuple(zip(top_ids_list[i][: num_top[i]], top_values_list[i][: num_top[i]])),
        )
        for i in range(len(token_ids))
    ]


def sample_sequences(
    logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: AbstractSet[int]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per sequence (row of ``logits``), with its logprobs where the sequence asked for them.

    Rows sample from their processed logits (penalised, masked); logprobs
    come from the raw ones. ``eos_token_ids``: what ``min_tokens`` holds back.
    """
    processed = process_logits(logits, seqs, eos_token_ids)
    tokens = sample(processed, [seq.params for seq in seqs], [seq.generator for seq in seqs])
    wants_logprobs = [seq.params.logprobs is not None for seq in seqs]
    if not any(wants_logprobs):
        return tokens, [None] * len(seqs)
    logprobs = compute_logprobs(logits, tokens, [seq.params.logprobs or 0 for seq in seqs])
    return tokens, [logprob if wants else None for logprob, wants in zip(logprobs, wants_logprobs)]
