"""What the native CPU kernels take: they trust their arguments, so a call that fails these checks takes the
torch path instead."""

from __future__ import annotations

import torch

from .backend import DecodeBatch, PrefillBatch


def native_sinks_fit(sinks: torch.Tensor | None, query: torch.Tensor) -> bool:
    return sinks is None or (
        sinks.device.type == "cpu" and sinks.dtype == torch.float32 and sinks.shape == (query.shape[1],)
    )


def native_rotary_fits(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> bool:
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (query, key, cos_sin_cache))
        and positions.device.type == "cpu"
        and not positions.is_floating_point()
        and query.dim() == key.dim() == 3
        and query.shape[0] == key.shape[0] == positions.numel()
        and query.shape[2] == key.shape[2] == cos_sin_cache.shape[-1]
        and query.shape[2] % 2 == 0
        and query.stride(-1) == key.stride(-1) == 1
        and cos_sin_cache.dim() == 2
        and cos_sin_cache.is_contiguous()
    )


def native_prefill_fits(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PrefillBatch,
    sinks: torch.Tensor | None,
) -> bool:
    # As for decode, plus the kernel's head dims: multiples of 16 up to 128.
    return (
        native_cache_fits(query, key_cache, value_cache, batch.page_table, batch.seq_lens_host)
        and query.shape[2] % 16 == 0
        and query.shape[2] <= 128
        and sum(batch.query_lens_host) == query.shape[0]
        and native_sinks_fit(sinks, query)
    )


def native_decode_fits(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: DecodeBatch
) -> bool:
    seq_lens = batch.seq_lens
    return (
        native_cache_fits(query, key_cache, value_cache, batch.page_table, batch.seq_lens_host)
        and seq_lens.device.type == "cpu"
        and seq_lens.dtype == torch.int32
        and seq_lens.shape == (query.shape[0],)
        and len(batch.seq_lens_host) == query.shape[0]
    )


def native_cache_fits(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens_host: tuple[int, ...],
) -> bool:
    """What both native attention kernels need: they trust their arguments, so anything they cannot read safely
    takes the torch path (float32 CPU tensors, one page layout for keys and values, unit head-dim stride, whole
    GQA groups, an int32 page table on the CPU with a row per sequence and room for every sequence)."""
    tensors = (query, key_cache, value_cache)
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
        and page_table.dtype == torch.int32
        and page_table.dim() == 2
        and page_table.shape[0] == len(seq_lens_host)
        and max(seq_lens_host, default=0) <= page_table.shape[1] * key_cache.shape[1]
    )
