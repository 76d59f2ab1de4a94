"""The mixture-of-experts MLP in Triton: expert GEMMs over blocks of rows that share one expert.

The reference (``rayturn.kernels.moe``) gathers each expert's rows and runs
one matmul per expert. Here one launch serves every expert::

    router logits --route_top_k--> (weights, expert ids) per token
        --align_to_blocks--> (token, slot) pairs sorted by expert, each expert's
                             run padded to a whole number of BLOCK_ROWS-row blocks
        --expert_gate_up_kernel--> act(x @ gate_up[e].T + bias) per block
        --expert_down_kernel-->    (hidden @ down[e].T + bias) * routing weight,
                                   written to the pair's own row
        --sum over top_k--> one row per token

Every block holds rows of one expert, so a program loads that expert's weight
tiles once for all its rows. Pair ``p`` is token ``p // top_k``'s ``p % top_k``-th
choice, which makes the last step a plain view-sum. Padding rows carry the
pair id ``num_pairs`` and are masked out; blocks past the last expert's carry
expert -1 and return at once. The block count is bounded on the host
(``max_blocks``), so no step waits on the device.

Weights keep the reference layout: ``gate_up`` [num_experts, 2 * intermediate,
hidden] with gate rows first, then up rows; ``down`` [num_experts, hidden,
intermediate]. Products accumulate in float32; the activation is applied in
float32 and rounded to the input dtype once, before the down projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import moe
from .triton_kernels import TRITON_IMPORT_ERROR, interpreted, jit_if_available

if TRITON_IMPORT_ERROR is None:
    import triton.language as tl


@jit_if_available(do_not_specialize=("num_pairs",))
def expert_gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    top_k,
    hidden_size,
    intermediate_size,
    x_row_stride,
    weight_expert_stride,
    weight_row_stride,
    weight_col_stride,
    bias_expert_stride,
    out_row_stride,
    swiglu_alpha,
    swiglu_limit,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_INNER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED_SWIGLU: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_COLS`` hidden-layer columns of one block's rows, ``act(gate, up)``.

    Row r of the block is pair ``sorted_pair_ids[r]``, whose input is token ``pair // top_k``'s row of
    ``x``; the result goes to row r of ``out`` (the block-padded order), which the down kernel reads.
    """
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair_ids = tl.load(sorted_pair_ids_ptr + rows)
    row_mask = pair_ids < num_pairs
    tokens = (pair_ids // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < intermediate_size
    inner = tl.arange(0, BLOCK_INNER)

    x_tile = x_ptr + tokens[:, None] * x_row_stride + inner[None, :]
    # [BLOCK_INNER, BLOCK_COLS] tiles of gate_up[expert].T: gate rows, and the up rows ``intermediate`` below.
    expert_weight = weight_ptr + expert * weight_expert_stride
    gate_tile = expert_weight + cols[None, :] * weight_row_stride + inner[:, None] * weight_col_stride
    up_tile = gate_tile + intermediate_size * weight_row_stride
    gate = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    up = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, hidden_size, BLOCK_INNER):
        inner_mask = inner < hidden_size - start
        x = tl.load(x_tile, mask=row_mask[:, None] & inner_mask[None, :], other=0.0)
        weight_mask = inner_mask[:, None] & col_mask[None, :]
        gate_weight = tl.load(gate_tile, mask=weight_mask, other=0.0)
        up_weight = tl.load(up_tile, mask=weight_mask, other=0.0)
        gate = tl.dot(x, gate_weight, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, up_weight, up, input_precision=DOT_PRECISION)
        x_tile += BLOCK_INNER
        gate_tile += BLOCK_INNER * weight_col_stride
        up_tile += BLOCK_INNER * weight_col_stride

    if HAS_BIAS:
        bias_row = bias_ptr + expert * bias_expert_stride + cols
        gate += tl.load(bias_row, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_row + intermediate_size, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if CLAMPED_SWIGLU:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        hidden = (up + 1.0) * (gate * tl.sigmoid(gate * swiglu_alpha))
    else:
        hidden = gate * tl.sigmoid(gate) * up
    out = out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    tl.store(out, hidden.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@jit_if_available(do_not_specialize=("num_pairs",))
def expert_down_kernel(  # type: ignore[no-untyped-def]
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    routing_weights_ptr,
    out_ptr,
    sorted_pair_ids_ptr,
    block_experts_ptr,
    num_pairs,
    hidden_size,
    intermediate_size,
    hidden_row_stride,
    weight_expert_stride,
    weight_row_stride,
    weight_col_stride,
    bias_expert_stride,
    out_row_stride,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    BLOCK_INNER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_COLS`` output columns of one block's rows, ``(hidden @ down[e].T + bias) * weight``,
    stored in float32 at each row's pair id."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair_ids = tl.load(sorted_pair_ids_ptr + rows)
    row_mask = pair_ids < num_pairs
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < hidden_size
    inner = tl.arange(0, BLOCK_INNER)

    hidden_tile = hidden_ptr + rows.to(tl.int64)[:, None] * hidden_row_stride + inner[None, :]
    expert_weight = weight_ptr + expert * weight_expert_stride
    weight_tile = expert_weight + cols[None, :] * weight_row_stride + inner[:, None] * weight_col_stride
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, intermediate_size, BLOCK_INNER):
        inner_mask = inner < intermediate_size - start
        hidden = tl.load(hidden_tile, mask=row_mask[:, None] & inner_mask[None, :], other=0.0)
        weight = tl.load(weight_tile, mask=inner_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(hidden, weight, acc, input_precision=DOT_PRECISION)
        hidden_tile += BLOCK_INNER
        weight_tile += BLOCK_INNER * weight_col_stride

    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * bias_expert_stride + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    routing_weights = tl.load(routing_weights_ptr + pair_ids, mask=row_mask, other=0.0)
    out = out_ptr + pair_ids.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    tl.store(out, acc * routing_weights[:, None], mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """(token, slot) pairs grouped by expert and padded per expert to whole blocks of ``block_rows``.

    Row r holds pair ``sorted_pair_ids[r]`` (``num_pairs`` on padding rows); block b (rows ``b * block_rows``
    onwards) belongs to expert ``block_experts[b]``, or to none (-1) past the last expert's blocks.
    """

    sorted_pair_ids: torch.Tensor  # [max_blocks * block_rows] int32
    block_experts: torch.Tensor  # [max_blocks] int32
    block_rows: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


def align_to_blocks(expert_ids: torch.Tensor, num_experts: int, block_rows: int) -> ExpertBlocks:
    """Sort the pairs of ``expert_ids`` ([num_tokens, top_k]) by expert (pair order kept within one) into blocks.

    Expert e's ``n`` pairs take ``ceil(n / block_rows)`` blocks, so the blocks number at most
    ``ceil(num_pairs / block_rows) + min(num_experts, num_pairs)``: a bound known without reading the device.
    Nothing here waits on the device.
    """
    flat = expert_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    max_blocks = _cdiv(num_pairs, block_rows) + min(num_experts, num_pairs)
    order = torch.argsort(flat, stable=True)
    # Not bincount: on a GPU it reads the largest id back to size its output, a wait on the device that also
    # forbids recording the step as a CUDA graph.
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_rows - 1) // block_rows * block_rows
    padded_ends = torch.cumsum(padded_counts, dim=0)
    sorted_experts = flat[order]
    # A pair's rank inside its expert's run, placed at that expert's padded start.
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, dim=0) - counts)[sorted_experts]
    positions = (padded_ends - padded_counts)[sorted_experts] + rank
    sorted_pair_ids = torch.full((max_blocks * block_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[positions] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device) * block_rows
    # The expert whose padded run contains the block's first row; empty experts have zero-length runs.
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return ExpertBlocks(sorted_pair_ids, block_experts, block_rows)


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """Tile sizes of both expert kernels: rows per block, output columns and reduction depth per step."""

    block_rows: int
    block_cols: int
    block_inner: int
    num_warps: int


def choose_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype, device: torch.device) -> MoeTiles:
    """Small tiles under the interpreter, where tiles cost numpy time; on GPUs blocks no taller than the
    average expert's run (decode routes a few rows to each expert) and float32 tiles half as deep, to stay
    within shared memory."""
    if device.type != "cuda":
        return MoeTiles(block_rows=16, block_cols=32, block_inner=32, num_warps=1)
    rows_per_expert = num_pairs / num_experts
    block_rows = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    return MoeTiles(block_rows, block_cols=64, block_inner=32 if dtype == torch.float32 else 64, num_warps=4)


def token_counts_for_each_tile(
    num_experts: int, top_k: int, dtype: torch.dtype, device: torch.device, max_tokens: int
) -> list[int]:
    """The fewest tokens, up to ``max_tokens``, at which ``choose_tiles`` picks each of its tile shapes: a
    warm-up that runs the experts at each count compiles every variant the kernels will need."""
    first: dict[MoeTiles, int] = {}
    for num_tokens in range(1, max_tokens + 1):
        first.setdefault(choose_tiles(num_tokens * top_k, num_experts, dtype, device), num_tokens)
    return sorted(first.values())


def kernels_run_on(device: torch.device) -> bool:
    """Whether the expert kernels launch on tensors of ``device``: natively on CUDA and ROCm (torch's "cuda"),
    and on any device's tensors when the kernels were defined under the interpreter."""
    if TRITON_IMPORT_ERROR is not None:
        return False
    return device.type == "cuda" or interpreted()


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: moe.ClampedSwiGLU | None = None,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """``KernelBackend.fused_moe`` with both expert GEMMs in Triton; ``activation`` None is SwiGLU.

    ``tiles`` overrides ``choose_tiles``.
    """
    num_tokens, hidden_size = x.shape
    num_experts, intermediate_size = down.shape[0], down.shape[-1]
    _check_shapes(x, router_logits, gate_up, down, gate_up_bias, down_bias)
    weights, expert_ids = moe.route_top_k(router_logits, top_k, renormalize)
    if num_tokens == 0:
        return torch.empty_like(x)
    num_pairs = num_tokens * top_k
    tiles = tiles or choose_tiles(num_pairs, num_experts, x.dtype, x.device)
    blocks = align_to_blocks(expert_ids, num_experts, tiles.block_rows)
    rows = x if x.stride(-1) == 1 else x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else None

    # Rows in the block-padded order; padding rows are never written nor read.
    hidden = torch.empty((blocks.max_blocks * tiles.block_rows, intermediate_size), dtype=x.dtype, device=x.device)
    expert_gate_up_kernel[(blocks.max_blocks, _cdiv(intermediate_size, tiles.block_cols))](
        rows,
        gate_up,
        gate_up if gate_up_bias is None else gate_up_bias,
        hidden,
        blocks.sorted_pair_ids,
        blocks.block_experts,
        num_pairs,
        top_k,
        hidden_size,
        intermediate_size,
        rows.stride(0),
        *gate_up.stride(),
        0 if gate_up_bias is None else gate_up_bias.stride(0),
        hidden.stride(0),
        0.0 if activation is None else activation.alpha,
        0.0 if activation is None else activation.limit,
        BLOCK_ROWS=tiles.block_rows,
        BLOCK_COLS=tiles.block_cols,
        BLOCK_INNER=tiles.block_inner,
        HAS_BIAS=gate_up_bias is not None,
        CLAMPED_SWIGLU=activation is not None,
        DOT_PRECISION=precision,
        num_warps=tiles.num_warps,
    )

    # One float32 row per pair, pair p = token p // top_k's slot p % top_k: the top-k sum is a view-sum.
    pair_out = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=x.device)
    expert_down_kernel[(blocks.max_blocks, _cdiv(hidden_size, tiles.block_cols))](
        hidden,
        down,
        down if down_bias is None else down_bias,
        weights.reshape(-1).contiguous(),
        pair_out,
        blocks.sorted_pair_ids,
        blocks.block_experts,
        num_pairs,
        hidden_size,
        intermediate_size,
        hidden.stride(0),
        *down.stride(),
        0 if down_bias is None else down_bias.stride(0),
        pair_out.stride(0),
        BLOCK_ROWS=tiles.block_rows,
        BLOCK_COLS=tiles.block_cols,
        BLOCK_INNER=tiles.block_inner,
        HAS_BIAS=down_bias is not None,
        DOT_PRECISION=precision,
        num_warps=tiles.num_warps,
    )
    return pair_out.view(num_tokens, top_k, hidden_size).sum(dim=1).to(x.dtype)


def _check_shapes(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> None:
    """The reference's layout, one dtype for the GEMM operands, and contiguous bias rows."""
    num_tokens, hidden_size = x.shape
    num_experts, intermediate_size = down.shape[0], down.shape[-1]
    expected = {
        "router_logits": (router_logits, (num_tokens, num_experts)),
        "gate_up": (gate_up, (num_experts, 2 * intermediate_size, hidden_size)),
        "down": (down, (num_experts, hidden_size, intermediate_size)),
        "gate_up_bias": (gate_up_bias, (num_experts, 2 * intermediate_size)),
        "down_bias": (down_bias, (num_experts, hidden_size)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(tensor.shape)}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"expert weights must have the dtype of x ({x.dtype}), got {gate_up.dtype} and {down.dtype}")
    for name, bias in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if bias is not None and bias.stride(-1) != 1:
            raise ValueError(f"{name} rows must be contiguous")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
