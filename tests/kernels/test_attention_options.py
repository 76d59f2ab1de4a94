"""Attention sinks and sliding windows: the torch reference against a longhand softmax, every other backend
against the reference.

A sink is one more logit in a head's softmax denominator with no value; a window of W lets the query at
position p see keys p - W + 1 .. p. Cases put windows shorter than, equal to and longer than the sequences,
windows that start mid-page and chunks that start mid-window.
"""

from __future__ import annotations

import math

import pytest
import torch

from rayturn.kernels import KernelBackend
from rayturn.kernels.cpu_backend import CpuBackend

from .triton_cases import (
    REFERENCE,
    CacheSpec,
    check_decode_attention,
    check_prefill_attention,
    layer_views,
    make_decode_case,
    make_prefill_case,
    make_sinks,
)

SPEC = CacheSpec(page_size=4, num_kv_heads=2, head_dim=16)
NUM_HEADS = 4
OPTIONS = [(True, None), (False, 5), (True, 5), (True, 8), (True, 64)]
OPTION_IDS = ["sinks", "window5", "sinks-window5", "sinks-window8", "sinks-window-beyond"]


def longhand(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: int,
    scale: float,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """One query token [H, D] at ``position`` over token-ordered keys/values [L, Hkv, D], in float64."""
    num_heads, num_kv_heads = query.shape[0], keys.shape[1]
    first = 0 if window is None else max(0, position - window + 1)
    out = torch.empty(query.shape, dtype=torch.float64)
    for head in range(num_heads):
        kv_head = head // (num_heads // num_kv_heads)
        seen_keys = keys[first : position + 1, kv_head].double()
        seen_values = values[first : position + 1, kv_head].double()
        scores = seen_keys @ query[head].double() * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks[head : head + 1].double()))
        probs = torch.softmax(scores, dim=0)[: seen_keys.shape[0]]
        out[head] = probs @ seen_values
    return out.to(query.dtype)


def tokens(cache: torch.Tensor, page_table: torch.Tensor, seq: int, num_tokens: int) -> torch.Tensor:
    page_size = cache.shape[1]
    return torch.stack([cache[int(page_table[seq, p // page_size]), p % page_size] for p in range(num_tokens)])


@pytest.mark.parametrize("with_sinks,window", OPTIONS, ids=OPTION_IDS)
def test_reference_decode_matches_longhand(with_sinks: bool, window: int | None) -> None:
    seq_lens = [13, 3, 8, 200]  # 200 with three short ones: the reference splits the batch by length
    case, batch = make_decode_case(SPEC, NUM_HEADS, seq_lens, torch.float32, "cpu")
    key_cache, value_cache = layer_views(case.kv_cache, case.layer)
    sinks = make_sinks(NUM_HEADS, "cpu") if with_sinks else None
    out = REFERENCE.decode_attention(case.query, key_cache, value_cache, batch, case.scale, sinks, window)
    for seq, seq_len in enumerate(seq_lens):
        keys = tokens(key_cache, batch.page_table, seq, seq_len)
        values = tokens(value_cache, batch.page_table, seq, seq_len)
        expected = longhand(case.query[seq], keys, values, seq_len - 1, case.scale, sinks, window)
        torch.testing.assert_close(out[seq], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_sinks,window", OPTIONS, ids=OPTION_IDS)
def test_reference_prefill_matches_longhand(with_sinks: bool, window: int | None) -> None:
    context_lens, query_lens = [0, 6, 9], [11, 7, 1]
    case, batch = make_prefill_case(SPEC, NUM_HEADS, context_lens, query_lens, torch.float32, "cpu")
    key_cache, value_cache = layer_views(case.kv_cache, case.layer)
    sinks = make_sinks(NUM_HEADS, "cpu") if with_sinks else None
    out = REFERENCE.prefill_attention(case.query, key_cache, value_cache, batch, case.scale, sinks, window)
    row = 0
    for seq, (context_len, query_len) in enumerate(zip(context_lens, query_lens)):
        keys = tokens(key_cache, batch.page_table, seq, context_len + query_len)
        values = tokens(value_cache, batch.page_table, seq, context_len + query_len)
        for offset in range(query_len):
            expected = longhand(case.query[row], keys, values, context_len + offset, case.scale, sinks, window)
            torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
            row += 1


def test_a_large_sink_takes_almost_all_the_mass() -> None:
    case, batch = make_decode_case(SPEC, NUM_HEADS, [5], torch.float32, "cpu")
    key_cache, value_cache = layer_views(case.kv_cache, case.layer)
    sinks = torch.full((NUM_HEADS,), 60.0)
    out = REFERENCE.decode_attention(case.query, key_cache, value_cache, batch, case.scale, sinks)
    assert float(out.abs().max()) < 1e-10


def backends() -> list[KernelBackend]:
    found: list[KernelBackend] = [CpuBackend()]
    try:
        from rayturn.kernels.triton_backend import TritonBackend

        found.append(TritonBackend())
    except RuntimeError:  # Triton is not installed
        pass
    return found


@pytest.fixture(scope="module", params=backends(), ids=lambda backend: backend.name)
def backend(request: pytest.FixtureRequest) -> KernelBackend:
    return request.param


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def device_for(backend: KernelBackend) -> str:
    return "cpu" if backend.name == "cpu" else DEVICE


@pytest.mark.parametrize("with_sinks,window", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize(
    "spec,seq_lens",
    [(SPEC, [13, 3, 8, 21]), (CacheSpec(page_size=1, num_kv_heads=1, head_dim=16), [9, 2])],
    ids=["gqa2", "gqa4-page1"],
)
def test_decode_matches_reference(
    backend: KernelBackend, spec: CacheSpec, seq_lens: list[int], with_sinks: bool, window: int | None
) -> None:
    check_decode_attention(
        backend, spec, NUM_HEADS, seq_lens, torch.float32, device_for(backend), 0, with_sinks, window
    )


@pytest.mark.parametrize("with_sinks,window", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize(
    "context_lens,query_lens",
    [([0, 6, 9], [11, 7, 1]), ([0, 21], [24, 19])],
    ids=["short", "longer-than-a-block"],
)
def test_prefill_matches_reference(
    backend: KernelBackend, context_lens: list[int], query_lens: list[int], with_sinks: bool, window: int | None
) -> None:
    check_prefill_attention(
        backend, SPEC, NUM_HEADS, context_lens, query_lens, torch.float32, device_for(backend), 0, with_sinks, window
    )


def test_window_of_one_sees_only_itself() -> None:
    case, batch = make_prefill_case(SPEC, NUM_HEADS, [3], [5], torch.float32, "cpu")
    key_cache, value_cache = layer_views(case.kv_cache, case.layer)
    for backend in backends():
        if device_for(backend) != "cpu":
            continue
        out = backend.prefill_attention(case.query, key_cache, value_cache, batch, 1 / math.sqrt(16), None, 1)
        values = tokens(value_cache, batch.page_table, 0, 8)[3:]  # [5, Hkv, D]
        torch.testing.assert_close(out, values.repeat_interleave(NUM_HEADS // SPEC.num_kv_heads, dim=1))
