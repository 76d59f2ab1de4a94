"""GPT-OSS's mixture-of-experts block and the layout of its expert tensors in checkpoints.

The block differs from Mixtral's (``moe.SparseMoeBlock``) in three ways: the
router (``mlp.router``) has a bias; every expert projection has one too; and
experts apply a clamped SwiGLU (``ClampedSwiGLU``). Routing is the top-k of
the router's logits softmaxed among themselves, which is the top-k of the
softmax over all experts renormalised to sum to 1.

Hugging Face keeps GPT-OSS experts as ``gate_up_proj`` [num_experts, hidden,
2 * intermediate] with gate and up columns interleaved (gate at even, up at
odd indices) and ``down_proj`` [num_experts, intermediate, hidden], inputs
first; ``checkpoint_tensors`` turns them (and the gate/up bias) into the
engine's layout (``moe.Experts``: outputs first, gate rows then up rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from rayturn.kernels import KernelBackend

from .config import ModelConfig
from .moe import Experts


class GptOssMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, backend: KernelBackend, router: nn.Module) -> None:
        super().__init__()
        self.backend = backend
        self.top_k = config.num_experts_per_tok
        self.activation = config.expert_activation
        self.router = router
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        return self.backend.fused_moe(
            x,
            self.router(x),
            experts.gate_up_proj,
            experts.down_proj,
            self.top_k,
            True,
            experts.gate_up_proj_bias,
            experts.down_proj_bias,
            self.activation,
        )


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with GPT-OSS's expert projections in the engine's layout."""
    for name, tensor in weights:
        if name.endswith(".mlp.experts.gate_up_proj"):
            yield name, _gate_rows_then_up_rows(tensor.transpose(-2, -1))
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            yield name, _gate_rows_then_up_rows(tensor)
        elif name.endswith(".mlp.experts.down_proj"):
            yield name, tensor.transpose(-2, -1)
        else:
            yield name, tensor


def _gate_rows_then_up_rows(interleaved: torch.Tensor) -> torch.Tensor:
    """[num_experts, 2 * intermediate, ...] with gate and up interleaved along dim 1 -> gate rows, then up rows."""
    return torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1)
