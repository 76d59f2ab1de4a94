"""The mixture-of-experts MLP block (Mixtral, Qwen3-MoE) and its checkpoint names (GPT-OSS's block: ``gpt_oss``).

A block holds a router (``gate``, a [num_experts, hidden] linear) and every
expert's weights stacked: ``experts.gate_up_proj`` [num_experts, 2 *
intermediate, hidden] and ``experts.down_proj`` [num_experts, hidden,
intermediate], the layout ``transformers`` keeps in memory. Checkpoints store
them either that way or one tensor per expert and projection
(``experts.{e}.w1/w2/w3`` for Mixtral under ``block_sparse_moe``,
``experts.{e}.gate_proj/up_proj/down_proj`` for Qwen3-MoE);
``expert_slice`` maps the latter onto slices of the stacked tensors.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rayturn.kernels import KernelBackend

from .config import ModelConfig

_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        self.gate_up_proj_bias = (
            nn.Parameter(torch.empty(num_experts, 2 * intermediate_size), requires_grad=False) if bias else None
        )
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False) if bias else None


class SparseMoeBlock(nn.Module):
    """Route each token to its top-k experts and sum their SwiGLU MLPs, weighted by routing probability."""

    def __init__(self, config: ModelConfig, backend: KernelBackend, gate: nn.Module) -> None:
        super().__init__()
        self.backend = backend
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = gate
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.fused_moe(
            x, self.gate(x), self.experts.gate_up_proj, self.experts.down_proj, self.top_k, self.renormalize
        )


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor name (``model.`` removed) in our naming: Mixtral's ``block_sparse_moe`` is ``mlp``."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def expert_slice(name: str, params: dict[str, nn.Parameter]) -> tuple[str, torch.Tensor] | None:
    """For one expert's projection (``layers.L.mlp.experts.E.w1.weight`` and the like): the stacked parameter's
    name and the slice of it the tensor fills; None for any other name."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
    if projection in ("w2", "down_proj"):
        target = f"{prefix}.down_proj"
        if target not in params or expert >= params[target].shape[0]:
            return None
        return target, params[target].data[expert]
    target = f"{prefix}.gate_up_proj"
    if target not in params or expert >= params[target].shape[0]:
        return None
    intermediate = params[target].shape[1] // 2
    offset = 0 if projection in ("w1", "gate_proj") else intermediate
    return target, params[target].data[expert, offset : offset + intermediate]
