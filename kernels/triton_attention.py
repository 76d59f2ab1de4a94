"""Paged attention in Triton: decode and prefill over the page table, online softmax.

The attention kernels read keys and values token by token through the page
table (``slot = page_table[pos // page_size] * page_size + pos % page_size``),
so block sizes do not depend on ``page_size``; softmax is online (running max
and sum, base 2) and accumulates in float32. Decode runs one program per
(sequence, kv head), the query heads of a kv head forming one tile; prefill
runs one program per (sequence, block of query rows, query head).

Attention sinks start each row's online softmax as if one key with score
``sink`` and a zero value had been seen (running max ``sink``, running sum 1),
so they take their share of the denominator and add nothing. A sliding window
starts the key loop at the block's first visible key, so pages wholly before
the window are never read, and masks keys that fall out of a row's window.

Like ``triton_kernels`` (whose Triton import guard it shares), importing this
module never fails for lack of Triton; launching a kernel then does.
"""

from __future__ import annotations

import math

from .triton_kernels import TRITON_IMPORT_ERROR, jit_if_available

if TRITON_IMPORT_ERROR is None:
    import triton.language as tl

LOG2_E = math.log2(math.e)
# tl.dot needs at least 16 rows (and columns) on GPUs.
MIN_DOT_SIZE = 16


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
def attend_pages(  # type: ignore[no-untyped-def]
    query,
    key_cache_ptr,
    value_cache_ptr,
    page_table_row,
    head_offsets,
    first_key,
    num_keys,
    query_positions,
    window,
    running_max,
    running_sum,
    page_size,
    cache_page_stride,
    cache_slot_stride,
    qk_scale_log2,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The query tile [ROWS, HEAD_DIM] attends to keys ``first_key .. num_keys`` of one sequence's paged cache,
    ``BLOCK_KEYS`` at a time, from the softmax state (``running_max``, ``running_sum``); ``CAUSAL``: row r sees
    only keys up to ``query_positions[r]``; ``WINDOWED``: only keys after ``query_positions[r] - window``.
    Returns the softmax's (running sum, unnormalised output)."""
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for key_start in range(first_key, num_keys, BLOCK_KEYS):
        key_positions = key_start + tl.arange(0, BLOCK_KEYS)
        key_mask = key_positions < num_keys
        token_offsets = paged_token_offsets(
            page_table_row, key_positions, key_mask, page_size, cache_page_stride, cache_slot_stride
        )
        visible = key_mask[None, :]
        if CAUSAL:
            visible = visible & (key_positions[None, :] <= query_positions[:, None])
        if WINDOWED:
            visible = visible & (key_positions[None, :] > query_positions[:, None] - window)
        running_max, running_sum, acc = attend_block(
            query,
            key_cache_ptr,
            value_cache_ptr,
            token_offsets[:, None] + head_offsets,
            key_mask,
            visible,
            running_max,
            running_sum,
            acc,
            qk_scale_log2,
            DOT_PRECISION,
        )
    return running_sum, acc


@jit_if_available
def softmax_start(sinks_log2_ptr, heads, head_mask, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The online softmax's (running max, running sum) before any key: the sink (its logit in base 2,
    ``sinks_log2_ptr[head]``) with weight 1, else nothing."""
    if HAS_SINKS:
        running_max = tl.load(sinks_log2_ptr + heads, mask=head_mask, other=0.0)
        running_sum = tl.full([ROWS], 1.0, dtype=tl.float32)
    else:
        # A finite initial max keeps exp2(old_max - new_max) free of inf - inf.
        running_max = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        running_sum = tl.zeros([ROWS], dtype=tl.float32)
    return running_max, running_sum


@jit_if_available(do_not_specialize=("page_table_stride",))
def decode_attention_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    page_table_ptr,
    seq_lens_ptr,
    sinks_log2_ptr,
    window,
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
    HAS_SINKS: tl.constexpr,
    WINDOWED: tl.constexpr,
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

    # Every row is the sequence's last position; the window (if any) starts the key loop.
    first_key = 0
    if WINDOWED:
        first_key = tl.maximum(seq_len - window, 0)
    running_max, running_sum = softmax_start(sinks_log2_ptr, heads, group_mask, BLOCK_GROUP, HAS_SINKS)
    running_sum, acc = attend_pages(
        query,
        key_cache_ptr,
        value_cache_ptr,
        page_table_row,
        head_offsets,
        first_key,
        seq_len,
        group,
        window,
        running_max,
        running_sum,
        page_size,
        cache_page_stride,
        cache_slot_stride,
        qk_scale_log2,
        BLOCK_GROUP,
        HEAD_DIM,
        BLOCK_KEYS,
        False,
        False,
        DOT_PRECISION,
    )

    # seq_len 0 (a padding sequence) leaves running_sum 0: write zeros, not NaN.
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
        out,
        mask=group_mask[:, None],
    )


@jit_if_available(do_not_specialize=("page_table_stride",))
def prefill_attention_kernel(  # type: ignore[no-untyped-def]
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    page_table_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    sinks_log2_ptr,
    window,
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
    HAS_SINKS: tl.constexpr,
    WINDOWED: tl.constexpr,
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

    # Keys past this block's last row are masked for every row: stop there; keys before its first row's
    # window are masked for every row: start there.
    num_keys = context_len + tl.minimum(first_row + BLOCK_QUERIES, query_len)
    first_key = 0
    if WINDOWED:
        first_key = tl.maximum(context_len + first_row - window + 1, 0)
    heads = tl.zeros([BLOCK_QUERIES], dtype=tl.int32) + head  # every row belongs to this program's one head
    running_max, running_sum = softmax_start(sinks_log2_ptr, heads, row_mask, BLOCK_QUERIES, HAS_SINKS)
    running_sum, acc = attend_pages(
        query,
        key_cache_ptr,
        value_cache_ptr,
        page_table_row,
        head_offsets,
        first_key,
        num_keys,
        query_positions,
        window,
        running_max,
        running_sum,
        page_size,
        cache_page_stride,
        cache_slot_stride,
        qk_scale_log2,
        BLOCK_QUERIES,
        HEAD_DIM,
        BLOCK_KEYS,
        True,
        WINDOWED,
        DOT_PRECISION,
    )

    # A row sees at least its own key, so running_sum > 0; padding rows past the chunk may see none.
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + row_offsets[:, None] * out_token_stride + head * out_head_stride + dims[None, :],
        out,
        mask=row_mask[:, None],
    )
