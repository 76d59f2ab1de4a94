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

Prefill attention without a sliding window runs natively too where the
library was built for AVX-512: each chunk's keys are copied transposed once,
then sixteen query rows (a GQA group's heads at consecutive positions) go
over each block of keys together, with an online softmax, reading values in
place from their pages. The tiles are made for AVX-512's 32 registers; on AVX2
(16) they spill (6.4 against PyTorch flash's 45 GFLOP/s on 4,096 tokens, Zen 1),
so there prefill stays on the torch path (``native_prefill``, ``describe``).
Mixture-of-experts layers use a native grouped matmul while experts meet few rows each (a decode
step): each expert's weight is read once, sixteen outputs at a time; torch's makes a call per expert.

Sinks and sliding windows: the native decode kernel takes both, starting at
the window's first token so earlier pages are never read. Windowed prefill
gathers only the pages from the chunk's first window on and runs one fused
call with an additive mask (a row's window bounds it on both sides); sinks
join afterwards through each row's log-sum-exp: the output is scaled by
``sum / (sum + exp(sink)) = sigmoid(lse - sink)``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from . import moe
from .backend import DecodeBatch, PrefillBatch
from .native import NativeKernels, load
from .torch_backend import TorchBackend, _gather_tokens, _pages_for, first_window_key, visible_keys

# Up to this many rows per expert on average, the native grouped matmul beats torch's (2.8x at 4 rows, as
# fast at 64, on a 16-expert layer of hidden 256); prefill-sized groups go to torch's.
_NATIVE_MOE_ROWS_PER_EXPERT = 32
NATIVE_PREFILL_MIN_VECTOR_BITS = 512  # prefill attention runs natively from this vector width on (AVX-512)


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, kernels: NativeKernels | None = None, native_prefill: bool | None = None) -> None:
        """``native_prefill``: whether prefill attention runs the native kernel (default: where the library was
        built for AVX-512, :data:`NATIVE_PREFILL_MIN_VECTOR_BITS`)."""
        native = kernels or load()
        if native is None:
            from .native import unavailable_reason

            raise RuntimeError(f"the cpu kernel backend needs its native kernels: {unavailable_reason()}")
        self.native = native
        if native_prefill is None:
            native_prefill = native.vector_bits >= NATIVE_PREFILL_MIN_VECTOR_BITS
        self.native_prefill = native_prefill

    def describe(self) -> str:
        prefill = "native" if self.native_prefill else "torch flash"
        return f"{self.native.vector_bits}-bit vectors, prefill attention {prefill}"

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
        if not _native_decode_fits(query, key_cache, value_cache, batch) or not _native_sinks_fit(sinks, query):
            return super().decode_attention(query, key_cache, value_cache, batch, scale, sinks, sliding_window)
        num_seqs, num_heads, head_dim = query.shape
        query = query.contiguous()
        page_table = batch.page_table.contiguous()
        seq_lens = batch.seq_lens.contiguous()
        sinks = None if sinks is None else sinks.contiguous()
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
            None if sinks is None else sinks.data_ptr(),
            sliding_window or 0,
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

    def grouped_matmul(self, rows: torch.Tensor, weight: torch.Tensor, group_sizes: tuple[int, ...]) -> torch.Tensor:
        """The native kernel where experts meet few rows each (a decode step: each expert's weight read once,
        not once per matmul call), torch's grouped matmul otherwise."""
        num_experts, out_features, in_features = weight.shape
        if not (
            rows.dtype == weight.dtype == torch.float32
            and rows.device.type == weight.device.type == "cpu"
            and rows.dim() == 2
            and rows.shape[1] == in_features
            and in_features % 16 == 0
            and weight.is_contiguous()
            and len(group_sizes) == num_experts
            and sum(group_sizes) == rows.shape[0]
            and rows.shape[0] <= _NATIVE_MOE_ROWS_PER_EXPERT * num_experts
        ):
            return moe.grouped_matmul(rows, weight, group_sizes)
        rows = rows.contiguous()
        ends = torch.tensor(list(itertools.accumulate(group_sizes)), dtype=torch.int64)
        out = torch.empty(rows.shape[0], out_features, dtype=rows.dtype)
        status = self.native.grouped_matmul_f32(
            rows.data_ptr(),
            weight.data_ptr(),
            ends.data_ptr(),
            out.data_ptr(),
            num_experts,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"native grouped matmul refused in_features={in_features}")
        return out

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One pass per tensor, where the torch backend's takes six (and their temporaries).
        if not _native_rotary_fits(positions, query, key, cos_sin_cache):
            return super().rotary_embedding(positions, query, key, cos_sin_cache)
        positions = positions.to(torch.int64).contiguous()
        return self._rotate(query, positions, cos_sin_cache), self._rotate(key, positions, cos_sin_cache)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype)
        status = self.native.rotary_neox_f32(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            out.data_ptr(),
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            cos_sin_cache.shape[0],
            x.shape[0],
            x.shape[1],
            x.shape[2],
            torch.get_num_threads(),
        )
        if status != 0:
            raise IndexError(f"a position outside the rotary cache's {cos_sin_cache.shape[0]} positions")
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
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if query.device.type != "cpu":
            return super().prefill_attention(query, key_cache, value_cache, batch, scale, sinks, sliding_window)
        if (
            self.native_prefill
            and sliding_window is None
            and _native_prefill_fits(query, key_cache, value_cache, batch, sinks)
        ):
            return self._native_prefill(query, key_cache, value_cache, batch, scale, sinks)
        page_size = key_cache.shape[1]
        out = torch.empty_like(query)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_host, batch.seq_lens_host)):
            end = start + query_len
            context_len = seq_len - query_len
            first_page = first_window_key(context_len, sliding_window) // page_size
            first_key = first_page * page_size
            pages = batch.page_table[i, first_page : _pages_for(seq_len, page_size)].long()
            num_keys = seq_len - first_key
            keys = _gather_tokens(key_cache, pages[None], num_keys)[0].transpose(0, 1)[None]  # [1, Hkv, L, D]
            values = _gather_tokens(value_cache, pages[None], num_keys)[0].transpose(0, 1)[None]
            queries = query[start:end].transpose(0, 1)[None]  # [1, H, Q, D]
            if sliding_window is None:
                attn, lse = _causal_over_context(queries, keys, values, context_len, scale)
            else:
                # Which keys a row sees depends on the row at both ends: one masked call over the window's pages.
                key_pos = torch.arange(first_key, seq_len)
                query_pos = torch.arange(context_len, seq_len)
                visible = visible_keys(query_pos, key_pos, sliding_window)
                mask = torch.zeros(visible.shape, dtype=query.dtype).masked_fill_(~visible, float("-inf"))
                attn, lse = _flash(queries, keys, values, False, scale, mask)
            if sinks is not None:
                # The sink joins the denominator only: rescale by sum / (sum + exp(sink)).
                attn = attn * torch.sigmoid(lse - sinks.view(1, -1, 1))[..., None].to(attn.dtype)
            out[start:end] = attn[0].transpose(0, 1)
            start = end
        return out

    def _native_prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: PrefillBatch,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each sequence's chunk through the native kernel, keys and values read from their pages in place."""
        query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        num_heads, head_dim = query.shape[1], query.shape[2]
        page_table = batch.page_table.contiguous()
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_host, batch.seq_lens_host)):
            end = start + query_len
            lse = None if sinks is None else torch.empty(num_heads, query_len, dtype=torch.float32)
            status = self.native.paged_prefill_attention_f32(
                query[start:end].data_ptr(),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                key_cache.stride(0),
                key_cache.stride(1),
                key_cache.stride(2),
                page_table[i].data_ptr(),
                seq_len - query_len,
                query_len,
                out[start:end].data_ptr(),
                None if lse is None else lse.data_ptr(),
                num_heads,
                key_cache.shape[2],
                head_dim,
                key_cache.shape[1],
                scale,
                torch.get_num_threads(),
            )
            if status != 0:
                raise MemoryError(f"native prefill attention could not allocate its buffers ({seq_len} keys)")
            if sinks is not None and lse is not None:
                # The sink joins the denominator only: rescale by sum / (sum + exp(sink)).
                out[start:end] *= torch.sigmoid(lse - sinks.view(-1, 1)).t()[..., None]
            start = end
        return out


def _causal_over_context(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk after ``context_len`` cached keys, the context (seen whole) and the chunk
    (causal) attended apart and merged by their log-sum-exps; returns the output and its log-sum-exp."""
    chunk, chunk_lse = _flash(queries, keys[:, :, context_len:], values[:, :, context_len:], True, scale)
    if not context_len:
        return chunk, chunk_lse
    context, context_lse = _flash(queries, keys[:, :, :context_len], values[:, :, :context_len], False, scale)
    total_lse = torch.logaddexp(chunk_lse, context_lse)
    chunk = chunk * (chunk_lse - total_lse).exp_()[..., None]
    chunk.addcmul_(context, (context_lse - total_lse).exp_()[..., None])
    return chunk, total_lse


def _flash(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    is_causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused CPU attention ([1, H, Q, D] queries, [1, Hkv, K, D] keys/values; causal means query row r sees
    keys 0..r; ``mask`` [Q, K] is added to the scores): the output [1, H, Q, D] and each row's log-sum-exp of
    its scaled scores [1, H, Q]."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, lse


def _native_sinks_fit(sinks: torch.Tensor | None, query: torch.Tensor) -> bool:
    return sinks is None or (
        sinks.device.type == "cpu" and sinks.dtype == torch.float32 and sinks.shape == (query.shape[1],)
    )


def _native_rotary_fits(
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


def _native_prefill_fits(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    batch: PrefillBatch,
    sinks: torch.Tensor | None,
) -> bool:
    # As for decode, plus the kernel's head dims: multiples of 16 up to 128.
    return (
        _native_cache_fits(query, key_cache, value_cache, batch.page_table, batch.seq_lens_host)
        and query.shape[2] % 16 == 0
        and query.shape[2] <= 128
        and sum(batch.query_lens_host) == query.shape[0]
        and _native_sinks_fit(sinks, query)
    )


def _native_decode_fits(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: DecodeBatch
) -> bool:
    seq_lens = batch.seq_lens
    return (
        _native_cache_fits(query, key_cache, value_cache, batch.page_table, batch.seq_lens_host)
        and seq_lens.device.type == "cpu"
        and seq_lens.dtype == torch.int32
        and seq_lens.shape == (query.shape[0],)
        and len(batch.seq_lens_host) == query.shape[0]
    )


def _native_cache_fits(
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
