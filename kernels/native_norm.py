"""Float32 RMS norm in one native pass, bit for bit PyTorch's.

PyTorch's CPU ``rms_norm`` is a chain of ops (square, a mean that is a sum and
a division, add, reciprocal square root, two multiplies), each dispatched on
its own: ~50 us for a decode step's [32, 256] on a Zen 1 core, where the
arithmetic takes a few. The native kernel (``rms_norm_f32``) does the same
arithmetic in one pass per row, summing the squares in the order of
PyTorch's own float32 sum (its cascade over vectors of PyTorch's vector
width), so the result is the same to the bit and greedy outputs stay those
of the reference models.

That order depends on the vector width of the sum kernel PyTorch dispatches
to on this host: 8 floats on AVX2 hosts and on AVX-512 ones too (PyTorch
registers its sum kernel for AVX-512 as absent, slower there than its AVX2
build, and runs that; torch 2.13 on a Zen 4 matched 8 at every row length),
4 with NEON, 16 should a build dispatch an AVX-512 sum. So the first call for each row length
checks the kernel against ``torch.rms_norm`` on random rows at each width
PyTorch may use and keeps the one that matches; where none does (another
PyTorch, another host), PyTorch's op serves that row length. Rows shorter
than 16 floats or of 32k floats and more are PyTorch's too (see the bounds).
"""

from __future__ import annotations

import torch

from .native import NativeKernels
from .torch_backend import rows_with_room

LANE_CANDIDATES = (8, 16, 4)  # PyTorch's float vector widths: AVX2 (its sum on AVX-512 hosts too), AVX-512, NEON
_PROBE_ROWS = 64  # a different summation order changes some of 64 random rows' results (each ~1/3 of the time)
_MIN_DIM = 16  # shorter rows take PyTorch's scalar sum, which this kernel does not follow
# From ATen's grain size on, PyTorch may split one row's sum between threads (a lone row): such rows, which no
# model's norm has, take PyTorch's op.
_MAX_DIM = 1 << 15
_SERIAL_ELEMENTS = 1 << 15  # under this many floats one thread: a parallel region costs more than the work


class ExactRmsNorm:
    """``torch.rms_norm`` of float32 rows, one native pass where the kernel reproduces it on this host."""

    def __init__(self, native: NativeKernels) -> None:
        self.native = native
        self.lanes: dict[int, int | None] = {}
        """Per row length, PyTorch's vector width the kernel matched (None: none did; PyTorch's op serves)."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Checks kept few and cheap: at a decode step's size each Python attribute read is ~1% of the kernel call.
        dim = x.shape[-1]
        lanes = self.lanes.get(dim, 0) if self._fits(x, weight) else None
        if lanes == 0:
            lanes = self.lanes[dim] = self._matching_lanes(dim)
        if lanes is None:
            return torch.rms_norm(x, weight.shape, weight, eps)
        return self._run(x, weight, eps, lanes)

    @staticmethod
    def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dtype is weight.dtype is torch.float32
            and x.is_cpu
            and weight.is_cpu
            and 2 <= x.dim() <= 3
            and x.stride(-1) == 1
            and _MIN_DIM <= x.shape[-1] < _MAX_DIM
            and x.numel() > 0
            and weight.shape == x.shape[-1:]
            and weight.is_contiguous()
        )

    def _run(self, x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int) -> torch.Tensor:
        # Contiguous, as the kernel writes it; with room for a packed linear's padding rows (it feeds one).
        out = rows_with_room(tuple(x.shape), torch.float32)
        dim, numel = x.shape[-1], x.numel()
        group_rows, row_stride = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
        status = self.native.rms_norm_f32(
            x.data_ptr(), x.stride(0), group_rows, row_stride, weight.data_ptr(), out.data_ptr(), numel // dim,
            dim, eps, lanes, 1 if numel < _SERIAL_ELEMENTS else torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"native rms norm refused {lanes} lanes")
        return out

    def _matching_lanes(self, dim: int) -> int | None:
        """The vector width at which the kernel equals ``torch.rms_norm`` on random rows of ``dim``, if any."""
        generator = torch.Generator().manual_seed(dim)
        x = torch.randn(_PROBE_ROWS, dim, generator=generator) * 3
        weight = torch.randn(dim, generator=generator)
        expected = torch.rms_norm(x, weight.shape, weight, 1e-6)
        for lanes in LANE_CANDIDATES:
            if torch.equal(self._run(x, weight, 1e-6, lanes), expected):
                return lanes
        return None
