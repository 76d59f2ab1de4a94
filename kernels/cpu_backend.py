"""The CPU production backend: the torch backend plus native kernels where they win.

Decode attention is the one op where plain PyTorch on a CPU does avoidable
work: it must gather every sequence's pages into a padded contiguous copy
before one fused attention call reads them again. The native kernel
(``paged_attention_cpu.c``) reads keys and values in place from their pages,
once per sequence and kv head, with the query heads of a GQA group sharing
each read. Everything else is the torch backend's (its packed matmuls
included). Calls the native kernel does not cover (other dtypes, caches not
on the CPU, a head dim with a non-unit stride) take the torch path.

Prefill attention over cached context (the second chunk of a long prompt,
or new turns after a cached prefix) splits each sequence's keys in two: the
context, which every query sees whole (no mask), and the chunk itself,
causal. Both halves run PyTorch's fused CPU flash attention, which returns
each row's log-sum-exp, and the halves are merged exactly by those. The
torch path instead builds a [queries, keys] boolean mask, which the fused
kernel converts to an additive float mask and applies to every key block,
skipping none of the masked-out ones. Float32 RMS norm is PyTorch's fused
op, and SiLU-and-multiply works in place: both avoid passes over, and fresh
allocations of, prefill-sized activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import DecodeBatch, PrefillBatch
from .native import NativeKernels, load
from .torch_backend import TorchBackend, _gather_tokens, _pages_for


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, kernels: NativeKernels | None = None) -> None:
        native = kernels or load()
        if native is None:
            from .native import unavailable_reason

            raise RuntimeError(f"the cpu kernel backend needs its native kernels: {unavailable_reason()}")
        self.native = native

    def decode_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
    ) -> torch.Tensor:
        if not _native_decode_fits(query, key_cache, value_cache, batch):
            return super().decode_attention(query, key_cache, value_cache, batch, scale)
        num_seqs, num_heads, head_dim = query.shape
        query = query.contiguous()
        page_table = batch.page_table.contiguous()
        seq_lens = batch.seq_lens.contiguous()
        out = torch.empty_like(query)
        status = self.native.paged_decode_attention_f32(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            page_table.data_ptr(),
            page_table.stride(0),
            seq_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            key_cache.shape[2],
            head_dim,
            key_cache.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"native decode attention could not allocate its scores ({num_seqs} sequences)")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32 or weight.dtype != torch.float32:
            return super().rms_norm(x, weight, eps)
        # One fused pass, bit for bit the torch backend's float32 result.
        return torch.rms_norm(x, weight.shape, weight, eps)

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        # In place: a fresh output of prefill size costs more in page faults than the activation itself.
        return F.silu(gate, inplace=True).mul_(up)

    def prefill_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PrefillBatch,
        scale: float,
    ) -> torch.Tensor:
        if query.device.type != "cpu":
            return super().prefill_attention(query, key_cache, value_cache, batch, scale)
        page_size = key_cache.shape[1]
        out = torch.empty_like(query)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_host, batch.seq_lens_host)):
            end = start + query_len
            context_len = seq_len - query_len
            pages = batch.page_table[i, : _pages_for(seq_len, page_size)].long()
            keys = _gather_tokens(key_cache, pages[None], seq_len)[0].transpose(0, 1)[None]  # [1, Hkv, L, D]
            values = _gather_tokens(value_cache, pages[None], seq_len)[0].transpose(0, 1)[None]
            queries = query[start:end].transpose(0, 1)[None]  # [1, H, Q, D]
            chunk, chunk_lse = _flash(queries, keys[:, :, context_len:], values[:, :, context_len:], True, scale)
            if context_len:
                context, context_lse = _flash(
                    queries, keys[:, :, :context_len], values[:, :, :context_len], False, scale
                )
                total_lse = torch.logaddexp(chunk_lse, context_lse)
                chunk = chunk * (chunk_lse - total_lse).exp_()[..., None]
                chunk.addcmul_(context, (context_lse - total_lse).exp_()[..., None])
            out[start:end] = chunk[0].transpose(0, 1)
            start = end
        return out


def _flash(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused CPU attention ([1, H, Q, D] queries, [1, Hkv, K, D] keys/values; causal means query row r sees
    keys 0..r): the output [1, H, Q, D] and each row's log-sum-exp of its scaled scores [1, H, Q]."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, 0.0, is_causal, scale=scale
    )
    return out, lse


def _native_decode_fits(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: DecodeBatch
) -> bool:
    # The C kernel trusts its arguments: anything it cannot read safely takes the torch path.
    tensors = (query, key_cache, value_cache)
    page_table, seq_lens = batch.page_table, batch.seq_lens
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and query.dim() == 3
        and key_cache.dim() == 4
        and key_cache.shape == value_cache.shape
        and key_cache.stride() == value_cache.stride()
        and key_cache.stride(-1) == 1
        and query.shape[2] == key_cache.shape[3]
        and query.shape[1] % key_cache.shape[2] == 0
        and page_table.device.type == "cpu"
        and seq_lens.device.type == "cpu"
        and page_table.dtype == torch.int32
        and seq_lens.dtype == torch.int32
        and page_table.dim() == 2
        and seq_lens.shape == (query.shape[0],)
        and page_table.shape[0] == query.shape[0]
        and max(batch.seq_lens_host, default=0) <= page_table.shape[1] * key_cache.shape[1]
    )
