"""Triton kernels behind ``TritonBackend``: one ``@triton.jit`` function per op.

Each kernel takes every stride explicitly, so strided views such as the
per-layer cache view ``kv_cache[:, layer, 0]`` are read and written in place.
The attention kernels read keys and values token by token through the page
table (``slot = page_table[pos // page_size] * page_size + pos % page_size``),
so block sizes do not depend on ``page_size``; softmax is online (running max
and sum, base 2) and accumulates in float32. Decode runs one program per
(sequence, kv head), the query heads of a kv head forming one tile; prefill
runs one program per (sequence, block of query rows, query head).

``TRITON_INTERPRET=1`` must be set before this module is imported to run the
kernels on CPU tensors: ``triton.jit`` reads it when the kernels are defined.
Importing this module never fails for lack of Triton (``TRITON_IMPORT_ERROR``
says why); launching a kernel then does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    TRITON_IMPORT_ERROR: ImportError | None = exc
else:
    TRITON_IMPORT_ERROR = None

LOG2_E = math.log2(math.e)
# tl.dot needs at least 16 rows (and columns) on GPUs.
MIN_DOT_SIZE = 16


def jit_if_available(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` when Triton is importable; otherwise the plain function, never launched."""
    if TRITON_IMPORT_ERROR is not None:  # pragma: no cover
        return fn
    return triton.jit(fn)


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
def paged_token_offsets(  # type: ignore[no-untyped-def]
    page_table_row_ptr, key_positions, key_mask, page_size, cache_page_stride, cache_slot_stride
):
    """Element offsets in a cache view of the tokens at ``key_positions`` of one sequence (0 where masked)."""
    page_ids = tl.load(page_table_row_ptr + key_positions // page_size, mask=key_mask, other=0).to(tl.int64)
    return page_ids * cache_page_stride + (key_positions % page_size).to(tl.int64) * cache_slot_stride


@jit_if_available
def attend_block(  # type: ignore[no-untyped-def]
    query,
    key_cache_ptr,
    value_cache_ptr,
    tile_offsets,
    key_mask,
    visible,
    running_max,
    running_sum,
    acc,
    qk_scale_log2,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step: fold a block of keys/values into (running max, running sum, acc).

    ``tile_offsets`` [keys, head_dim] locate the block in the cache views;
    ``visible`` [rows, keys] says which query row may see which key.
    """
    keys = tl.load(key_cache_ptr + tile_offsets, mask=key_mask[:, None], other=0.0)
    values = tl.load(value_cache_ptr + tile_offsets, mask=key_mask[:, None], other=0.0)
    scores = tl.dot(query, tl.trans(keys.to(query.dtype)), input_precision=DOT_PRECISION) * qk_scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    probs = tl.exp2(scores - new_max[:, None])
    correction = tl.exp2(running_max - new_max)
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc


@jit_if_available
def decode_attention_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    page_table_ptr,
    seq_lens_ptr,
    qk_scale_log2,
    query_seq_stride,
    query_head_stride,
    query_dim_stride,
    out_seq_stride,
    out_head_stride,
    cache_page_stride,
    cache_slot_stride,
    cache_head_stride,
    cache_dim_stride,
    page_table_stride,
    page_size,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: the query heads of one sequence that share one kv head attend to its whole cache.

    Rows of the query tile are those heads (padded to ``BLOCK_GROUP``); keys
    are visited ``BLOCK_KEYS`` at a time with an online softmax.
    """
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    page_table_row = page_table_ptr + seq * page_table_stride

    group = tl.arange(0, BLOCK_GROUP)
    group_mask = group < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + group
    dims = tl.arange(0, HEAD_DIM)
    query = tl.load(
        query_ptr + seq * query_seq_stride + heads[:, None] * query_head_stride + dims[None, :] * query_dim_stride,
        mask=group_mask[:, None],
        other=0.0,
    )
    head_offsets = kv_head * cache_head_stride + dims[None, :] * cache_dim_stride

    # A finite initial max keeps exp2(old_max - new_max) free of inf - inf.
    running_max = tl.full([BLOCK_GROUP], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_GROUP, HEAD_DIM], dtype=tl.float32)
    for key_start in range(0, seq_len, BLOCK_KEYS):
        key_positions = key_start + tl.arange(0, BLOCK_KEYS)
        key_mask = key_positions < seq_len
        token_offsets = paged_token_offsets(
            page_table_row, key_positions, key_mask, page_size, cache_page_stride, cache_slot_stride
        )
        running_max, running_sum, acc = attend_block(
            query,
            key_cache_ptr,
            value_cache_ptr,
            token_offsets[:, None] + head_offsets,
            key_mask,
            key_mask[None, :],
            running_max,
            running_sum,
            acc,
            qk_scale_log2,
            DOT_PRECISION,
        )

    # seq_len 0 (a padding sequence) leaves running_sum 0: write zeros, not NaN.
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
        out,
        mask=group_mask[:, None],
    )


@jit_if_available
def prefill_attention_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    page_table_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    qk_scale_log2,
    query_token_stride,
    query_head_stride,
    query_dim_stride,
    out_token_stride,
    out_head_stride,
    cache_page_stride,
    cache_slot_stride,
    cache_head_stride,
    cache_dim_stride,
    page_table_stride,
    page_size,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_QUERIES: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_QUERIES`` query rows of one sequence and one head, causal over the paged cache.

    Query row r sits at position ``context_len + r`` and sees keys
    ``0 .. context_len + r``, all read from the cache (the chunk's own keys
    are already written there).
    """
    seq = tl.program_id(0).to(tl.int64)
    query_block = tl.program_id(1)
    head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_row = query_block * BLOCK_QUERIES
    if first_row >= query_len:  # the grid covers the longest chunk; shorter ones end early
        return
    context_len = tl.load(context_lens_ptr + seq)
    kv_head = head // QUERIES_PER_KV
    page_table_row = page_table_ptr + seq * page_table_stride

    rows = first_row + tl.arange(0, BLOCK_QUERIES)
    row_mask = rows < query_len
    query_positions = context_len + rows
    dims = tl.arange(0, HEAD_DIM)
    row_offsets = (query_start + rows).to(tl.int64)
    query = tl.load(
        query_ptr
        + row_offsets[:, None] * query_token_stride
        + head * query_head_stride
        + dims[None, :] * query_dim_stride,
        mask=row_mask[:, None],
        other=0.0,
    )
    head_offsets = kv_head * cache_head_stride + dims[None, :] * cache_dim_stride

    # Keys past this block's last row are masked for every row: stop there.
    num_keys = context_len + tl.minimum(first_row + BLOCK_QUERIES, query_len)
    running_max = tl.full([BLOCK_QUERIES], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_QUERIES], dtype=tl.float32)
    acc = tl.zeros([BLOCK_QUERIES, HEAD_DIM], dtype=tl.float32)
    for key_start in range(0, num_keys, BLOCK_KEYS):
        key_positions = key_start + tl.arange(0, BLOCK_KEYS)
        key_mask = key_positions < num_keys
        token_offsets = paged_token_offsets(
            page_table_row, key_positions, key_mask, page_size, cache_page_stride, cache_slot_stride
        )
        running_max, running_sum, acc = attend_block(
            query,
            key_cache_ptr,
            value_cache_ptr,
            token_offsets[:, None] + head_offsets,
            key_mask,
            key_mask[None, :] & (key_positions[None, :] <= query_positions[:, None]),
            running_max,
            running_sum,
            acc,
            qk_scale_log2,
            DOT_PRECISION,
        )

    # Key 0 is visible to every row, so running_sum > 0.
    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + row_offsets[:, None] * out_token_stride + head * out_head_stride + dims[None, :],
        out,
        mask=row_mask[:, None],
    )


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
