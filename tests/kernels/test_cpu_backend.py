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
from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.torch_backend import TorchBackend

from .triton_cases import CacheSpec, check_decode_attention, check_prefill_attention, layer_views, make_decode_case

BACKEND = CpuBackend()


@pytest.mark.parametrize(
    "spec,num_heads,seq_lens",
    [
        (CacheSpec(page_size=16, num_kv_heads=2, head_dim=64), 8, [1, 16, 17, 300, 641]),
        (CacheSpec(page_size=4, num_kv_heads=4, head_dim=8), 4, [3, 5, 8, 1]),  # no GQA
        (CacheSpec(page_size=1, num_kv_heads=1, head_dim=12), 6, [7, 2]),  # one token per page, MQA
        (CacheSpec(page_size=8, num_kv_heads=2, head_dim=48, num_layers=3, layer=2), 4, [33, 64, 9]),
    ],
    ids=["small-preset", "mha", "mqa-page1", "dim48-last-layer"],
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
