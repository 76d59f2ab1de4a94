"""A mixture-of-experts layer's token permutation and un-permutation in native code.

Around a decode step's expert matmuls, the torch reference (``moe.permute_by_expert``, the row gather and
``moe.unpermute``) is a dozen small ops: a stable argsort, a bincount, an index division, a gather, a
weighted ``index_add_``. Natively it is a counting sort with the rows copied in the same pass, and one pass
per token summing its experts' rows. Both give the reference's result bit for bit: rows in the same order,
and each token's weighted rows summed from zero in the same order (its experts in increasing id, as the
grouped rows lie), each product rounded before its add.
"""

from __future__ import annotations

import torch

from .native import NativeKernels

_SERIAL_ROWS = 256  # under this many rows one thread: a parallel region costs more than the copies


def native_moe_fits(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether the native permutation takes a MoE layer's input ``x`` with experts ``gate_up``."""
    return (
        x.dtype is gate_up.dtype is torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[0] > 0 and x.stride(-1) == 1
    )


def permute(
    native: NativeKernels, x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Each (token, slot) choice of ``expert_ids`` [num_tokens, top_k] as a row of its token's ``x``, grouped
    by expert (token order within): the rows, the flat choice behind each row, and the group sizes."""
    num_tokens, top_k = expert_ids.shape
    expert_ids = expert_ids.to(torch.int64).contiguous()
    group_sizes = torch.empty(num_experts, dtype=torch.int64)
    slot_index = torch.empty(num_tokens * top_k, dtype=torch.int64)
    rows = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype)
    status = native.moe_permute_f32(
        x.data_ptr(), x.stride(0), expert_ids.data_ptr(), num_tokens, top_k, num_experts, x.shape[1],
        group_sizes.data_ptr(), slot_index.data_ptr(), rows.data_ptr(), _threads(rows.shape[0]),
    )  # fmt: skip
    if status == -1:
        bad = expert_ids[(expert_ids < 0) | (expert_ids >= num_experts)][0]
        raise ValueError(f"expert id {int(bad)} is outside the layer's experts 0..{num_experts - 1}")
    if status != 0:
        raise MemoryError("native MoE permutation could not allocate its counts")
    return rows, slot_index, tuple(group_sizes.tolist())


def unpermute(
    native: NativeKernels, expert_out: torch.Tensor, slot_index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each token's rows of ``expert_out`` (as ``permute`` laid them out) summed, weighted by its routing
    ``weights`` [num_tokens, top_k]: [num_tokens, hidden]."""
    num_tokens, top_k = weights.shape
    expert_out = expert_out.contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, expert_out.shape[1], dtype=torch.float32)
    status = native.moe_unpermute_f32(
        expert_out.data_ptr(), slot_index.data_ptr(), weights.data_ptr(), num_tokens, top_k, expert_out.shape[1],
        out.data_ptr(), _threads(expert_out.shape[0]),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("native MoE un-permutation could not allocate its row order")
    return out


def _threads(rows: int) -> int:
    return 1 if rows < _SERIAL_ROWS else torch.get_num_threads()
