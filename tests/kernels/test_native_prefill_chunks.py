"""The native prefill kernel takes a sequence's keys in chunks, carrying each query row's running softmax.

Every work item (a few query rows of one kv head) runs over one chunk of keys before any goes on to the next,
so the chunk's keys and values stay in the core's cache while all the rows read them; each item keeps its
rows' weighted sums, maxima and totals between chunks. The arithmetic is the same, in the same order, as
one pass over all the keys, so every chunk size gives the same bits. A block whose scores raise no row's
maximum skips the rescaling (its correction is exactly 1); a row whose maximum does move takes it.
"""

from __future__ import annotations

import pytest
import torch

from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.torch_backend import TorchBackend

from .triton_cases import CacheSpec, assert_matches, layer_views, make_prefill_case, make_sinks

# Chunks of one block (16 keys, rounded up to the host's block of 8 or 16), of a size that is not a whole
# number of AVX-512 blocks (40: 48 there), a few blocks, and one chunk for everything.
CHUNK_SIZES = (16, 40, 64, 10**6)


def native_backend(chunk_keys: int) -> CpuBackend:
    backend = CpuBackend(native_prefill=True)
    backend.native_prefill_chunk_keys = chunk_keys
    return backend


@pytest.mark.parametrize(
    ("spec", "num_heads", "context_lens", "query_lens", "with_sinks"),
    [
        # The small preset's shape: a cold prompt (early rows finish chunks before the late ones), chunks
        # after contexts of several chunks, a chunk of one token; with sinks (the kernel's log-sum-exps).
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=64), 8, [0, 150, 37], [200, 1, 90], True),
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=64), 8, [260, 0], [33, 120], False),
        # A GQA group of 3 (a spare row in every item), head dim 48; eight heads of head dim 128 on one kv head.
        (CacheSpec(page_size=8, num_kv_heads=2, head_dim=48), 6, [70, 0], [45, 100], False),
        (CacheSpec(page_size=4, num_kv_heads=1, head_dim=128), 8, [130, 3], [17, 60], True),
    ],
    ids=["small-preset-sinks", "small-preset", "group3-dim48", "group8-dim128-sinks"],
)
def test_every_chunk_size_gives_the_same_bits_as_the_default(
    spec: CacheSpec, num_heads: int, context_lens: list[int], query_lens: list[int], with_sinks: bool
) -> None:
    case, batch = make_prefill_case(spec, num_heads, context_lens, query_lens, torch.float32, "cpu", seed=3)
    keys, values = layer_views(case.kv_cache, case.layer)
    sinks = make_sinks(num_heads, "cpu", 3) if with_sinks else None
    default = native_backend(0).prefill_attention(case.query, keys, values, batch, case.scale, sinks)
    assert_matches(default, TorchBackend().prefill_attention(case.query, keys, values, batch, case.scale, sinks))
    for chunk_keys in CHUNK_SIZES:
        chunked = native_backend(chunk_keys).prefill_attention(case.query, keys, values, batch, case.scale, sinks)
        assert torch.equal(chunked, default), f"chunks of {chunk_keys} keys"


@pytest.mark.parametrize("chunk_keys", [0, 16, 64])
def test_a_maximum_that_moves_for_one_row_late_in_the_keys_is_taken(chunk_keys: int) -> None:
    """One late key points along one query row only: that row's maximum moves at the key's block, the other
    rows' do not. Skipping the rescaling there (as for a block that moves no maximum) would leave that row's
    earlier weights unscaled, far from the reference."""
    spec = CacheSpec(page_size=16, num_kv_heads=2, head_dim=64)
    case, batch = make_prefill_case(spec, 8, [300], [20], torch.float32, "cpu", seed=7)
    keys, values = layer_views(case.kv_cache, case.layer)
    late_key = 290  # seen by every row (they sit at positions 300-319), in a late block and a late chunk
    row, head = 5, 2  # query row 5's head 2 reads kv head 0
    page = int(batch.page_table[0, late_key // spec.page_size])
    direction = case.query[row, head] / case.query[row, head].norm()
    keys[page, late_key % spec.page_size, 0] = direction * 12.0
    backend = native_backend(chunk_keys)
    actual = backend.prefill_attention(case.query, keys, values, batch, case.scale)
    expected = TorchBackend().prefill_attention(case.query, keys, values, batch, case.scale)
    assert_matches(actual, expected)
    # The late key dominates that row: its output is close to the late key's value.
    late_value = values[page, late_key % spec.page_size, 0]
    assert torch.allclose(actual[row, head], late_value, atol=0.05)
