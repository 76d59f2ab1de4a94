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
skipping none of the masked-out ones. Float32 RMS norm is one native pass
per row, summing in PyTorch's own order so the bits are its result
(``native_norm``); SiLU-and-multiply works in place, avoiding a fresh
allocation of prefill-sized activations.

Prefill attention without a sliding window runs natively too where the
library was built for AVX2 or wider: each chunk's keys are copied transposed
once, then a register's worth of query rows (sixteen with AVX-512, eight with
AVX2: a GQA group's heads at consecutive positions) go over each block of keys
together, with an online softmax, reading values in place from their pages.
PyTorch's flash kernel reuses each key block for more rows, which wins on long
sequences on AVX2, so there a sequence past ``NATIVE_PREFILL_MAX_KEYS`` takes
it (``native_prefill``, ``describe``).
Mixture-of-experts layers use a native grouped matmul while experts meet few rows each (a decode
step): each expert's weight is read once, sixteen outputs at a time; torch's makes a call per expert.
The tokens' permutation by expert and the weighted un-permutation are native too (``native_moe``),
with the reference's result to the bit.

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

from . import moe, native_moe
from .backend import DecodeBatch, PrefillBatch
from .native import NativeKernels, load
from .native_fits import native_decode_fits, native_prefill_fits, native_rotary_fits, native_sinks_fit
from .native_moe import native_moe_fits
from .native_norm import ExactRmsNorm
from .torch_backend import (
    TorchBackend,
    _gather_tokens,
    _pages_for,
    first_window_key,
    rows_with_room,
    visible_keys,
)

# Up to this many rows per expert on average, the native grouped matmul beats torch's (2.8x at 4 rows, as
# fast at 64, on a 16-expert layer of hidden 256); prefill-sized groups go to torch's.
_NATIVE_MOE_ROWS_PER_EXPERT = 32
NATIVE_PREFILL_MIN_VECTOR_BITS = 256  # prefill attention runs natively from this vector width on (AVX2)
# Per vector width, the longest sequence (keys) whose prefill attention runs natively by default; longer ones
# take PyTorch's flash kernel, whose tiles reuse each key block for more rows. On AVX2 (Zen 1, head dim 64)
# native is 1.6x flash at 512 keys, 1.05x at 1,024, 0.93x at 2,048, 0.82x at 4,096. No limit with AVX-512.
NATIVE_PREFILL_MAX_KEYS: dict[int, int] = {256: 1536}


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, kernels: NativeKernels | None = None, native_prefill: bool | None = None) -> None:
        """``native_prefill``: whether prefill attention runs the native kernel, for sequences of any length
        (default: where the library was built for AVX2 or wider, :data:`NATIVE_PREFILL_MIN_VECTOR_BITS`, up to
        the width's :data:`NATIVE_PREFILL_MAX_KEYS`)."""
        native = kernels or load()
        if native is None:
            from .native import unavailable_reason

            raise RuntimeError(f"the cpu kernel backend needs its native kernels: {unavailable_reason()}")
        self.native = native
        self.norm = ExactRmsNorm(native)
        self.native_prefill_max_keys: int | None = None  # longer sequences take torch flash; None: no limit
        if native_prefill is None:
            native_prefill = native.vector_bits >= NATIVE_PREFILL_MIN_VECTOR_BITS
            self.native_prefill_max_keys = NATIVE_PREFILL_MAX_KEYS.get(native.vector_bits)
        self.native_prefill = native_prefill
        self.native_prefill_chunk_keys = 0  # keys per chunk of the native prefill kernel; 0: the kernel's default

    def describe(self) -> str:
        prefill = "native" if self.native_prefill else "torch flash"
        if self.native_prefill and self.native_prefill_max_keys is not None:
            prefill += f" up to {self.native_prefill_max_keys} keys, torch flash beyond"
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
        if not native_decode_fits(query, key_cache, value_cache, batch) or not native_sinks_fit(sinks, query):
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
            self.native_prefill_chunk_keys,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"native decode attention could not allocate its scores ({num_seqs} sequences)")
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
        # The torch reference's steps, with the permutation and un-permutation native (the same bits).
        if not native_moe_fits(x, gate_up):
            return super().fused_moe(
                x, router_logits, gate_up, down, top_k, renormalize, gate_up_bias, down_bias, activation
            )
        weights, expert_ids = moe.route_top_k(router_logits, top_k, renormalize)
        rows, slot_index, group_sizes = native_moe.permute(self.native, x, expert_ids, gate_up.shape[0])
        expert_out = moe.grouped_expert_mlp(
            rows, group_sizes, gate_up, down, activation or self.silu_and_mul, gate_up_bias, down_bias,
            matmul=self.grouped_matmul,
        )  # fmt: skip
        return native_moe.unpermute(self.native, expert_out, slot_index, weights)

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
        if not native_rotary_fits(positions, query, key, cos_sin_cache):
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
        # One native pass, bit for bit the torch backend's float32 result (PyTorch's op where it cannot be).
        return self.norm(x, weight, eps)

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
        native = (
            self.native_prefill
            and sliding_window is None
            and native_prefill_fits(query, key_cache, value_cache, batch, sinks)
        )
        longest = self.native_prefill_max_keys
        if native:
            query = query.contiguous()
        page_size = key_cache.shape[1]
        page_table = batch.page_table.contiguous()
        out = rows_with_room(tuple(query.shape), query.dtype)  # o_proj's input: its padding rows without a copy
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_host, batch.seq_lens_host)):
            end = start + query_len
            context_len = seq_len - query_len
            if native and (longest is None or seq_len <= longest):
                self._native_sequence(
                    query[start:end], out[start:end], key_cache, value_cache, page_table[i], seq_len, scale, sinks
                )
                start = end
                continue
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

    def _native_sequence(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        pages: torch.Tensor,
        seq_len: int,
        scale: float,
        sinks: torch.Tensor | None,
    ) -> None:
        """One sequence's chunk (``query``, contiguous, into ``out``) through the native kernel, keys and values
        read from their ``pages`` (int32, contiguous) in place."""
        query_len, num_heads, head_dim = query.shape
        lse = None if sinks is None else torch.empty(num_heads, query_len, dtype=torch.float32)
        status = self.native.paged_prefill_attention_f32(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            pages.data_ptr(),
            seq_len - query_len,
            query_len,
            out.data_ptr(),
            None if lse is None else lse.data_ptr(),
            num_heads,
            key_cache.shape[2],
            head_dim,
            key_cache.shape[1],
            scale,
            self.native_prefill_chunk_keys,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"native prefill attention could not allocate its buffers ({seq_len} keys)")
        if sinks is not None and lse is not None:
            # The sink joins the denominator only: rescale by sum / (sum + exp(sink)).
            out *= torch.sigmoid(lse - sinks.view(-1, 1)).t()[..., None]


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
