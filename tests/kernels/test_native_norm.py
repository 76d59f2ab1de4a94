"""The ``cpu`` backend's native float32 RMS norm: PyTorch's ``rms_norm`` to the bit, or PyTorch's op itself.

Greedy outputs equal the reference models' only while every op gives the
reference's bits, so these compare with ``torch.equal``, never a tolerance:
across row lengths that are and are not multiples of the vector width (and
of the cascade's four-vector groups and 16-step levels), strided views like
a query taken out of a fused qkv projection, rows of zeros and of huge or
tiny values.
"""

from __future__ import annotations

import pytest
import torch

from rayturn.kernels import native_norm
from rayturn.kernels.cpu_backend import CpuBackend
from rayturn.kernels.native_norm import ExactRmsNorm
from rayturn.kernels.torch_backend import TorchBackend

from .triton_cases import count_native_calls

BACKEND = CpuBackend()
REFERENCE = TorchBackend()
# The float vector width PyTorch's cascade sum runs at, for each CPU capability it reports. On AVX-512 hosts
# it is 8 as well: PyTorch registers no AVX-512 build of its sum kernel (slower there) and runs the AVX2 one.
EXPECTED_LANES = {"AVX2": 8, "AVX512": 8}
# Row lengths: under one four-vector group, odd tails, one 16-step level and the next, model hidden sizes.
DIMS = [16, 17, 31, 32, 64, 100, 128, 255, 256, 1000, 2048, 4096, 5120, 8200, 20000]


def rows(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * 3


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_rms_norm_is_pytorchs_bit_for_bit(dim: int, num_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight = rows((num_rows, dim), dim), rows((dim,), dim + 1)
    BACKEND.rms_norm(x[:1], weight, 1e-6)  # the first call at a row length picks the vector width
    calls = count_native_calls(BACKEND, "rms_norm_f32", monkeypatch)
    for eps in (1e-6, 1e-5):
        assert torch.equal(BACKEND.rms_norm(x, weight, eps), REFERENCE.rms_norm(x, weight, eps))
    if torch.backends.cpu.get_cpu_capability() in EXPECTED_LANES or BACKEND.norm.lanes[dim] is not None:
        assert len(calls) == 2  # where PyTorch's width is known, the native kernel serves every such row


def test_strided_views_are_normed_in_place_of_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-head q and k norms of a fused qkv projection's views (tokens apart by the whole projection),
    a slice of rows wider than the norm, and a permuted 3-d view."""
    num_tokens, heads, kv_heads, head_dim = 9, 4, 2, 64
    qkv = rows((num_tokens, (heads + 2 * kv_heads) * head_dim), 3)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    wide = rows((11, 300), 4)[:, 20:276]
    permuted = rows((heads, num_tokens, head_dim), 5).transpose(0, 1)
    weight, wide_weight = rows((head_dim,), 6), rows((256,), 7)
    BACKEND.rms_norm(q, weight, 1e-6), BACKEND.rms_norm(wide, wide_weight, 1e-6)  # vector widths picked
    calls = count_native_calls(BACKEND, "rms_norm_f32", monkeypatch)
    for x in (q, k, permuted):
        out = BACKEND.rms_norm(x, weight, 1e-6)
        assert out.shape == x.shape
        assert torch.equal(out, REFERENCE.rms_norm(x, weight, 1e-6))
    assert torch.equal(BACKEND.rms_norm(wide, wide_weight, 1e-6), REFERENCE.rms_norm(wide, wide_weight, 1e-6))
    if BACKEND.norm.lanes[head_dim] is not None and BACKEND.norm.lanes[256] is not None:
        assert len(calls) == 4
        assert calls[0][1:4] == (qkv.stride(0), heads, head_dim)  # read in place: group stride, rows, row stride


def test_rows_of_zeros_and_extreme_values_are_pytorchs() -> None:
    x = rows((6, 96), 8)
    x[0] = 0.0  # eps alone under the root
    x[1] *= 1e18  # squares near float32's largest
    x[2] *= 1e-20  # squares that underflow
    x[3, ::2] = 0.0
    weight = rows((96,), 9)
    for eps in (1e-6, 0.0):
        out = BACKEND.rms_norm(x, weight, eps)
        assert torch.equal(out.isnan(), REFERENCE.rms_norm(x, weight, eps).isnan())
        assert torch.equal(out.nan_to_num(), REFERENCE.rms_norm(x, weight, eps).nan_to_num())


def test_the_kernel_sums_at_the_vector_width_pytorch_uses_here() -> None:
    """The width matched on this host is PyTorch's own, and every other width gives other bits: the check
    that picks one could not pass by accident."""
    capability = torch.backends.cpu.get_cpu_capability()
    norm = ExactRmsNorm(BACKEND.native)
    x, weight = rows((64, 4096), 10), rows((4096,), 11)
    expected = torch.rms_norm(x, weight.shape, weight, 1e-6)
    assert torch.equal(norm(x, weight, 1e-6), expected)
    matched = norm.lanes[4096]
    if capability in EXPECTED_LANES:
        assert matched == EXPECTED_LANES[capability]
    assert matched in (*native_norm.LANE_CANDIDATES, None)
    for lanes in native_norm.LANE_CANDIDATES:
        if lanes != matched:
            assert not torch.equal(norm._run(x, weight, 1e-6, lanes), expected)


def test_a_row_length_no_width_matches_takes_pytorchs_op(monkeypatch: pytest.MonkeyPatch) -> None:
    matched = BACKEND.norm.lanes.get(256) or BACKEND.norm._matching_lanes(256)
    if matched is None:
        pytest.skip("the native norm matches no vector width of PyTorch on this host")
    others = tuple(lanes for lanes in native_norm.LANE_CANDIDATES if lanes != matched)
    monkeypatch.setattr(native_norm, "LANE_CANDIDATES", others)
    norm = ExactRmsNorm(BACKEND.native)
    x, weight = rows((5, 256), 12), rows((256,), 13)
    assert torch.equal(norm(x, weight, 1e-6), torch.rms_norm(x, weight.shape, weight, 1e-6))
    assert norm.lanes[256] is None
    calls = count_native_calls(BACKEND, "rms_norm_f32", monkeypatch)
    assert torch.equal(norm(x, weight, 1e-6), torch.rms_norm(x, weight.shape, weight, 1e-6))
    assert calls == []  # decided once per row length, not probed again


@pytest.mark.parametrize(
    "x,weight",
    [
        (torch.randn(4, 8), torch.randn(8)),  # shorter than PyTorch's vectorised sum
        (torch.randn(1, 1 << 15), torch.randn(1 << 15)),  # a lone row PyTorch may sum on several threads
        (torch.randn(4, 64).bfloat16(), torch.randn(64).bfloat16()),
        (torch.randn(4, 64), torch.randn(64).double()),
        (torch.randn(64, 4).t(), torch.randn(64)),  # the norm's dim strided
        (torch.randn(2, 3, 4, 64), torch.randn(64)),  # four dims
        (torch.randn(0, 64), torch.randn(64)),
    ],
    ids=["dim8", "dim32k", "bf16", "f64-weight", "strided-dim", "4d", "empty"],
)
def test_calls_the_kernel_does_not_take_are_pytorchs(
    x: torch.Tensor, weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_native_calls(BACKEND, "rms_norm_f32", monkeypatch)
    out = BACKEND.rms_norm(x, weight, 1e-6)
    assert torch.equal(out, REFERENCE.rms_norm(x, weight, 1e-6))
    assert calls == []
