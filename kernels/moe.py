"""Mixture-of-experts ops: the torch reference every backend can fall back on.

One MoE MLP runs in four steps::

    router logits --route_top_k--> (weights, expert ids) per token
        --permute_by_expert--> token rows grouped by expert
        --grouped_expert_mlp--> each expert's SwiGLU MLP over only its rows
        --unpermute--> rows summed back per token, weighted

Expert weights keep the layout Hugging Face models use in memory:
``gate_up`` is [num_experts, 2 * intermediate, hidden] (gate rows first, then
up rows) and ``down`` is [num_experts, hidden, intermediate]. Groups are as
long as the tokens routed to them: nothing is padded to the largest expert.
Experts may carry biases ([num_experts, 2 * intermediate] and [num_experts,
hidden]) and GPT-OSS's clamped SwiGLU (``ClampedSwiGLU``) in place of SwiGLU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# (gate, up) -> activation of the expert's hidden layer
GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (rows, weight [num_experts, out, in], group sizes) -> rows @ weight[e].T for each expert's rows
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)``."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True, slots=True)
class ExpertPermutation:
    """Where each (token, top-k slot) pair went when rows were grouped by expert.

    Row r of the grouped input is token ``token_index[r]``'s copy for its
    ``slot_index[r]``-th expert; expert e owns ``group_sizes[e]`` consecutive rows.
    """

    token_index: torch.Tensor  # [num_tokens * top_k] int64
    slot_index: torch.Tensor  # [num_tokens * top_k] int64, flat index into the [num_tokens, top_k] routing
    group_sizes: tuple[int, ...]  # host copy, one entry per expert


def route_top_k(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every expert, then the ``top_k`` largest; with ``renormalize`` they are rescaled to sum to 1.

    Returns float32 weights and int64 expert ids, both [num_tokens, top_k].
    """
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be in 1..{router_logits.shape[-1]}, got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def permute_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertPermutation:
    """Group the (token, slot) pairs of ``expert_ids`` ([num_tokens, top_k]) by expert, token order kept within."""
    flat = expert_ids.reshape(-1)
    slot_index = torch.argsort(flat, stable=True)
    top_k = expert_ids.shape[-1]
    group_sizes = torch.bincount(flat, minlength=num_experts)
    return ExpertPermutation(
        token_index=slot_index // top_k,
        slot_index=slot_index,
        group_sizes=tuple(int(n) for n in group_sizes.tolist()),
    )


def grouped_expert_mlp(
    rows: torch.Tensor,
    group_sizes: tuple[int, ...],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: GatedActivation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    matmul: GroupedMatmul | None = None,
) -> torch.Tensor:
    """Expert e's ``down @ activation(gate, up) + down_bias`` (gate and up from ``gate_up @ row + gate_up_bias``)
    over its ``group_sizes[e]`` consecutive ``rows``; ``matmul`` replaces ``grouped_matmul`` (a backend's own)."""
    matmul = matmul or grouped_matmul
    intermediate = down.shape[-1]
    gate_up_rows = _add_group_bias(matmul(rows, gate_up, group_sizes), gate_up_bias, group_sizes)
    hidden = activation(gate_up_rows[:, :intermediate], gate_up_rows[:, intermediate:])
    return _add_group_bias(matmul(hidden, down, group_sizes), down_bias, group_sizes)


def _add_group_bias(out: torch.Tensor, bias: torch.Tensor | None, group_sizes: tuple[int, ...]) -> torch.Tensor:
    """``out`` with expert e's ``bias[e]`` added to its ``group_sizes[e]`` rows (in place)."""
    if bias is None:
        return out
    sizes = torch.tensor(group_sizes, device=out.device)
    return out.add_(bias.repeat_interleave(sizes, dim=0, output_size=out.shape[0]))


def _grouped_mm_runs(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` (torch >= 2.10) takes these operands: on CPUs, with rows of both a multiple of 16
    bytes (on GPUs it takes only some dtypes and architectures)."""
    aligned = all(size * rows.element_size() % 16 == 0 for size in weight.shape[1:])
    return hasattr(F, "grouped_mm") and rows.device.type == "cpu" and aligned


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, group_sizes: tuple[int, ...]) -> torch.Tensor:
    """``rows @ weight[e].T`` for each expert's rows: one ``F.grouped_mm`` where it runs, else a matmul per expert."""
    if _grouped_mm_runs(rows, weight):
        ends = torch.tensor(list(itertools.accumulate(group_sizes)), dtype=torch.int32, device=rows.device)
        return F.grouped_mm(rows, weight.transpose(-2, -1), offs=ends)
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for expert, size in enumerate(group_sizes):
        if size:
            torch.mm(rows[start : start + size], weight[expert].t(), out=out[start : start + size])
            start += size
    return out


def unpermute(
    expert_out: torch.Tensor, permutation: ExpertPermutation, weights: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Sum each token's expert outputs weighted by its routing ``weights``, accumulated in float32."""
    row_weights = weights.reshape(-1)[permutation.slot_index].unsqueeze(-1)
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=torch.float32, device=expert_out.device)
    out.index_add_(0, permutation.token_index, expert_out.float() * row_weights)
    return out.to(expert_out.dtype)


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    activation: GatedActivation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    matmul: GroupedMatmul | None = None,
) -> torch.Tensor:
    """The whole MoE MLP of ``x`` ([num_tokens, hidden]) given its ``router_logits`` ([num_tokens, num_experts])."""
    weights, expert_ids = route_top_k(router_logits, top_k, renormalize)
    permutation = permute_by_expert(expert_ids, gate_up.shape[0])
    rows = x[permutation.token_index]
    expert_out = grouped_expert_mlp(
        rows, permutation.group_sizes, gate_up, down, activation, gate_up_bias, down_bias, matmul
    )
    return unpermute(expert_out, permutation, weights, x.shape[0])
