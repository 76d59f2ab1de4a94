"""The Triton backend: ``KernelBackend`` ops launched as Triton kernels.

Each op is a small wrapper that checks shapes, reads strides, picks block
sizes and launches one kernel from ``triton_kernels`` (attention:
``triton_attention``; the mixture-of-experts MLP: ``triton_moe``). Runs
natively on CUDA and ROCm, and on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, set before import); ``fused_moe`` falls back on the
torch reference on tensors its kernels cannot take.
float32 matmuls use ``input_precision="ieee"``: TF32 would lose the agreement
with the reference backend that the tests check. Constructing ``TritonBackend`` without Triton
raises a clear ``RuntimeError``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import moe, triton_moe
from . import triton_attention as ta
from . import triton_kernels as tk
from .backend import DecodeBatch, KernelBackend, PrefillBatch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A [rows, last] view whose last dim is contiguous (copies only if it is not)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


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
    if head_dim < ta.MIN_DOT_SIZE or head_dim & (head_dim - 1):
        raise ValueError(f"attention head_dim must be a power of two >= {ta.MIN_DOT_SIZE}, got {head_dim}")


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
        if tk.TRITON_IMPORT_ERROR is not None:
            raise RuntimeError(
                "the triton kernel backend needs the `triton` package, "
                f"which failed to import ({tk.TRITON_IMPORT_ERROR})"
            ) from tk.TRITON_IMPORT_ERROR

    def compiles_kernels(self) -> bool:
        return not tk.interpreted()

    def captures_cuda_graphs(self) -> bool:
        return not tk.interpreted()

    def moe_token_counts_to_compile(
        self, num_experts: int, top_k: int, dtype: torch.dtype, device: torch.device, max_tokens: int
    ) -> list[int]:
        return triton_moe.token_counts_for_each_tile(num_experts, top_k, dtype, device, max_tokens)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        hidden_size = x.shape[-1]
        rows = x.reshape(-1, hidden_size)
        # Same result dtype as the reference's ``weight * normed.to(x.dtype)``.
        out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        if rows.numel() > 0:
            block_size = _next_power_of_2(hidden_size)
            tk.rms_norm_kernel[(rows.shape[0],)](
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
        tk.rotary_kernel[(num_tokens,)](
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

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
        size = gate.shape[-1]
        gate_rows, up_rows = _rows(gate), _rows(up)
        out = torch.empty((gate_rows.shape[0], size), dtype=gate.dtype, device=gate.device)
        if out.numel() > 0:
            block_size = min(_next_power_of_2(size), 1024)
            grid = (gate_rows.shape[0], _cdiv(size, block_size))
            tk.silu_and_mul_kernel[grid](
                gate_rows,
                up_rows,
                out,
                gate_rows.stride(0),
                up_rows.stride(0),
                out.stride(0),
                size,
                BLOCK_SIZE=block_size,
                num_warps=_elementwise_warps(block_size),
            )
        return out.reshape(gate.shape)

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
        tk.write_kv_kernel[(num_tokens,)](
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
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
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
        ta.decode_attention_kernel[(num_seqs, num_kv_heads)](
            query,
            key_cache,
            value_cache,
            out,
            page_table,
            batch.seq_lens,
            _sinks_log2(sinks, query),
            sliding_window or 0,
            scale * ta.LOG2_E,
            *query.stride(),
            out.stride(0),
            out.stride(1),
            *key_cache.stride(),
            page_table.stride(0),
            page_size,
            QUERIES_PER_KV=queries_per_kv,
            HEAD_DIM=head_dim,
            BLOCK_GROUP=max(ta.MIN_DOT_SIZE, _next_power_of_2(queries_per_kv)),
            BLOCK_KEYS=64 if on_gpu else 16,
            HAS_SINKS=sinks is not None,
            WINDOWED=sliding_window is not None,
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
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
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
        grid = (num_seqs, _cdiv(batch.max_query_len, block_queries), num_heads)
        page_table = batch.page_table
        ta.prefill_attention_kernel[grid](
            query,
            key_cache,
            value_cache,
            out,
            page_table,
            batch.query_start_loc,
            batch.context_lens,
            _sinks_log2(sinks, query),
            sliding_window or 0,
            scale * ta.LOG2_E,
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
            HAS_SINKS=sinks is not None,
            WINDOWED=sliding_window is not None,
            DOT_PRECISION=_dot_precision(query.dtype),
        )
        return out

    def fused_moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        renormalize: bool,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        activation: moe.ClampedSwiGLU | None = None,
    ) -> torch.Tensor:
        if not triton_moe.kernels_run_on(x.device):
            return super().fused_moe(
                x, router_logits, gate_up, down, top_k, renormalize, gate_up_bias, down_bias, activation
            )
        return triton_moe.fused_moe(
            x, router_logits, gate_up, down, top_k, renormalize, gate_up_bias, down_bias, activation
        )

    def gather_pages(self, kv_cache: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        _copy_pages(tk.gather_pages_kernel, kv_cache, out, kv_cache, page_ids)

    def scatter_pages(self, src: torch.Tensor, kv_cache: torch.Tensor, page_ids: torch.Tensor) -> None:
        _copy_pages(tk.scatter_pages_kernel, src, kv_cache, kv_cache, page_ids)


def _sinks_log2(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """Sink logits in the kernels' base-2 units, float32 and contiguous; without sinks a placeholder the kernels
    never read."""
    if sinks is None:
        return query
    if sinks.shape != (query.shape[1],):
        raise ValueError(f"sinks must be [num_heads] = [{query.shape[1]}], got {tuple(sinks.shape)}")
    return (sinks.to(device=query.device, dtype=torch.float32) * ta.LOG2_E).contiguous()


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


def _copy_pages(
    kernel: Any, src: torch.Tensor, dst: torch.Tensor, kv_cache: torch.Tensor, page_ids: torch.Tensor
) -> None:
    """Launch a whole-page copy between the cache and a contiguous page buffer (either direction)."""
    num_pages = page_ids.numel()
    buffer = dst if src is kv_cache else src
    page_numel = _check_pages(kv_cache, buffer, num_pages)
    if num_pages == 0 or page_numel == 0:
        return
    block_size = min(_next_power_of_2(page_numel), 4096)
    grid = (num_pages, _cdiv(page_numel, block_size))
    kernel[grid](src, dst, page_ids.to(kv_cache.device), kv_cache.stride(0), page_numel, BLOCK_SIZE=block_size)
