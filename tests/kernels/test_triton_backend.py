"""TritonBackend against TorchBackend, op by op, with small shapes.

Without a GPU the kernels run on CPU tensors under the Triton interpreter.
``triton.jit`` decides between compiling and interpreting when a kernel is
decorated, so ``tests/conftest.py`` sets TRITON_INTERPRET before any test
module imports Triton.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_cases import (
    CacheSpec,
    check_decode_attention,
    check_gather_scatter_pages,
    check_prefill_attention,
    check_rms_norm,
    check_rotary_embedding,
    check_silu_and_mul,
    check_write_kv,
    layer_views,
    make_kv_cache,
)

from rayturn.kernels import BACKENDS, triton_kernels
from rayturn.kernels.triton_backend import TritonBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The interpreter multiplies the raw bits of bfloat16 tl.dot operands
# (triton-lang/triton#11584, unsupported upstream); float16 covers the 16-bit
# attention path on CPU, and the GPU tests cover bfloat16.
needs_bf16_dot = pytest.mark.skipif(DEVICE == "cpu", reason="Triton interpreter has no bfloat16 tl.dot")


@pytest.fixture(scope="module")
def backend() -> TritonBackend:
    return TritonBackend()


def test_registry_creates_triton_backend() -> None:
    created = BACKENDS.create("triton")
    assert isinstance(created, TritonBackend)
    assert created.name == "triton"


def test_missing_triton_raises_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_kernels, "TRITON_IMPORT_ERROR", ImportError("No module named 'triton'"))
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        TritonBackend()


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((3, 48), torch.float32),  # hidden size not a power of two: masked tail
        ((2, 3, 64), torch.float32),
        ((4, 40), torch.bfloat16),
        ((4, 40), torch.float16),
    ],
)
def test_rms_norm(backend: TritonBackend, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_rms_norm(backend, shape, dtype, DEVICE)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (4, 2, 16, torch.float32),
        (4, 1, 32, torch.float32),
        (4, 2, 16, torch.bfloat16),
    ],
)
def test_rotary_embedding(
    backend: TritonBackend, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    check_rotary_embedding(backend, 5, num_heads, num_kv_heads, head_dim, dtype, DEVICE)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((5, 48), torch.float32),  # half size 24: masked tail
        ((2, 3, 64), torch.float32),
        ((5, 48), torch.bfloat16),
    ],
)
def test_silu_and_mul(backend: TritonBackend, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_silu_and_mul(backend, shape, dtype, DEVICE)


@pytest.mark.parametrize(
    ("spec", "num_tokens", "dtype"),
    [
        (CacheSpec(page_size=4, num_kv_heads=2, head_dim=16), 7, torch.float32),
        (CacheSpec(page_size=16, num_kv_heads=1, head_dim=32), 20, torch.float32),
        (CacheSpec(page_size=4, num_kv_heads=2, head_dim=16), 7, torch.bfloat16),
    ],
)
def test_write_kv(backend: TritonBackend, spec: CacheSpec, num_tokens: int, dtype: torch.dtype) -> None:
    check_write_kv(backend, spec, num_tokens, dtype, DEVICE)


def test_write_kv_skips_negative_slots(backend: TritonBackend) -> None:
    """Slot -1 marks a padding token: nothing is written (the kernel must not write out of bounds)."""
    spec = CacheSpec(page_size=4, num_kv_heads=2, head_dim=16)
    generator = torch.Generator().manual_seed(0)
    kv_cache = make_kv_cache(spec, 3, torch.float32, DEVICE, generator)
    expected = kv_cache.clone()
    token = torch.ones((2, spec.num_kv_heads, spec.head_dim), device=DEVICE)
    slots = torch.tensor([5, -1], device=DEVICE)
    backend.write_kv(token, token, *layer_views(kv_cache, spec.layer), slots)
    expected[1, spec.layer, :, 1] = 1.0  # slot 5 = page 1, offset 1
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize(
    ("spec", "num_heads", "seq_lens", "dtype"),
    [
        # 8 ends on a page boundary, 5 and 13 do not.
        (CacheSpec(page_size=4, num_kv_heads=2, head_dim=16), 4, [8, 5, 13], torch.float32),
        (CacheSpec(page_size=16, num_kv_heads=1, head_dim=32), 4, [16, 3, 37], torch.float32),
        (CacheSpec(page_size=4, num_kv_heads=4, head_dim=16), 4, [1, 12], torch.float32),  # no GQA
        (CacheSpec(page_size=4, num_kv_heads=2, head_dim=16), 4, [8, 5, 13], torch.float16),
        pytest.param(
            CacheSpec(page_size=4, num_kv_heads=2, head_dim=16), 4, [8, 5, 13], torch.bfloat16, marks=needs_bf16_dot
        ),
    ],
)
def test_decode_attention(
    backend: TritonBackend, spec: CacheSpec, num_heads: int, seq_lens: list[int], dtype: torch.dtype
) -> None:
    check_decode_attention(backend, spec, num_heads, seq_lens, dtype, DEVICE)


@pytest.mark.parametrize(
    ("spec", "num_heads", "context_lens", "query_lens", "dtype"),
    [
        # No context; a chunk from 5 to 11 crossing the page boundary at 8; a single-row chunk.
        (CacheSpec(page_size=4, num_kv_heads=2, head_dim=16), 4, [0, 5, 8], [7, 6, 1], torch.float32),
        # Chunks longer than one query block, one after a context ending on a page boundary.
        (CacheSpec(page_size=16, num_kv_heads=1, head_dim=32), 4, [0, 16], [18, 21], torch.float32),
        (CacheSpec(page_size=4, num_kv_heads=2, head_dim=16), 4, [0, 5], [7, 6], torch.float16),
        pytest.param(
            CacheSpec(page_size=4, num_kv_heads=2, head_dim=16),
            4,
            [0, 5],
            [7, 6],
            torch.bfloat16,
            marks=needs_bf16_dot,
        ),
    ],
)
def test_prefill_attention(
    backend: TritonBackend,
    spec: CacheSpec,
    num_heads: int,
    context_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype,
) -> None:
    check_prefill_attention(backend, spec, num_heads, context_lens, query_lens, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_pages(backend: TritonBackend, dtype: torch.dtype) -> None:
    spec = CacheSpec(page_size=4, num_kv_heads=2, head_dim=16)
    check_gather_scatter_pages(backend, spec, [5, 1, 6], dtype, DEVICE)
