"""TritonBackend against TorchBackend natively on a GPU (CUDA or ROCm), at model-like sizes.

The same checks as ``tests/kernels/test_triton_backend.py`` (shared through
``tests/kernels/triton_cases.py``) with head_dim 128, page_size 16, sequences
of up to ~2000 tokens, in bfloat16 and float32; and the mixture-of-experts
MLP (``tests/kernels/test_triton_moe.py``) at Qwen3-MoE and GPT-OSS expert
sizes. Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA or ROCm GPU", allow_module_level=True)
pytest.importorskip("triton")

from triton_cases import (
    CacheSpec,
    MoeSpec,
    check_decode_attention,
    check_fused_moe,
    check_gather_scatter_pages,
    check_prefill_attention,
    check_rms_norm,
    check_rotary_embedding,
    check_silu_and_mul,
    check_write_kv,
)

from rayturn.kernels.triton_backend import TritonBackend

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float32]
LLAMA_8B = CacheSpec(page_size=16, num_kv_heads=8, head_dim=128)  # 32 query heads: 4 per kv head
MQA = CacheSpec(page_size=16, num_kv_heads=1, head_dim=128)


@pytest.fixture(scope="module")
def backend() -> TritonBackend:
    return TritonBackend()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 4096), (7, 3000)])  # 3000: masked tail
def test_rms_norm(backend: TritonBackend, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_rms_norm(backend, shape, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(backend: TritonBackend, dtype: torch.dtype) -> None:
    check_rotary_embedding(backend, 257, 32, 8, 128, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(backend: TritonBackend, dtype: torch.dtype) -> None:
    check_silu_and_mul(backend, (65, 2 * 11008), dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(backend: TritonBackend, dtype: torch.dtype) -> None:
    check_write_kv(backend, LLAMA_8B, 301, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("spec", "num_heads"), [(LLAMA_8B, 32), (MQA, 8)])
def test_decode_attention(backend: TritonBackend, spec: CacheSpec, num_heads: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 16, 17, 511, 1029, 2000]
    check_decode_attention(backend, spec, num_heads, seq_lens, dtype, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("spec", "num_heads"), [(LLAMA_8B, 32), (MQA, 8)])
def test_prefill_attention(backend: TritonBackend, spec: CacheSpec, num_heads: int, dtype: torch.dtype) -> None:
    context_lens = [0, 0, 512, 1000, 33]
    query_lens = [1, 700, 513, 1000, 64]
    check_prefill_attention(backend, spec, num_heads, context_lens, query_lens, dtype, DEVICE)


GPT_OSS = CacheSpec(page_size=16, num_kv_heads=8, head_dim=64)  # 64 query heads: 8 per kv head


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_sinks,window", [(True, None), (True, 128), (False, 100)], ids=str)
def test_decode_attention_with_sinks_and_window(
    backend: TritonBackend, with_sinks: bool, window: int | None, dtype: torch.dtype
) -> None:
    seq_lens = [1, 16, 17, 128, 511, 2000]
    check_decode_attention(backend, GPT_OSS, 64, seq_lens, dtype, DEVICE, 0, with_sinks, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_sinks,window", [(True, None), (True, 128), (False, 100)], ids=str)
def test_prefill_attention_with_sinks_and_window(
    backend: TritonBackend, with_sinks: bool, window: int | None, dtype: torch.dtype
) -> None:
    context_lens = [0, 0, 512, 1000, 33]
    query_lens = [1, 700, 513, 1000, 64]
    check_prefill_attention(backend, GPT_OSS, 64, context_lens, query_lens, dtype, DEVICE, 0, with_sinks, window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_pages(backend: TritonBackend, dtype: torch.dtype) -> None:
    spec = CacheSpec(page_size=16, num_kv_heads=8, head_dim=128, num_layers=4, layer=3)
    check_gather_scatter_pages(backend, spec, [40, 3, 17, 0, 99, 12], dtype, DEVICE)


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [
        # Qwen3-MoE's experts (fewer of them): decode, a mid batch, and a prefill of 256 rows per expert.
        (MoeSpec(1, 2048, 768, 64, 8), torch.bfloat16),
        (MoeSpec(300, 2048, 768, 64, 8, idle_expert=5), torch.bfloat16),
        (MoeSpec(2048, 2048, 768, 64, 8), torch.bfloat16),
        # GPT-OSS's experts (fewer of them): biased, clamped SwiGLU.
        (MoeSpec(257, 2880, 2880, 16, 4, biased=True, clamped_swiglu=True), torch.bfloat16),
        (MoeSpec(200, 1024, 512, 16, 2, renormalize=False, biased=True), torch.float32),
        (MoeSpec(33, 1024, 500, 16, 2, transposed_weights=True), torch.float16),
    ],
    ids=lambda value: value.label if isinstance(value, MoeSpec) else str(value),
)
def test_fused_moe(backend: TritonBackend, spec: MoeSpec, dtype: torch.dtype) -> None:
    check_fused_moe(backend, spec, dtype, DEVICE)
