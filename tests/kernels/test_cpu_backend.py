"""The ``cpu`` backend: native decode attention against the torch reference, and how it is built.

The native kernel reads keys and values in place from strided, shuffled pages;
the cases below vary GQA group sizes, head dims that are not a multiple of the
vector width, page sizes down to 1, sequence lengths of one token and of
exact page multiples, and page tables whose padding columns must not be read.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rayturn.kernels import DecodeBatch, native, select_backend
from rayturn.kernels.cpu_backend import NATIVE_PREFILL_MAX_KEYS, CpuBackend
from rayturn.kernels.torch_backend import TorchBackend

from .triton_cases import (
    CacheSpec,
    check_decode_attention,
    check_prefill_attention,
    check_rotary_embedding,
    count_native_calls,
    layer_views,
    make_cos_sin_cache,
    make_decode_case,
    make_prefill_case,
)

BACKEND = CpuBackend()
# The native prefill kernel runs by default only where the library is built for AVX-512; its tests run it on
# every host.
NATIVE_PREFILL = CpuBackend(native_prefill=True)


@pytest.mark.parametrize(
    "spec,num_heads,seq_lens",
    [
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=64), 8, [1, 16, 17, 300, 641]),
        (CacheSpec(page_size=4, num_kv_heads=4, head_dim=8), 4, [3, 5, 8, 1]),  # no GQA
        (CacheSpec(page_size=1, num_kv_heads=1, head_dim=12), 6, [7, 2]),  # one token per page, MQA
        (CacheSpec(page_size=8, num_kv_heads=2, head_dim=48, num_layers=3, layer=2), 4, [33, 64, 9]),
        # Head dims of one, two and eight vectors, and groups the heads-per-pass of any vector width leaves a
        # remainder of (the value pass takes 4, 2 or 1 heads at a time by the host's registers).
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=32), 14, [1, 40, 300]),
        (CacheSpec(page_size=4, num_kv_heads=1, head_dim=16), 3, [5, 70]),
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=128), 6, [17, 129]),
    ],
    ids=["small-preset", "mha", "mqa-page1", "dim48-last-layer", "dim32-group7", "dim16-group3", "dim128-group3"],
)
def test_native_decode_attention_matches_reference(spec: CacheSpec, num_heads: int, seq_lens: list[int]) -> None:
    check_decode_attention(BACKEND, spec, num_heads, seq_lens, torch.float32, "cpu")


def test_native_decode_attention_matches_longhand() -> None:
    """Against attention written out per head, not only against the torch backend."""
    spec = CacheSpec(page_size=4, num_kv_heads=2, head_dim=8)
    case, batch = make_decode_case(spec, 4, [9, 4], torch.float32, "cpu", seed=3)
    keys, values = layer_views(case.kv_cache, case.layer)
    out = BACKEND.decode_attention(case.query, keys, values, batch, case.scale)
    for i, seq_len in enumerate(batch.seq_lens_host):
        pages = batch.page_table[i, : math.ceil(seq_len / spec.page_size)].tolist()
        k = torch.cat([keys[p] for p in pages])[:seq_len]
        v = torch.cat([values[p] for p in pages])[:seq_len]
        for head in range(4):
            weights = torch.softmax(k[:, head // 2] @ case.query[i, head] * case.scale, dim=0)
            torch.testing.assert_close(out[i, head], weights @ v[:, head // 2])


def test_calls_the_kernel_does_not_cover_take_the_torch_path() -> None:
    spec = CacheSpec(page_size=4, num_kv_heads=2, head_dim=8)
    # bfloat16 caches, and a non-contiguous query (a view of a wider tensor)
    check_decode_attention(BACKEND, spec, 4, [5, 9], torch.bfloat16, "cpu")
    case, batch = make_decode_case(spec, 4, [5, 9], torch.float32, "cpu")
    keys, values = layer_views(case.kv_cache, case.layer)
    wide = torch.cat([case.query, case.query], dim=-1)[..., :8]
    assert not wide.is_contiguous()
    torch.testing.assert_close(
        BACKEND.decode_attention(wide, keys, values, batch, case.scale),
        TorchBackend().decode_attention(case.query, keys, values, batch, case.scale),
    )


@pytest.mark.parametrize(
    ("context_lens", "query_lens", "dtype"),
    [
        ([0, 5], [6, 3], torch.float32),
        ([0, 37, 64, 3], [17, 40, 1, 64], torch.float32),  # context split from the chunk, merged by log-sum-exp
        ([0, 21], [9, 30], torch.bfloat16),
    ],
)
def test_prefill_attention_matches_reference(
    context_lens: list[int], query_lens: list[int], dtype: torch.dtype
) -> None:
    spec = CacheSpec(page_size=4, num_kv_heads=2, head_dim=8)
    check_prefill_attention(BACKEND, spec, 4, context_lens, query_lens, dtype, "cpu")


@pytest.mark.parametrize(
    ("spec", "num_heads", "context_lens", "query_lens", "with_sinks"),
    [
        # The small preset's shape; chunks after long contexts, a chunk of one, blocks of 32 keys cut mid-way.
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=64), 8, [0, 100, 33, 0], [70, 1, 64, 31], False),
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=64), 8, [0, 47], [300, 90], True),
        # GQA groups of 3 (a pass of two heads, then one), 8 (two passes of four) and 1; head dims 48 and 128.
        (CacheSpec(page_size=8, num_kv_heads=2, head_dim=48), 6, [5, 0], [40, 17], False),
        (CacheSpec(page_size=4, num_kv_heads=1, head_dim=128, num_layers=3, layer=2), 8, [9, 0], [23, 2], True),
        (CacheSpec(page_size=1, num_kv_heads=4, head_dim=16), 4, [3, 0], [5, 33], False),
    ],
    ids=["small-preset", "small-preset-sinks", "group3-dim48", "group8-dim128-sinks", "mha-page1-dim16"],
)
def test_native_prefill_attention_matches_reference(
    spec: CacheSpec,
    num_heads: int,
    context_lens: list[int],
    query_lens: list[int],
    with_sinks: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = count_native_calls(NATIVE_PREFILL, "paged_prefill_attention_f32", monkeypatch)
    check_prefill_attention(
        NATIVE_PREFILL, spec, num_heads, context_lens, query_lens, torch.float32, "cpu", 1, with_sinks
    )
    assert len(calls) == len(query_lens)  # the native kernel ran, once per sequence


@pytest.mark.parametrize("vector_bits", [512, 256, 128])
def test_prefill_attention_runs_natively_from_avx2_by_default(
    vector_bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From AVX2 on, the native kernel serves prefill; on AVX2 only up to NATIVE_PREFILL_MAX_KEYS keys per
    sequence (longer ones take PyTorch's flash kernel); narrower vectors take flash for every sequence. Decode
    attention stays native everywhere."""
    monkeypatch.setattr(BACKEND.native, "vector_bits", vector_bits)
    backend = CpuBackend(BACKEND.native)
    longest = NATIVE_PREFILL_MAX_KEYS.get(vector_bits)
    assert backend.native_prefill is (vector_bits >= 256)
    assert backend.native_prefill_max_keys == longest
    path = "torch flash" if vector_bits < 256 else "native"
    if longest is not None:
        path += f" up to {longest} keys, torch flash beyond"
    assert backend.describe() == f"{vector_bits}-bit vectors, prefill attention {path}"
    forced = CpuBackend(BACKEND.native, native_prefill=True)
    assert forced.describe().endswith("prefill attention native") and forced.native_prefill_max_keys is None
    prefill_calls = count_native_calls(backend, "paged_prefill_attention_f32", monkeypatch)
    decode_calls = count_native_calls(backend, "paged_decode_attention_f32", monkeypatch)
    spec = CacheSpec(page_size=16, num_kv_heads=2, head_dim=64)
    check_prefill_attention(backend, spec, 8, [0, 100], [70, 31], torch.float32, "cpu")
    check_decode_attention(backend, spec, 8, [1, 300], torch.float32, "cpu")
    assert len(prefill_calls) == (2 if vector_bits >= 256 else 0)
    assert len(decode_calls) == 1


def test_on_avx2_a_sequence_past_the_key_limit_takes_flash_in_the_same_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per sequence: a batch mixing short sequences and one past the limit runs the short ones natively, the
    long one through flash, and all of them match the reference (with sinks too)."""
    monkeypatch.setattr(BACKEND.native, "vector_bits", 256)
    backend = CpuBackend(BACKEND.native)
    monkeypatch.setattr(backend, "native_prefill_max_keys", 64)
    calls = count_native_calls(backend, "paged_prefill_attention_f32", monkeypatch)
    spec = CacheSpec(page_size=16, num_kv_heads=2, head_dim=32)
    # Sequences of 40, 130 (past 64: flash) and 64 keys (at the limit: native).
    check_prefill_attention(backend, spec, 8, [0, 100, 30], [40, 30, 34], torch.float32, "cpu", 1, True)
    assert len(calls) == 2


def test_the_library_says_its_vector_width() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx512f" in flags:
        assert BACKEND.native.vector_bits == 512
    elif " avx" in flags:
        assert BACKEND.native.vector_bits == 256
    else:
        assert BACKEND.native.vector_bits in (128, 256, 512)


def test_native_kernels_hold_rows_whose_every_score_is_far_below_zero() -> None:
    """Scores near -250 (queries pointing away from every key): the softmax still shifts by the row's own
    maximum, never by a floor, so its weights are the reference's and not a uniform average (exp of a
    score shifted by a floor of, say, -87 would underflow to the same tiny value for every key)."""
    spec = CacheSpec(page_size=16, num_kv_heads=2, head_dim=64)
    case, prefill = make_prefill_case(spec, 8, [40, 0], [30, 50], torch.float32, "cpu", seed=5)
    keys, values = layer_views(case.kv_cache, case.layer)
    direction = torch.ones(64) / 8.0  # unit length
    keys.copy_(keys * 0.5 + direction * 20.0)  # every key close to +20 along one direction
    query = case.query * 0.5 - direction * 100.0  # every query far the other way: scores near -250
    scores = query[:, 0] @ keys[prefill.page_table[0, 0].long(), 0, 0] * case.scale
    assert scores.max() < -180.0
    # Scores of magnitude 250 carry ~3e-5 of float32 rounding each, so the two sides differ by that much;
    # a softmax shifted by a floor instead of the maximum would be off by tenths.
    torch.testing.assert_close(
        NATIVE_PREFILL.prefill_attention(query, keys, values, prefill, case.scale),
        TorchBackend().prefill_attention(query, keys, values, prefill, case.scale),
        atol=1e-4,
        rtol=1e-3,
    )
    decode_case, decode = make_decode_case(spec, 8, [70, 5], torch.float32, "cpu", seed=6)
    keys, values = layer_views(decode_case.kv_cache, decode_case.layer)
    keys.copy_(keys * 0.5 + direction * 20.0)
    query = decode_case.query * 0.5 - direction * 100.0
    torch.testing.assert_close(
        BACKEND.decode_attention(query, keys, values, decode, decode_case.scale),
        TorchBackend().decode_attention(query, keys, values, decode, decode_case.scale),
        atol=1e-4,
        rtol=1e-3,
    )


def test_native_prefill_refuses_a_head_dim_it_does_not_take() -> None:
    """Head dims other than multiples of 16 up to 128 take the torch path; the kernel itself says -2."""
    spec = CacheSpec(page_size=4, num_kv_heads=2, head_dim=24)
    check_prefill_attention(BACKEND, spec, 4, [3], [5], torch.float32, "cpu")
    query = torch.zeros(1, 2, 24)
    cache = torch.zeros(1, 4, 2, 24)
    pages = torch.zeros(1, dtype=torch.int32)
    status = BACKEND.native.paged_prefill_attention_f32(
        query.data_ptr(), cache.data_ptr(), cache.data_ptr(), *cache.stride()[:3], pages.data_ptr(), 0, 1,
        query.data_ptr(), None, 2, 2, 24, 4, 1.0, 0, 1,
    )  # fmt: skip
    assert status == -2


@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"), [(7, 8, 2, 64), (1, 4, 4, 8), (33, 6, 1, 12), (0, 2, 1, 4)]
)
def test_native_rotary_embedding_matches_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_native_calls(BACKEND, "rotary_neox_f32", monkeypatch)
    # Query and key strided views of one fused projection, as the model passes them.
    check_rotary_embedding(BACKEND, num_tokens, num_heads, num_kv_heads, head_dim, torch.float32, "cpu")
    assert len(calls) == 2  # query and key, natively


def test_native_rotary_refuses_a_position_past_its_cache() -> None:
    cache = make_cos_sin_cache(8, 16, "cpu")
    query, key = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(IndexError, match="8 positions"):
        BACKEND.rotary_embedding(torch.tensor([3, 8]), query, key, cache)
    with pytest.raises(IndexError, match="8 positions"):
        BACKEND.rotary_embedding(torch.tensor([-1, 0]), query, key, cache)


def test_silu_and_mul_matches_reference() -> None:
    gate, up = torch.randn(5, 12), torch.randn(5, 12)
    expected = TorchBackend().silu_and_mul(gate, up)
    torch.testing.assert_close(BACKEND.silu_and_mul(gate.clone(), up), expected)


def test_native_decode_attention_spans_threads_without_sharing_state() -> None:
    """Many (sequence, kv head) items over the OpenMP pool: every one equals its single-thread result."""
    spec = CacheSpec(page_size=16, num_kv_heads=2, head_dim=64)
    case, batch = make_decode_case(spec, 8, [37 * (i + 1) for i in range(24)], torch.float32, "cpu", seed=5)
    keys, values = layer_views(case.kv_cache, case.layer)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = BACKEND.decode_attention(case.query, keys, values, batch, case.scale)
        torch.set_num_threads(max(threads, 4))
        parallel = BACKEND.decode_attention(case.query, keys, values, batch, case.scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, parallel)  # each item runs the same instructions, whichever thread runs it


def test_empty_batch_shapes_are_not_sent_to_native_code() -> None:
    batch = DecodeBatch(torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0, ())
    keys = torch.zeros(2, 4, 2, 8)
    out = BACKEND.decode_attention(torch.zeros(0, 4, 8), keys, keys.clone(), batch, 1.0)
    assert out.shape == (0, 4, 8)


def test_library_is_built_once_per_host_and_reused(tmp_path: Path) -> None:
    """Two processes building into an empty cache at once both load it; a third finds it built."""
    code = (
        "import time; from rayturn.kernels import native; t = time.perf_counter(); k = native.load(); "
        "print(k.path, time.perf_counter() - t)"
    )
    env = {**os.environ, "RAYTURN_CACHE_DIR": str(tmp_path)}
    racers = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    paths = {racer.communicate(timeout=120)[0].split()[0] for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    (built,) = paths
    assert Path(built).parent == tmp_path / "kernels" and Path(built).suffix == ".so"
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [Path(built).name]  # no scratch files left
    before = Path(built).stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert again.stdout.split()[0] == built and Path(built).stat().st_mtime_ns == before


def test_a_failing_build_names_the_compilers_complaint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setenv("RAYTURN_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is None
        reason = native.unavailable_reason()
    finally:
        native.load.cache_clear()
        native._unavailable.clear()
    assert reason is not None and reason.startswith("build failed: ") and "error" in reason
    assert list((tmp_path / "kernels").iterdir()) == []  # failed builds leave nothing behind


def test_an_unwritable_cache_means_the_torch_backend_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("RAYTURN_CACHE_DIR", str(blocker))  # the cache would go under a file
    monkeypatch.delenv("RAYTURN_KERNEL_BACKEND", raising=False)
    native.load.cache_clear()
    try:
        backend = select_backend(torch.device("cpu"))
        reason = native.unavailable_reason()
    finally:
        native.load.cache_clear()
        native._unavailable.clear()
    assert backend.name == "torch"
    assert reason is not None and "NotADirectoryError" in reason


def test_float32_rms_norm_is_the_torch_backends_bit_for_bit() -> None:
    x, weight = torch.randn(7, 64), torch.randn(64)
    assert torch.equal(BACKEND.rms_norm(x, weight, 1e-5), TorchBackend().rms_norm(x, weight, 1e-5))
    half = x.to(torch.bfloat16)
    assert torch.equal(BACKEND.rms_norm(half, weight, 1e-5), TorchBackend().rms_norm(half, weight, 1e-5))
