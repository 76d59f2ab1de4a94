"""The torch reference backend against definitions written out longhand."""

from __future__ import annotations

import math

import pytest
import torch

from rayturn.kernels import DecodeBatch, PrefillBatch, torch_backend
from rayturn.kernels.torch_backend import TorchBackend, _length_groups, _padded_rows, rows_with_room

BACKEND = TorchBackend()
PAGE, KV_HEADS, HEADS, DIM = 4, 2, 4, 8


def make_cache(num_pages: int = 10, num_layers: int = 2) -> torch.Tensor:
    return torch.randn(num_pages, num_layers, 2, PAGE, KV_HEADS, DIM, generator=torch.Generator().manual_seed(0))


def naive_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row [H, D] over keys/values [L, Hkv, D], GQA by head index."""
    group = HEADS // KV_HEADS
    out = torch.empty_like(query)
    for head in range(HEADS):
        k, v = keys[:, head // group], values[:, head // group]
        weights = torch.softmax(k @ query[head] * scale, dim=0)
        out[head] = weights @ v
    return out


def tokens_of(cache_view: torch.Tensor, pages: list[int], num_tokens: int) -> torch.Tensor:
    return torch.cat([cache_view[p] for p in pages])[:num_tokens]


def test_write_kv_into_strided_layer_view_skips_negative_slots() -> None:
    cache = torch.zeros(6, 2, 2, PAGE, KV_HEADS, DIM)
    key, value = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    BACKEND.write_kv(key, value, cache[:, 1, 0], cache[:, 1, 1], torch.tensor([9, -1, 2]))
    assert torch.equal(cache[2, 1, 0, 1], key[0]) and torch.equal(cache[2, 1, 1, 1], value[0])
    assert torch.equal(cache[0, 1, 0, 2], key[2])
    assert int((cache != 0).sum()) == 2 * 2 * KV_HEADS * DIM  # nothing else written, layer 0 untouched


def test_decode_attention_matches_longhand() -> None:
    cache = make_cache()
    keys, values = cache[:, 1, 0], cache[:, 1, 1]
    tables = [[7, 2, 5], [0, 9, 0]]  # second row padded with page 0
    seq_lens = [11, 6]
    query = torch.randn(2, HEADS, DIM)
    batch = DecodeBatch(
        torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 11, tuple(seq_lens)
    )
    out = BACKEND.decode_attention(query, keys, values, batch, 0.3)
    for i in range(2):
        expected = naive_attention(
            query[i], tokens_of(keys, tables[i], seq_lens[i]), tokens_of(values, tables[i], seq_lens[i]), 0.3
        )
        torch.testing.assert_close(out[i], expected)


def test_prefill_attention_is_causal_after_context() -> None:
    cache = make_cache()
    keys, values = cache[:, 0, 0], cache[:, 0, 1]
    tables = [[3, 8, 1], [4, 0, 0]]
    context, query_lens = [5, 0], [4, 3]
    seq_lens = [c + q for c, q in zip(context, query_lens)]
    query = torch.randn(sum(query_lens), HEADS, DIM)
    batch = PrefillBatch(
        page_table=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 4, 7], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context, dtype=torch.int32),
        max_query_len=4,
        max_seq_len=9,
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    out = BACKEND.prefill_attention(query, keys, values, batch, 1 / math.sqrt(DIM))
    row = 0
    for i in range(2):
        for r in range(query_lens[i]):
            visible = context[i] + r + 1
            expected = naive_attention(
                query[row],
                tokens_of(keys, tables[i], visible),
                tokens_of(values, tables[i], visible),
                1 / math.sqrt(DIM),
            )
            torch.testing.assert_close(out[row], expected)
            row += 1


def test_gather_scatter_and_copy_pages() -> None:
    cache = make_cache()
    ids = torch.tensor([4, 1, 7])
    out = torch.empty(3, *cache.shape[1:])
    BACKEND.gather_pages(cache, ids, out)
    assert torch.equal(out, cache[[4, 1, 7]])
    target = torch.zeros_like(cache)
    BACKEND.scatter_pages(out, target, torch.tensor([0, 9, 5]))
    assert torch.equal(target[9], cache[1]) and torch.equal(target[5], cache[7])
    assert int(target[[1, 2, 3, 4, 6, 7, 8]].abs().sum()) == 0
    BACKEND.copy_pages(target, torch.tensor([9]), torch.tensor([2]))
    assert torch.equal(target[2], cache[1])


def test_rms_norm_rotary_and_silu() -> None:
    x = torch.randn(3, 16)
    weight = torch.rand(16)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(BACKEND.rms_norm(x, weight, 1e-6), expected)
    gate, up = torch.randn(2, 5), torch.randn(2, 5)
    torch.testing.assert_close(BACKEND.silu_and_mul(gate, up), gate * torch.sigmoid(gate) * up)
    # Rotary at position p turns each (x_i, x_{i+d/2}) pair by angle p * inv_freq_i.
    angles = torch.arange(8.0)[:, None] * torch.tensor([1.0, 0.1])[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    q, k = torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    positions = torch.tensor([3, 7])
    rq, rk = BACKEND.rotary_embedding(positions, q, k, cache)
    for t, p in enumerate(positions.tolist()):
        for i in range(2):
            a = angles[p, i]
            x0, x1 = q[t, 0, i], q[t, 0, i + 2]
            torch.testing.assert_close(rq[t, 0, i], x0 * a.cos() - x1 * a.sin())
            torch.testing.assert_close(rq[t, 0, i + 2], x1 * a.cos() + x0 * a.sin())
    assert rk.shape == k.shape


def test_length_groups_split_only_when_padding_dominates() -> None:
    assert _length_groups((10, 12, 11)) == [([0, 1, 2], 12)]
    # Three short sequences beside one long one: pad them to their own longest.
    assert _length_groups((500, 20, 30, 25)) == [([1, 3, 2], 30), ([0], 500)]
    # Three length bands: each padded only to its own longest.
    assert _length_groups((1000, 10, 200, 1010, 11, 210)) == [([1, 4], 11), ([2, 5], 210), ([0, 3], 1010)]
    # Never more groups than asked for.
    assert len(_length_groups(tuple(4**i for i in range(8)), max_groups=3)) == 3


def test_decode_attention_with_length_groups_matches_longhand() -> None:
    cache = make_cache(num_pages=80)
    keys, values = cache[:, 0, 0], cache[:, 0, 1]
    seq_lens = [3, 70, 5, 2]  # one long, three short: two groups
    assert len(_length_groups(tuple(seq_lens))) == 2
    generator = torch.Generator().manual_seed(1)
    tables = torch.randperm(80, generator=generator)[: 4 * 18].view(4, 18)
    query = torch.randn(4, HEADS, DIM, generator=generator)
    batch = DecodeBatch(tables.int(), torch.tensor(seq_lens, dtype=torch.int32), 70, tuple(seq_lens))
    out = BACKEND.decode_attention(query, keys, values, batch, 0.5)
    for i, seq_len in enumerate(seq_lens):
        pages = tables[i].tolist()
        expected = naive_attention(query[i], tokens_of(keys, pages, seq_len), tokens_of(values, pages, seq_len), 0.5)
        torch.testing.assert_close(out[i], expected)


def test_linear_with_packed_weight_matches_plain_matmul(monkeypatch) -> None:
    monkeypatch.setattr(torch_backend, "_AVX2_PACK_MIN_ELEMENTS", 0)  # every weight packed, on any host
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 32, generator=generator)
    bias = torch.randn(48, generator=generator)
    prepared = BACKEND.prepare_linear(weight)
    if torch.backends.mkldnn.is_available():
        assert prepared is not None  # CPU float32 weights are repacked
    for rows in (1, 7, 33, 300):
        x = torch.randn(rows, 32, generator=generator)
        expected = x @ weight.T + bias
        torch.testing.assert_close(BACKEND.linear(x, weight, bias, prepared), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(BACKEND.linear(x, weight, None, prepared), x @ weight.T, rtol=1e-5, atol=1e-5)
    # Strided input (a column slice) is accepted.
    wide = torch.randn(5, 64, generator=generator)
    torch.testing.assert_close(
        BACKEND.linear(wide[:, :32], weight, None, prepared), wide[:, :32] @ weight.T, rtol=1e-5, atol=1e-5
    )
    # Leading dims other than rows keep their shape.
    batched = torch.randn(3, 13, 32, generator=generator)
    out = BACKEND.linear(batched, weight, bias, prepared)
    assert out.shape == (3, 13, 48)
    torch.testing.assert_close(out, batched @ weight.T + bias, rtol=1e-5, atol=1e-5)


def test_packed_matmuls_run_at_a_bounded_set_of_row_counts(monkeypatch) -> None:
    # oneDNN keeps a compiled kernel per row count: prompts of ever-new lengths must not mean ever-new kernels.
    counts = [_padded_rows(rows) for rows in range(1, 2049)]
    assert len(set(counts)) <= 55
    assert all(rows <= count <= rows + max(7, rows // 8) for rows, count in zip(range(1, 2049), counts))
    assert counts == sorted(counts) and [_padded_rows(rows) for rows in range(1, 5)] == [1, 2, 3, 4]
    if not torch.backends.mkldnn.is_available():
        return
    seen: list[int] = []
    packed_matmul = torch.ops.mkldnn._linear_pointwise

    def recording(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return packed_matmul(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    monkeypatch.setattr(torch_backend, "_AVX2_PACK_MIN_ELEMENTS", 0)
    weight = torch.randn(16, 8)
    prepared = BACKEND.prepare_linear(weight)
    for rows in range(1, 300):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(BACKEND.linear(x, weight, None, prepared), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert seen == [_padded_rows(rows) for rows in range(1, 300)] and len(set(seen)) == 33
    # What an engine builds when it starts: every count met, and no other.
    assert BACKEND.linear_row_counts(299) == tuple(sorted(set(seen)))
    assert BACKEND.linear_row_counts(2048) == tuple(sorted(set(counts)))


def test_rows_with_room_are_padded_in_place_and_give_the_same_bits(monkeypatch) -> None:
    """A packed linear pads an input with room (``rows_with_room``, another packed linear's output) with the
    rows its storage holds after it, whatever they hold, instead of a copy of the input: the same bits out."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no packed matmul without oneDNN")
    monkeypatch.setattr(torch_backend, "_AVX2_PACK_MIN_ELEMENTS", 0)
    generator = torch.Generator().manual_seed(5)
    weight, second = torch.randn(48, 32, generator=generator), torch.randn(24, 48, generator=generator)
    bias = torch.randn(48, generator=generator)
    prepared, prepared_second = BACKEND.prepare_linear(weight), BACKEND.prepare_linear(second)
    copies = 0
    empty = torch.empty

    def counting(*args: object, **kwargs: object) -> torch.Tensor:  # the padding copy allocates with torch.empty
        nonlocal copies
        copies += 1
        return empty(*args, **kwargs)  # type: ignore[arg-type]

    for rows in (7, 33, 200, 300):
        assert _padded_rows(rows) > rows
        x = torch.randn(rows, 32, generator=generator)
        room = rows_with_room((rows, 32), torch.float32)
        room.copy_(x)
        assert room.untyped_storage().nbytes() == _padded_rows(rows) * 32 * 4
        room.as_strided((_padded_rows(rows), 32), (32, 1))[rows:] = float("nan")  # garbage in the room
        expected = BACKEND.linear(x, weight, bias, prepared)
        monkeypatch.setattr(torch, "empty", counting)
        copies = 0
        out = BACKEND.linear(room, weight, bias, prepared)
        chained = BACKEND.linear(out, second, None, prepared_second)  # an output has room for the next linear
        monkeypatch.setattr(torch, "empty", empty)
        assert copies == 0
        assert torch.equal(out, expected) and out.shape == (rows, 48)
        assert torch.equal(chained, BACKEND.linear(expected.clone(), second, None, prepared_second))
    # A view without room (a slice of a tensor that ends with it) is copied and padded with zeros, as before.
    tight = torch.randn(10, 32, generator=generator)
    assert torch.equal(
        BACKEND.linear(tight[3:], weight, None, prepared), BACKEND.linear(tight[3:].clone(), weight, None, prepared)
    )


def test_packed_linear_is_skipped_when_disabled_or_not_float32(monkeypatch) -> None:
    weight = torch.randn(8, 4)
    assert BACKEND.prepare_linear(weight.to(torch.bfloat16)) is None
    monkeypatch.setenv("RAYTURN_PACKED_LINEAR", "0")
    assert BACKEND.prepare_linear(weight) is None
    assert BACKEND.linear_row_counts(2048) == ()  # nothing to build ahead


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_small_weights_stay_unpacked_only_where_avx2_is_the_widest(monkeypatch, capability: str) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    generator = torch.Generator().manual_seed(5)
    small = torch.randn(384, 256, generator=generator) / 16  # under 2**18 elements: plain matmul on AVX2
    large = torch.randn(768, 512, generator=generator)
    assert (BACKEND.prepare_linear(small) is None) is (capability == "AVX2")
    assert BACKEND.prepare_linear(large) is not None
    x = torch.randn(32, 256, generator=generator)
    torch.testing.assert_close(
        BACKEND.linear(x, small, None, BACKEND.prepare_linear(small)), x @ small.T, rtol=1e-5, atol=1e-5
    )
