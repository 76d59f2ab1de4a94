"""Case builders and checks shared by the backend tests (Triton, native CPU).

Each ``check_*`` builds random inputs for one op, runs it on the backend under
test and on ``TorchBackend`` (the reference), and asserts they agree. The CPU
tests (Triton interpreter, small shapes) and the GPU tests (native, large
shapes) call the same checks with different sizes.

Caches are multi-layer and the ops get the strided view of one layer, so
kernels that ignore strides fail. Page tables are shuffled (non-monotonic,
interleaved between sequences) and carry padding columns that must never be
read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rayturn.kernels import moe
from rayturn.kernels.backend import DecodeBatch, KernelBackend, PrefillBatch
from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.torch_backend import TorchBackend

REFERENCE = TorchBackend()


def tolerance(dtype: torch.dtype) -> float:
    """atol and rtol for comparing against the reference; 16-bit types round differently."""
    if dtype == torch.float32:
        return 2e-5
    if dtype == torch.float16:
        return 2e-3
    return 2e-2


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=tolerance(expected.dtype), rtol=tolerance(expected.dtype))


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    """Random normal values drawn on the CPU, so a seed gives the same case on every device."""
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


# --------------------------------------------------------------------------- paged cache


@dataclass(frozen=True)
class CacheSpec:
    """Shape of a paged KV cache and which layer the op works on."""

    page_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 2
    layer: int = 1


def make_kv_cache(
    spec: CacheSpec, num_pages: int, dtype: torch.dtype, device: str, generator: torch.Generator
) -> torch.Tensor:
    """[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim] of random values."""
    shape = (num_pages, spec.num_layers, 2, spec.page_size, spec.num_kv_heads, spec.head_dim)
    return randn(shape, dtype, device, generator)


def layer_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided key and value views of one layer, as the model passes them."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]


def make_page_table(
    seq_lens: list[int], page_size: int, num_pages: int, device: str, generator: torch.Generator
) -> torch.Tensor:
    """Shuffled, distinct page ids per sequence, plus one padding column of arbitrary (valid) ids."""
    pages_per_seq = [pages_for(seq_len, page_size) for seq_len in seq_lens]
    assert sum(pages_per_seq) <= num_pages
    shuffled = torch.randperm(num_pages, generator=generator)
    max_pages = max(pages_per_seq) + 1
    table = torch.randint(0, num_pages, (len(seq_lens), max_pages), generator=generator)
    start = 0
    for i, count in enumerate(pages_per_seq):
        table[i, :count] = shuffled[start : start + count]
        start += count
    return table.to(device=device, dtype=torch.int32)


def spare_pages(seq_lens: list[int], page_size: int) -> int:
    """Pages for all sequences plus a few unused ones, so page ids are not a dense prefix."""
    return sum(pages_for(seq_len, page_size) for seq_len in seq_lens) + 3


# --------------------------------------------------------------------------- elementwise ops


def check_rms_norm(
    backend: KernelBackend, shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = randn(shape, dtype, device, generator) * 3
    weight = 1 + 0.1 * randn(shape[-1:], dtype, device, generator)
    assert_matches(backend.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6))


def check_rotary_embedding(
    backend: KernelBackend,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    max_positions = 4 * num_tokens + 8
    # Query and key are views into one fused qkv projection, so they are not contiguous.
    qkv = randn((num_tokens, num_heads + 2 * num_kv_heads, head_dim), dtype, device, generator)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    positions = torch.randint(0, max_positions, (num_tokens,), generator=generator).to(device)
    cos_sin_cache = make_cos_sin_cache(max_positions, head_dim, device)
    expected_query, expected_key = REFERENCE.rotary_embedding(positions, query, key, cos_sin_cache)
    actual_query, actual_key = backend.rotary_embedding(positions, query, key, cos_sin_cache)
    assert_matches(actual_query, expected_query)
    assert_matches(actual_key, expected_key)


def make_cos_sin_cache(max_positions: int, head_dim: int, device: str, base: float = 10000.0) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


def check_silu_and_mul(
    backend: KernelBackend, shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = randn(shape, dtype, device, generator) * 2
    gate, up = x.chunk(2, dim=-1)  # strided halves of one buffer, as a fused projection yields
    assert_matches(backend.silu_and_mul(gate, up), REFERENCE.silu_and_mul(gate, up))
    contiguous = gate.contiguous(), up.contiguous()
    assert_matches(backend.silu_and_mul(*contiguous), REFERENCE.silu_and_mul(*contiguous))


# --------------------------------------------------------------------------- cache ops


def check_write_kv(
    backend: KernelBackend, spec: CacheSpec, num_tokens: int, dtype: torch.dtype, device: str, seed: int = 0
) -> None:
    """Write to random distinct slots of one layer; every other slot and layer must stay untouched."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = pages_for(num_tokens, spec.page_size) + 3
    kv_cache = make_kv_cache(spec, num_pages, dtype, device, generator)
    token_shape = (num_tokens, spec.num_kv_heads, spec.head_dim)
    key = randn(token_shape, dtype, device, generator)
    value = randn(token_shape, dtype, device, generator)
    slot_mapping = torch.randperm(num_pages * spec.page_size, generator=generator)[:num_tokens]
    slot_mapping = slot_mapping.to(device=device, dtype=torch.int64)

    expected = kv_cache.clone()
    REFERENCE.write_kv(key, value, *layer_views(expected, spec.layer), slot_mapping)
    backend.write_kv(key, value, *layer_views(kv_cache, spec.layer), slot_mapping)
    # Stores are plain copies: exact equality.
    assert torch.equal(kv_cache, expected)


def check_gather_scatter_pages(
    backend: KernelBackend, spec: CacheSpec, page_ids: list[int], dtype: torch.dtype, device: str, seed: int = 0
) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_pages = max(page_ids) + 2
    kv_cache = make_kv_cache(spec, num_pages, dtype, device, generator)
    ids = torch.tensor(page_ids, dtype=torch.int32, device=device)
    page_shape = tuple(kv_cache.shape[1:])

    out = torch.empty((len(page_ids), *page_shape), dtype=dtype, device=device)
    expected_out = torch.empty_like(out)
    backend.gather_pages(kv_cache, ids, out)
    REFERENCE.gather_pages(kv_cache, ids, expected_out)
    assert torch.equal(out, expected_out)

    src = randn((len(page_ids), *page_shape), dtype, device, generator)
    actual_cache, expected_cache = kv_cache.clone(), kv_cache.clone()
    backend.scatter_pages(src, actual_cache, ids)
    REFERENCE.scatter_pages(src, expected_cache, ids)
    assert torch.equal(actual_cache, expected_cache)

    # copy_pages is built on the two ops; copy the pages onto their reversed ids.
    destination = ids.flip(0)
    actual_cache, expected_cache = kv_cache.clone(), kv_cache.clone()
    backend.copy_pages(actual_cache, ids, destination)
    REFERENCE.copy_pages(expected_cache, ids, destination)
    assert torch.equal(actual_cache, expected_cache)


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionCase:
    query: torch.Tensor
    kv_cache: torch.Tensor
    layer: int
    scale: float


def make_decode_case(
    spec: CacheSpec, num_heads: int, seq_lens: list[int], dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[AttentionCase, DecodeBatch]:
    generator = torch.Generator().manual_seed(seed)
    num_pages = spare_pages(seq_lens, spec.page_size)
    kv_cache = make_kv_cache(spec, num_pages, dtype, device, generator)
    query = randn((len(seq_lens), num_heads, spec.head_dim), dtype, device, generator)
    batch = DecodeBatch(
        page_table=make_page_table(seq_lens, spec.page_size, num_pages, device, generator),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return AttentionCase(query, kv_cache, spec.layer, 1 / math.sqrt(spec.head_dim)), batch


def make_prefill_case(
    spec: CacheSpec,
    num_heads: int,
    context_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[AttentionCase, PrefillBatch]:
    """The cache already holds every key, the chunk's own included, as the interface requires."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [context + query for context, query in zip(context_lens, query_lens)]
    num_pages = spare_pages(seq_lens, spec.page_size)
    kv_cache = make_kv_cache(spec, num_pages, dtype, device, generator)
    query = randn((sum(query_lens), num_heads, spec.head_dim), dtype, device, generator)
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    batch = PrefillBatch(
        page_table=make_page_table(seq_lens, spec.page_size, num_pages, device, generator),
        query_start_loc=int32(query_start_loc),
        seq_lens=int32(seq_lens),
        context_lens=int32(context_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
    return AttentionCase(query, kv_cache, spec.layer, 1 / math.sqrt(spec.head_dim)), batch


def check_decode_attention(
    backend: KernelBackend,
    spec: CacheSpec,
    num_heads: int,
    seq_lens: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    with_sinks: bool = False,
    sliding_window: int | None = None,
) -> None:
    case, batch = make_decode_case(spec, num_heads, seq_lens, dtype, device, seed)
    key_cache, value_cache = layer_views(case.kv_cache, case.layer)
    sinks = make_sinks(num_heads, device, seed) if with_sinks else None
    actual = backend.decode_attention(case.query, key_cache, value_cache, batch, case.scale, sinks, sliding_window)
    expected = REFERENCE.decode_attention(case.query, key_cache, value_cache, batch, case.scale, sinks, sliding_window)
    assert_matches(actual, expected)


def make_sinks(num_heads: int, device: str, seed: int = 0) -> torch.Tensor:
    """Float32 sink logits per head, large enough to take a visible share of each softmax."""
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(device)


def check_prefill_attention(
    backend: KernelBackend,
    spec: CacheSpec,
    num_heads: int,
    context_lens: list[int],
    query_lens: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    with_sinks: bool = False,
    sliding_window: int | None = None,
) -> None:
    case, batch = make_prefill_case(spec, num_heads, context_lens, query_lens, dtype, device, seed)
    key_cache, value_cache = layer_views(case.kv_cache, case.layer)
    sinks = make_sinks(num_heads, device, seed) if with_sinks else None
    actual = backend.prefill_attention(case.query, key_cache, value_cache, batch, case.scale, sinks, sliding_window)
    expected = REFERENCE.prefill_attention(case.query, key_cache, value_cache, batch, case.scale, sinks, sliding_window)
    assert_matches(actual, expected)


# --------------------------------------------------------------------------- mixture of experts


@dataclass(frozen=True)
class MoeSpec:
    """One mixture-of-experts case; ``idle_expert`` gets no token (its router logit is far below the rest)."""

    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    renormalize: bool = True
    biased: bool = False
    clamped_swiglu: bool = False
    idle_expert: int | None = None
    # Weights stored [experts, in, out] and passed as transposed views: kernels must honour their strides.
    transposed_weights: bool = False

    @property
    def label(self) -> str:
        """A short test id: tokens x hidden x intermediate, experts, top-k and the options set."""
        options = [
            name
            for name, on in (
                ("plain-topk", not self.renormalize),
                ("bias", self.biased),
                ("clamped", self.clamped_swiglu),
                (f"idle{self.idle_expert}", self.idle_expert is not None),
                ("transposed", self.transposed_weights),
            )
            if on
        ]
        shape = f"{self.num_tokens}x{self.hidden_size}x{self.intermediate_size}-e{self.num_experts}-top{self.top_k}"
        return "-".join([shape, *options])


@dataclass(frozen=True)
class MoeCase:
    """``fused_moe``'s tensors for one ``MoeSpec``."""

    x: torch.Tensor
    router_logits: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    activation: moe.ClampedSwiGLU | None

    def run(self, backend: KernelBackend, spec: MoeSpec) -> torch.Tensor:
        return backend.fused_moe(
            self.x,
            self.router_logits,
            self.gate_up,
            self.down,
            spec.top_k,
            spec.renormalize,
            self.gate_up_bias,
            self.down_bias,
            self.activation,
        )

    def upcast(self) -> MoeCase:
        """The same values in float32."""

        def up(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.float()

        return MoeCase(
            self.x.float(),
            self.router_logits.float(),
            self.gate_up.float(),
            self.down.float(),
            up(self.gate_up_bias),
            up(self.down_bias),
            self.activation,
        )


def make_moe_case(spec: MoeSpec, dtype: torch.dtype, device: str, generator: torch.Generator) -> MoeCase:
    """Random tensors for ``spec``, weights scaled so every layer's outputs stay near unit size."""
    experts, hidden, intermediate = spec.num_experts, spec.hidden_size, spec.intermediate_size
    x = randn((spec.num_tokens, hidden), dtype, device, generator)
    logits = randn((spec.num_tokens, experts), torch.float32, device, generator) * 2
    if spec.idle_expert is not None:
        logits[:, spec.idle_expert] = -1e4
    if spec.transposed_weights:
        gate_up = randn((experts, hidden, 2 * intermediate), dtype, device, generator).transpose(1, 2)
        down = randn((experts, intermediate, hidden), dtype, device, generator).transpose(1, 2)
    else:
        gate_up = randn((experts, 2 * intermediate, hidden), dtype, device, generator)
        down = randn((experts, hidden, intermediate), dtype, device, generator)
    biases = (
        (
            randn((experts, 2 * intermediate), dtype, device, generator) * 0.5,
            randn((experts, hidden), dtype, device, generator) * 0.5,
        )
        if spec.biased
        else (None, None)
    )
    # A limit low enough that both of its clamps bite.
    activation = moe.ClampedSwiGLU(alpha=1.702, limit=0.8) if spec.clamped_swiglu else None
    return MoeCase(
        x, logits.to(dtype), gate_up / math.sqrt(hidden), down / math.sqrt(intermediate), *biases, activation
    )


def check_fused_moe(backend: KernelBackend, spec: MoeSpec, dtype: torch.dtype, device: str, seed: int = 0) -> None:
    """float32 against the reference at 1e-4; 16-bit types against the reference run in float32 on the same
    (rounded) inputs, since the reference rounds its intermediates to 16 bits at other points."""
    case = make_moe_case(spec, dtype, device, torch.Generator().manual_seed(seed))
    reference_case = case.upcast()
    if spec.idle_expert is not None:
        _, expert_ids = moe.route_top_k(reference_case.router_logits, spec.top_k, spec.renormalize)
        assert not (expert_ids == spec.idle_expert).any()
    actual, expected = case.run(backend, spec), reference_case.run(REFERENCE, spec)
    assert actual.shape == expected.shape
    assert actual.dtype == dtype
    rtol = 1e-4 if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(actual.float(), expected, rtol=rtol, atol=rtol)


# --------------------------------------------------------------------------- native kernels


def count_native_calls(
    backend: CpuBackend, kernel_name: str, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[object, ...]]:
    """Each call of the cpu backend's native ``kernel_name`` from now on, recorded (its arguments) and passed on:
    a test can then tell the native path ran rather than the torch fallback."""
    kernel = getattr(backend.native, kernel_name)
    calls: list[tuple[object, ...]] = []

    def counted(*args: object) -> int:
        calls.append(args)
        return int(kernel(*args))

    monkeypatch.setattr(backend.native, kernel_name, counted)
    return calls
