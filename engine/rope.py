"""Rotary position embedding tables (default, linear and Llama 3 scaling)."""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], float32, as the checkpoint was trained with."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band
    # between interpolated smoothly (Llama 3.1's recipe).
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the pair angles, then their sin."""
    inv_freq = inverse_frequencies(rope, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
