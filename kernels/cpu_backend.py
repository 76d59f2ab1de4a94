"""The CPU production backend: the torch backend plus native kernels where they win.

Decode attention is the one op where plain PyTorch on a CPU does avoidable
work: it must gather every sequence's pages into a padded contiguous copy
before one fused attention call reads them again. The native kernel
(``paged_attention_cpu.c``) reads keys and values in place from their pages,
once per sequence and kv head, with the query heads of a GQA group sharing
each read. Everything else is the torch backend's (its packed matmuls
included). Calls the native kernel does not cover (other dtypes, caches not
on the CPU, a head dim with a non-unit stride) take the torch path.
"""

from __future__ import annotations

import torch

from .backend import DecodeBatch
from .native import NativeKernels, load
from .torch_backend import TorchBackend


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
