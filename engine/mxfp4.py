"""MXFP4 checkpoints (GPT-OSS): expert weights dequantised as they are read.

A quantised tensor ``X`` is stored as two: ``X_blocks`` [..., rows, groups,
16] uint8, two FP4 (E2M1) values a byte, low nibble first, 32 values a group;
and ``X_scales`` [..., rows, groups] uint8, one power-of-two scale a group
(E8M0: the value is ``2 ** (scale - 127)``). Dequantised, ``X`` is [..., rows,
groups * 32]; Hugging Face then transposes its last two dims, the layout
``transformers`` keeps GPT-OSS experts in, so the rest of loading sees the
same tensors as from an unquantised checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks`` [..., rows, groups, 16] and ``scales`` [..., rows, groups] -> [..., rows, groups * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(expected blocks [..., groups, bytes] and scales [..., groups])"
        )
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), dtype=dtype, device=blocks.device)
    # One leading slice at a time bounds the index tensors (8 bytes a value) to one slice's worth.
    for index in range(blocks.shape[0]):
        packed, part = blocks[index], out[index]
        part[..., 0::2] = table[(packed & 0x0F).long()]
        part[..., 1::2] = table[(packed >> 4).long()]
        torch.ldexp(part, scales[index].to(torch.int32)[..., None] - SCALE_BIAS, out=part)
    return out.flatten(-2)


def dequantize_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each ``X_blocks``/``X_scales`` pair replaced by ``X`` in ``dtype``, its last
    two dims transposed as Hugging Face keeps it; a half whose partner never comes is an error naming it."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}  # name without suffix -> (suffix, tensor) seen first
    for name, tensor in weights:
        suffix = next((s for s in (BLOCKS_SUFFIX, SCALES_SUFFIX) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        if base not in pending:
            pending[base] = (suffix, tensor)
            continue
        other_suffix, other = pending.pop(base)
        if other_suffix == suffix:
            raise ValueError(f"tensor {name!r} appears twice in checkpoint")
        blocks, scales = (tensor, other) if suffix == BLOCKS_SUFFIX else (other, tensor)
        try:
            yield base, dequantize(blocks, scales, dtype).transpose(-2, -1)
        except ValueError as err:
            raise ValueError(f"tensor {base!r}: {err}") from None
    if pending:
        halves = ", ".join(sorted(base + suffix for base, (suffix, _) in pending.items()))
        raise ValueError(f"MXFP4 tensors without their blocks or scales: {halves}")
