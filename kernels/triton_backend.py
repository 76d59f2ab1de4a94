"""The Triton backend: one ``@triton.jit`` kernel per op of ``KernelBackend``.

Design, briefly:

* Each op is a small Python wrapper (checks shapes, reads strides, picks block
  sizes, launches) around one kernel. Kernels take every stride explicitly, so
  strided views such as the per-layer cache view ``kv_cache[:, layer, 0]`` are
  read and written in place, without copies.
* The attention kernels read keys and values token by token through the page
  table (``slot = page_table[pos // page_size] * page_size + pos % page_size``),
  so a key block may span several pages and block sizes do not depend on
  ``page_size``. Softmax is computed online (running max and sum, base 2) and
  everything accumulates in float32.
* Decode runs one program per (sequence, kv head): the query heads that share a
  kv head (GQA) form one tile, padded to 16 rows because ``tl.dot`` needs at
  least 16 rows on GPUs, so each cached page is read once per kv head.
  Prefill runs one program per (sequence, block of query rows, query head).
* float32 matmuls use ``input_precision="ieee"``: TF32 would lose the
  agreement with the reference backend that the tests check.
* Runs natively on CUDA and ROCm, and on CPU tensors under the Triton
  interpreter (``TRITON_INTERPRET=1``, which must be set before this module is
  imported, since ``triton.jit`` reads it when the kernels are decorated).
* Importing this module never fails for lack of Triton; constructing
  ``TritonBackend`` does, with a clear ``RuntimeError``, so the registry can
  report why the backend is unavailable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .backend import DecodeBatch, KernelBackend, PrefillBatch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without triton
    _TRITON_IMPORT_ERROR: ImportError | None = exc
else:
    _TRITON_IMPORT_ERROR = None

_LOG2_E = math.log2(math.e)
# tl.dot needs at least 16 rows (and columns) on GPUs.
_MIN_DOT_SIZE = 16


def _jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` when Triton is importable; otherwise the plain function, never launched."""
    if _TRITON_IMPORT_ERROR is not None:  # pragma: no cover
        return fn
    return triton.jit(fn)


# --------------------------------------------------------------------------- kernels


@_jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
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


@_jit
def _rotary_kernel(  # type: ignore[no-untyped-def]
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


@_jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    x_row_stride,
    x_col_stride,
    out_row_stride,
    half_size,
    BLOCK_SIZE: tl.constexpr,
):
    """One program computes ``BLOCK_SIZE`` outputs of one row: ``silu(gate) * up``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < half_size
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + (half_size + cols) * x_col_stride, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, gate * tl.sigmoid(gate) * up, mask=mask)


@_jit
def _write_kv_kernel(  # type: ignore[no-untyped-def]
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


@_jit
def _paged_token_offsets(  # type: ignore[no-untyped-def]
    page_table_row_ptr, key_positions, key_mask, page_size, cache_page_stride, cache_slot_stride
):
    """Element offsets in a cache view of the tokens at ``key_positions`` of one sequence (0 where masked)."""
    page_ids = tl.load(page_table_row_ptr + key_positions // page_size, mask=key_mask, other=0).to(tl.int64)
    return page_ids * cache_page_stride + (key_positions % page_size).to(tl.int64) * cache_slot_stride


@_jit
def _decode_attention_kernel(  # type: ignore[no-untyped-def]
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
        token_offsets = _paged_token_offsets(
            page_table_row, key_positions, key_mask, page_size, cache_page_stride, cache_slot_stride
        )
        tile_offsets = token_offsets[:, None] + head_offsets
        keys = tl.load(key_cache_ptr + tile_offsets, mask=key_mask[:, None], other=0.0)
        values = tl.load(value_cache_ptr + tile_offsets, mask=key_mask[:, None], other=0.0)

        scores = tl.dot(query, tl.trans(keys.to(query.dtype)), input_precision=DOT_PRECISION) * qk_scale_log2
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
        running_max = new_max

    # seq_len 0 (a padding sequence) leaves running_sum 0: write zeros, not NaN.
    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    tl.store(
        out_ptr + seq * out_seq_stride + heads[:, None] * out_head_stride + dims[None, :],
        out,
        mask=group_mask[:, None],
    )


@_jit
def _prefill_attention_kernel(  # type: ignore[no-untyped-def]
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
        token_offsets = _paged_token_offsets(
            page_table_row, key_positions, key_mask, page_size, cache_page_stride, cache_slot_stride
        )
        tile_offsets = token_offsets[:, None] + head_offsets
        keys = tl.load(key_cache_ptr + tile_offsets, mask=key_mask[:, None], other=0.0)
        values = tl.load(value_cache_ptr + tile_offsets, mask=key_mask[:, None], other=0.0)

        scores = tl.dot(query, tl.trans(keys.to(query.dtype)), input_precision=DOT_PRECISION) * qk_scale_log2
        visible = key_mask[None, :] & (key_positions[None, :] <= query_positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
        running_max = new_max

    # Key 0 is visible to every row, so running_sum > 0.
    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + row_offsets[:, None] * out_token_stride + head * out_head_stride + dims[None, :],
        out,
        mask=row_mask[:, None],
    )


@_jit
def _gather_pages_kernel(  # type: ignore[no-untyped-def]
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


@_jit
def _scatter_pages_kernel(  # type: ignore[no-untyped-def]
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


# --------------------------------------------------------------------------- wrappers


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _dot_precision(dtype: torch.dtype) -> str | None:
    """IEEE float32 matmuls; 16-bit inputs keep the target's default."""
    return "ieee" if dtype == torch.float32 else None


def _check_kv_views(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Key and value views of one cache share shape and strides; the kernels take one set of strides."""
    if key_cache.dim() != 4:
        raise ValueError(f"cache views must be [num_pages, page_size, num_kv_heads, head_dim], got {key_cache.shape}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(
            "key and value cache views must have equal shapes and strides, got "
            f"{tuple(key_cache.shape)}/{key_cache.stride()} and {tuple(value_cache.shape)}/{value_cache.stride()}"
        )


def _check_head_dim(head_dim: int) -> None:
    if head_dim < _MIN_DOT_SIZE or head_dim & (head_dim - 1):
        raise ValueError(f"attention head_dim must be a power of two >= {_MIN_DOT_SIZE}, got {head_dim}")


def _check_pages(kv_cache: torch.Tensor, pages: torch.Tensor, num_pages: int) -> int:
    """Elements in one page; a page must be contiguous and ``pages`` a contiguous [num_pages, *page_shape] buffer."""
    page_shape = tuple(kv_cache.shape[1:])
    if kv_cache.shape[0] > 0 and not kv_cache[0].is_contiguous():
        raise ValueError("each page kv_cache[p] must be contiguous")
    if tuple(pages.shape) != (num_pages, *page_shape) or not pages.is_contiguous():
        raise ValueError(f"page buffer must be contiguous [{num_pages}, *{page_shape}], got {tuple(pages.shape)}")
    return math.prod(page_shape)


class TritonBackend(KernelBackend):
    """Triton kernels for every op; see the module docstring for the design."""

    name = "triton"

    def __init__(self) -> None:
        if _TRITON_IMPORT_ERROR is not None:
            raise RuntimeError(
                f"the triton kernel backend needs the `triton` package, which failed to import ({_TRITON_IMPORT_ERROR})"
            ) from _TRITON_IMPORT_ERROR

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        hidden_size = x.shape[-1]
        rows = x.reshape(-1, hidden_size)
        # Same result dtype as the reference's ``weight * normed.to(x.dtype)``.
        out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        if rows.numel() > 0:
            block_size = _next_power_of_2(hidden_size)
            _rms_norm_kernel[(rows.shape[0],)](
                rows,
                weight.contiguous(),
                out,
                rows.stride(0),
                rows.stride(1),
                out.stride(0),
                hidden_size,
                eps,
                BLOCK_SIZE=block_size,
                num_warps=_elementwise_warps(block_size),
            )
        return out.reshape(x.shape)

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = positions.to(query.device)
        cos_sin_cache = cos_sin_cache.contiguous()
        return (
            self._rotate(positions, query, cos_sin_cache),
            self._rotate(positions, key, cos_sin_cache),
        )

    def _rotate(self, positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        num_tokens, num_heads, head_dim = x.shape
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
        if num_tokens == 0:
            return out
        _rotary_kernel[(num_tokens,)](
            x,
            out,
            positions,
            cos_sin_cache,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            out.stride(0),
            out.stride(1),
            cos_sin_cache.stride(0),
            num_heads,
            head_dim // 2,
            BLOCK_HEADS=_next_power_of_2(num_heads),
            BLOCK_HALF=_next_power_of_2(head_dim // 2),
        )
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        half_size = x.shape[-1] // 2
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty((rows.shape[0], half_size), dtype=x.dtype, device=x.device)
        if out.numel() > 0:
            block_size = min(_next_power_of_2(half_size), 1024)
            grid = (rows.shape[0], triton.cdiv(half_size, block_size))
            _silu_and_mul_kernel[grid](
                rows,
                out,
                rows.stride(0),
                rows.stride(1),
                out.stride(0),
                half_size,
                BLOCK_SIZE=block_size,
                num_warps=_elementwise_warps(block_size),
            )
        return out.reshape(*x.shape[:-1], half_size)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        _check_kv_views(key_cache, value_cache)
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        page_size = key_cache.shape[1]
        _write_kv_kernel[(num_tokens,)](
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping.to(key_cache.device),
            *key.stride(),
            *value.stride(),
            *key_cache.stride(),
            page_size,
            num_kv_heads,
            head_dim,
            BLOCK_HEADS=_next_power_of_2(num_kv_heads),
            BLOCK_DIM=_next_power_of_2(head_dim),
        )

    def decode_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
    ) -> torch.Tensor:
        _check_kv_views(key_cache, value_cache)
        num_seqs, num_heads, head_dim = query.shape
        _check_head_dim(head_dim)
        page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        queries_per_kv = _queries_per_kv(num_heads, num_kv_heads)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous: unit dim stride
        if num_seqs == 0:
            return out
        on_gpu = query.device.type == "cuda"
        page_table = batch.page_table
        _decode_attention_kernel[(num_seqs, num_kv_heads)](
            query,
            key_cache,
            value_cache,
            out,
            page_table,
            batch.seq_lens,
            scale * _LOG2_E,
            *query.stride(),
            out.stride(0),
            out.stride(1),
            *key_cache.stride(),
            page_table.stride(0),
            page_size,
            QUERIES_PER_KV=queries_per_kv,
            HEAD_DIM=head_dim,
            BLOCK_GROUP=max(_MIN_DOT_SIZE, _next_power_of_2(queries_per_kv)),
            BLOCK_KEYS=64 if on_gpu else 16,
            DOT_PRECISION=_dot_precision(query.dtype),
        )
        return out

    def prefill_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PrefillBatch,
        scale: float,
    ) -> torch.Tensor:
        _check_kv_views(key_cache, value_cache)
        num_tokens, num_heads, head_dim = query.shape
        _check_head_dim(head_dim)
        page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        queries_per_kv = _queries_per_kv(num_heads, num_kv_heads)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous: unit dim stride
        num_seqs = batch.page_table.shape[0]
        if num_tokens == 0 or num_seqs == 0 or batch.max_query_len == 0:
            return out
        block_queries, block_keys = _prefill_blocks(query)
        grid = (num_seqs, triton.cdiv(batch.max_query_len, block_queries), num_heads)
        page_table = batch.page_table
        _prefill_attention_kernel[grid](
            query,
            key_cache,
            value_cache,
            out,
            page_table,
            batch.query_start_loc,
            batch.context_lens,
            scale * _LOG2_E,
            *query.stride(),
            out.stride(0),
            out.stride(1),
            *key_cache.stride(),
            page_table.stride(0),
            page_size,
            QUERIES_PER_KV=queries_per_kv,
            HEAD_DIM=head_dim,
            BLOCK_QUERIES=block_queries,
            BLOCK_KEYS=block_keys,
            DOT_PRECISION=_dot_precision(query.dtype),
        )
        return out

    def gather_pages(self, kv_cache: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        num_pages = page_ids.numel()
        page_numel = _check_pages(kv_cache, out, num_pages)
        if num_pages == 0 or page_numel == 0:
            return
        block_size = min(_next_power_of_2(page_numel), 4096)
        grid = (num_pages, triton.cdiv(page_numel, block_size))
        _gather_pages_kernel[grid](
            kv_cache,
            out,
            page_ids.to(kv_cache.device),
            kv_cache.stride(0),
            page_numel,
            BLOCK_SIZE=block_size,
        )

    def scatter_pages(self, src: torch.Tensor, kv_cache: torch.Tensor, page_ids: torch.Tensor) -> None:
        num_pages = page_ids.numel()
        page_numel = _check_pages(kv_cache, src, num_pages)
        if num_pages == 0 or page_numel == 0:
            return
        block_size = min(_next_power_of_2(page_numel), 4096)
        grid = (num_pages, triton.cdiv(page_numel, block_size))
        _scatter_pages_kernel[grid](
            src,
            kv_cache,
            page_ids.to(kv_cache.device),
            kv_cache.stride(0),
            page_numel,
            BLOCK_SIZE=block_size,
        )


def _queries_per_kv(num_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def _elementwise_warps(block_size: int) -> int:
    """More warps for wider rows, so each thread keeps a handful of elements."""
    return max(1, min(16, block_size // 256))


def _prefill_blocks(query: torch.Tensor) -> tuple[int, int]:
    """(query rows, keys) per tile: large on GPUs; small under the interpreter, where tiles cost numpy time."""
    if query.device.type != "cuda":
        return 16, 16
    # float32 tiles are twice the bytes: halve the key tile to stay within shared memory.
    return (64, 32) if query.dtype == torch.float32 else (64, 64)
