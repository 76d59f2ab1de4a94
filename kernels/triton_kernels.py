"""Triton kernels behind ``TritonBackend``: one ``@triton.jit`` function per op.

This module holds the element-wise and copying ops (norm, rotary, activation,
the cache writes and page copies); ``triton_attention`` holds the paged
attention kernels. Each kernel takes every stride explicitly, so strided
views such as the per-layer cache view ``kv_cache[:, layer, 0]`` are read and
written in place.

``TRITON_INTERPRET=1`` must be set before this module is imported to run the
kernels on CPU tensors: ``triton.jit`` reads it when the kernels are defined.
Importing this module never fails for lack of Triton (``TRITON_IMPORT_ERROR``
says why); launching a kernel then does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    TRITON_IMPORT_ERROR: ImportError | None = exc
else:
    TRITON_IMPORT_ERROR = None


def jit_if_available(fn: Callable[..., Any] | None = None, *, do_not_specialize: tuple[str, ...] = ()) -> Any:
    """``triton.jit`` when Triton is importable; otherwise the plain function, never launched.

    Triton compiles a kernel once per launch signature, and an integer argument's value is part of it (whether
    it is 1, whether it divides by 16). ``do_not_specialize`` names the arguments that change from step to
    step (a batch's page-table width, a token count): without it, a request whose batch meets a new class of
    value would wait on a compile in the middle of serving.
    """

    def decorate(fn: Callable[..., Any]) -> Any:
        if TRITON_IMPORT_ERROR is not None:  # pragma: no cover
            return fn
        return triton.jit(fn, do_not_specialize=do_not_specialize or None)

    return decorate if fn is None else decorate(fn)


@jit_if_available
def rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    x_col_stride,
    out_row_stride,
    hidden_size,
    eps,
    BLOCK_SIZE: tl.constexpr,
):
    """One program normalises one row of ``hidden_size`` elements (``BLOCK_SIZE >= hidden_size``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_row_stride + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = x * tl.rsqrt(variance + eps)
    # The reference rounds to the input dtype before applying the weight.
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, normed * weight, mask=mask)


@jit_if_available
def rotary_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    positions_ptr,
    cos_sin_ptr,
    x_token_stride,
    x_head_stride,
    x_dim_stride,
    out_token_stride,
    out_head_stride,
    cos_sin_stride,
    num_heads,
    half_dim,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program rotates every head of one token (neox style: the two halves of head_dim form the pairs)."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half_dim
    cos_row = cos_sin_ptr + position * cos_sin_stride
    cos = tl.load(cos_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_row + half_dim + dims, mask=dim_mask, other=0.0).to(tl.float32)

    heads = tl.arange(0, BLOCK_HEADS)
    mask = (heads < num_heads)[:, None] & dim_mask[None, :]
    x_first = x_ptr + token * x_token_stride + heads[:, None] * x_head_stride + dims[None, :] * x_dim_stride
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_first + half_dim * x_dim_stride, mask=mask, other=0.0).to(tl.float32)
    out_first = out_ptr + token * out_token_stride + heads[:, None] * out_head_stride + dims[None, :]
    tl.store(out_first, x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(out_first + half_dim, x2 * cos[None, :] + x1 * sin[None, :], mask=mask)


@jit_if_available
def silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    gate_ptr,
    up_ptr,
    out_ptr,
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    size,
    BLOCK_SIZE: tl.constexpr,
):
    """One program computes ``BLOCK_SIZE`` outputs of one row: ``silu(gate) * up``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < size
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, gate * tl.sigmoid(gate) * up, mask=mask)


@jit_if_available
def write_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    key_head_stride,
    key_dim_stride,
    value_token_stride,
    value_head_stride,
    value_dim_stride,
    cache_page_stride,
    cache_slot_stride,
    cache_head_stride,
    cache_dim_stride,
    page_size,
    num_kv_heads,
    head_dim,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """One program stores the key and value of one token (all kv heads) in its cache slot.

    Negative slots mark padding tokens and are skipped.
    """
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # int64: page_id * cache_page_stride overflows int32 on large caches.
    page_id = slot // page_size
    offset_in_page = slot % page_size
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_DIM)
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]

    key = tl.load(
        key_ptr + token * key_token_stride + heads[:, None] * key_head_stride + dims[None, :] * key_dim_stride,
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * value_token_stride + heads[:, None] * value_head_stride + dims[None, :] * value_dim_stride,
        mask=mask,
    )
    cache_offsets = (
        page_id * cache_page_stride
        + offset_in_page * cache_slot_stride
        + heads[:, None] * cache_head_stride
        + dims[None, :] * cache_dim_stride
    )
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


@jit_if_available
def gather_pages_kernel(  # type: ignore[no-untyped-def]
    cache_ptr,
    out_ptr,
    page_ids_ptr,
    cache_page_stride,
    page_numel,
    BLOCK_SIZE: tl.constexpr,
):
    """One program copies ``BLOCK_SIZE`` elements of cache page ``page_ids[i]`` into row i of ``out``."""
    index = tl.program_id(0).to(tl.int64)
    elements = tl.program_id(1).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = elements < page_numel
    page_id = tl.load(page_ids_ptr + index).to(tl.int64)
    data = tl.load(cache_ptr + page_id * cache_page_stride + elements, mask=mask)
    tl.store(out_ptr + index * page_numel + elements, data, mask=mask)


@jit_if_available
def scatter_pages_kernel(  # type: ignore[no-untyped-def]
    src_ptr,
    cache_ptr,
    page_ids_ptr,
    cache_page_stride,
    page_numel,
    BLOCK_SIZE: tl.constexpr,
):
    """One program copies ``BLOCK_SIZE`` elements of row i of ``src`` into cache page ``page_ids[i]``."""
    index = tl.program_id(0).to(tl.int64)
    elements = tl.program_id(1).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = elements < page_numel
    page_id = tl.load(page_ids_ptr + index).to(tl.int64)
    data = tl.load(src_ptr + index * page_numel + elements, mask=mask)
    tl.store(cache_ptr + page_id * cache_page_stride + elements, data, mask=mask)


def interpreted() -> bool:
    """Whether the kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1``): they then run
    on CPU tensors and compile nothing."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(rms_norm_kernel, InterpretedFunction)
