"""The reference backend: plain PyTorch ops, runs on any device.

Every other backend is tested against this one. It is also the production
backend on CPUs, so the decode path is vectorised over the batch (one gather
of the paged cache, one fused attention call) rather than a loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backend import DecodeBatch, KernelBackend, PrefillBatch


def _pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


# Packed weights are laid out for this many rows per matmul; any row count
# works, and decode batches (tens of rows) gain the most.
_PACKING_ROWS_HINT = 32
# Rows per pass of a dense MLP on a CPU (``mlp_chunk_rows``).
_MLP_CHUNK_ROWS = 512


# Where AVX2 is the widest vector unit, oneDNN's packed matmul loses to PyTorch's plain one on small weights and
# wins on larger ones (Zen 1, 32 rows: 256 x 16 59 against 15 us, 256 x 384 142 against 121; 512 x 768 451
# against 486, 512 x 5632 2.0x faster): weights under this many elements stay unpacked there.
_AVX2_PACK_MIN_ELEMENTS = 1 << 18


def _packed_linear_available() -> bool:
    return os.environ.get("RAYTURN_PACKED_LINEAR", "1") != "0" and torch.backends.mkldnn.is_available()


def _packing_pays(weight: torch.Tensor) -> bool:
    return weight.numel() >= _AVX2_PACK_MIN_ELEMENTS or torch.backends.cpu.get_cpu_capability() != "AVX2"


class TorchBackend(KernelBackend):
    name = "torch"

    def prepare_linear(self, weight: torch.Tensor) -> torch.Tensor | None:
        """On CPUs, float32 weights are repacked once into oneDNN's blocked layout.

        PyTorch's plain CPU matmul reads the row-major weight on every call;
        the packed copy runs decode-sized matmuls (tens of rows) ~1.4-2x faster
        and prefill-sized ones no slower. The dense weight is kept (checkpoints
        and ``load_weights`` use it), so packed layers hold their weights
        twice. ``RAYTURN_PACKED_LINEAR=0`` turns this off. oneDNN compiles and
        caches a kernel for every row count a packed matmul meets (about half
        a MB each, up to a thousand of them), so rows are padded to a bounded
        set of counts (``_padded_rows``, listed by ``linear_row_counts``): the
        cache, and the process's memory, stops growing once each has been met.
        Serving engines meet them all when they start
        (``rayturn.engine.warm_up.warm_up_kernels``), so no step waits
        on a compile and the memory counts from the start. Where AVX2 is the
        widest vector unit, weights under ``_AVX2_PACK_MIN_ELEMENTS`` stay
        unpacked: there the plain matmul is the faster one for them.
        """
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not _packed_linear_available():
            return None
        if not _packing_pays(weight):
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACKING_ROWS_HINT)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prepared: torch.Tensor | None
    ) -> torch.Tensor:
        if prepared is None or x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        return _packed_linear(x, prepared, bias)

    def linear_row_counts(self, max_rows: int) -> tuple[int, ...]:
        if not _packed_linear_available():
            return ()
        return tuple(sorted({_padded_rows(num_rows) for num_rows in range(1, max_rows + 1)}))

    def mlp_chunk_rows(self, x: torch.Tensor) -> int | None:
        # 2,048 rows of `small`'s MLP: 1.4x faster in passes of 512 (its 11.5 MB of gate and up fit in L3).
        return _MLP_CHUNK_ROWS if x.device.type == "cpu" else None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        inverse_rms = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return weight * (x32 * inverse_rms).to(input_dtype)

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate).mul_(up)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        page_size = key_cache.shape[1]
        slots = slot_mapping.long()
        keep = slots >= 0
        if not bool(keep.all()):  # padding tokens carry negative slots
            slots, key, value = slots[keep], key[keep], value[keep]
        page_ids, offsets = slots // page_size, slots % page_size
        key_cache[page_ids, offsets] = key.to(key_cache.dtype)
        value_cache[page_ids, offsets] = value.to(value_cache.dtype)

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
        options = _AttentionOptions(scale, sinks, sliding_window)
        groups = _length_groups(batch.seq_lens_host)
        if len(groups) == 1:
            return _decode_group(
                query, key_cache, value_cache, batch.page_table, batch.seq_lens, batch.max_seq_len, options
            )
        out = torch.empty_like(query)
        for rows, max_len in groups:
            index = torch.tensor(rows, device=query.device)
            out[index] = _decode_group(
                query[index], key_cache, value_cache, batch.page_table[index], batch.seq_lens[index], max_len, options
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
        page_size = key_cache.shape[1]
        out = torch.empty_like(query)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(batch.query_lens_host, batch.seq_lens_host)):
            end = start + query_len
            context_len = seq_len - query_len
            # With a window, pages before the first query's window are never read.
            first_page = first_window_key(context_len, sliding_window) // page_size
            first_key = first_page * page_size
            pages = batch.page_table[i, first_page : _pages_for(seq_len, page_size)].long()
            keys = _gather_tokens(key_cache, pages[None], seq_len - first_key)[0].transpose(0, 1)  # [Hkv, L, D]
            values = _gather_tokens(value_cache, pages[None], seq_len - first_key)[0].transpose(0, 1)
            queries = query[start:end].transpose(0, 1)  # [H, Q, D]
            if context_len == 0 and sinks is None and sliding_window is None:
                attn = F.scaled_dot_product_attention(
                    queries[None], keys[None], values[None], is_causal=True, scale=scale, enable_gqa=True
                )[0]
            else:
                key_pos = torch.arange(first_key, seq_len, device=query.device)
                query_pos = torch.arange(context_len, seq_len, device=query.device)
                mask = visible_keys(query_pos, key_pos, sliding_window)
                if sinks is None:
                    attn = F.scaled_dot_product_attention(
                        queries[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True
                    )[0]
                else:
                    num_heads, num_kv_heads = queries.shape[0], keys.shape[0]
                    grouped = queries.view(num_kv_heads, num_heads // num_kv_heads, query_len, -1)
                    attn = _sink_attention(
                        grouped, keys[:, None], values[:, None], mask, scale, sinks.view(*grouped.shape[:2], 1, 1)
                    ).view(num_heads, query_len, -1)
            out[start:end] = attn.transpose(0, 1)
            start = end
        return out

    def gather_pages(self, kv_cache: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(kv_cache, 0, page_ids.to(kv_cache.device).long(), out=out)

    def scatter_pages(self, src: torch.Tensor, kv_cache: torch.Tensor, page_ids: torch.Tensor) -> None:
        kv_cache.index_copy_(0, page_ids.to(kv_cache.device).long(), src.to(kv_cache.dtype))


@dataclass(frozen=True, slots=True)
class _AttentionOptions:
    scale: float
    sinks: torch.Tensor | None  # [num_heads] float32 logits
    sliding_window: int | None


def first_window_key(position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``position`` sees."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def visible_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[queries, keys] bool: causal, and within the window when there is one."""
    visible = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return visible


def _decode_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    options: _AttentionOptions,
) -> torch.Tensor:
    """Decode attention for sequences padded to ``max_len``: one gather, one fused attention call."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, page_size = key_cache.shape[2], key_cache.shape[1]
    pages = page_table[:, : _pages_for(max_len, page_size)].long()
    keys = _gather_tokens(key_cache, pages, max_len).transpose(1, 2)  # [B, Hkv, L, D]
    values = _gather_tokens(value_cache, pages, max_len).transpose(1, 2)
    key_pos = torch.arange(max_len, device=query.device)[None, :]
    mask = key_pos < seq_lens[:, None]  # [B, L]
    if options.sliding_window is not None:
        mask &= key_pos >= seq_lens[:, None] - options.sliding_window
    # The query heads sharing a kv head act as that head's query rows, so
    # keys and values are never repeated per query head (GQA for free).
    grouped = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if options.sinks is None:
        out = F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=mask[:, None, None, :], scale=options.scale
        )
    else:
        sinks = options.sinks.view(1, num_kv_heads, num_heads // num_kv_heads, 1)
        out = _sink_attention(grouped, keys, values, mask[:, None, None, :], options.scale, sinks)
    return out.reshape(num_seqs, num_heads, head_dim)


def _sink_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Softmax attention, in float32, whose denominator also holds a sink logit per query row (it has no value).

    Shapes broadcast as in ``queries @ keys.T``: queries [..., Q, D], keys and values [..., K, D], ``visible``
    [..., Q, K] bool, ``sinks`` [..., Q or 1, 1].
    """
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    with_sinks = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    probs = torch.softmax(with_sinks, dim=-1)[..., :-1]
    return torch.matmul(probs, values.float()).to(queries.dtype)


def _length_groups(seq_lens: tuple[int, ...], max_groups: int = 4) -> list[tuple[list[int], int]]:
    """Split a decode batch by length where that saves a quarter of a group's padded tokens.

    Every sequence is padded to its group's longest, so a mixed batch (a long
    agent context beside short chats) wastes most of one big gather; each
    extra group costs one more attention call, so a split must also save
    ``min_saving`` tokens. Groups are split in two
    recursively, up to ``max_groups``. Returns (rows, max_len) per group,
    shortest group first.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups = [order]
    while len(groups) < max_groups:
        for index, rows in enumerate(groups):
            split = _best_split([seq_lens[row] for row in rows])
            if split:
                groups[index : index + 1] = [rows[:split], rows[split:]]
                break
        else:
            break
    if len(groups) == 1:
        return [(list(range(len(seq_lens))), seq_lens[order[-1]])]
    return [(rows, seq_lens[rows[-1]]) for rows in groups]


def _best_split(sorted_lens: list[int], min_saving: int = 128) -> int:
    """Where to cut ascending lengths in two to save >= 25% (and ``min_saving``) padded tokens; 0 for no cut."""
    longest = sorted_lens[-1]
    padded = len(sorted_lens) * longest
    best_cost, best_split = padded, 0
    for split in range(1, len(sorted_lens)):
        cost = split * sorted_lens[split - 1] + (len(sorted_lens) - split) * longest
        if cost < best_cost:
            best_cost, best_split = cost, split
    return best_split if best_cost <= min(0.75 * padded, padded - min_saving) else 0


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` on the packed weight, its rows padded up to ``_padded_rows`` (rows never mix:
    the padding's outputs are dropped). The padding is the rows that follow ``x`` in its storage where it has
    them (a packed linear's output, ``rows_with_room``'s), else zeros after a copy of ``x``."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    padding = _padded_rows(num_rows) - num_rows
    if padding and _has_room(rows, num_rows + padding):
        rows = rows.as_strided((num_rows + padding, rows.shape[1]), (rows.shape[1], 1))
    elif padding:  # zeros in the padding rows only (a pad would zero every row, then copy the input over them)
        padded = torch.empty((num_rows + padding, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        padded[:num_rows] = rows
        padded[num_rows:] = 0
        rows = padded
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out[:num_rows].view(*x.shape[:-1], out.shape[-1])


def _has_room(rows: torch.Tensor, num_rows: int) -> bool:
    """Whether contiguous ``rows``' storage holds ``num_rows`` rows from its first."""
    end = rows.storage_offset() + num_rows * rows.shape[1]
    return rows.is_contiguous() and rows.untyped_storage().nbytes() >= end * rows.element_size()


def rows_with_room(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` whose storage goes on to the row count a packed linear of its
    first dimension runs at (``_padded_rows``): a linear of it pads its rows without a copy."""
    return torch.empty((_padded_rows(shape[0]), *shape[1:]), dtype=dtype)[: shape[0]]


def _padded_rows(num_rows: int) -> int:
    """The row count a packed matmul of ``num_rows`` runs at: exact up to 4, then a multiple of 4 up to 32,
    then of 8 up to 64, then eight counts per doubling (at most 7 rows or 1/8 more): 55 counts up to 2048 rows."""
    if num_rows <= 4:
        return num_rows
    step = 4 if num_rows <= 32 else max(8, 1 << (num_rows.bit_length() - 4))
    return -(-num_rows // step) * step


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)
    return out


def _gather_tokens(cache: torch.Tensor, page_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[B, pages] page ids -> [B, num_tokens, Hkv, D] keys or values in token order."""
    batch, num_pages = page_table.shape
    # index_select over flat page ids is several times faster on CPU than
    # advanced indexing with the 2-D table.
    pages = cache.index_select(0, page_table.reshape(-1))  # [B * P, page_size, Hkv, D]
    return pages.view(batch, num_pages * cache.shape[1], *cache.shape[2:])[:, :num_tokens]
