"""Rotary position embedding tables (default, linear, Llama 3 and YaRN scaling)."""

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
    if rope.rope_type == "yarn":
        return _yarn_scaling(exponents, rope, head_dim)
    return inv_freq


def attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN scales cos and sin by (so attention logits by its square); 1 for other RoPE types."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


def _yarn_scaling(exponents: torch.Tensor, rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # Dimensions that turn many times over the original context keep their frequency (extrapolation), those
    # that turn less than once are slowed by `factor` (interpolation), with a linear ramp between.
    pos_freqs = rope.theta**exponents
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        context = rope.original_max_position_embeddings
        return (head_dim * math.log(context / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_share = 1 - ramp
    return interpolated * (1 - extrapolation_share) + extrapolated * extrapolation_share


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
    """[max_positions, head_dim] float32: cos of the pair angles, then their sin (both scaled by YaRN's
    attention factor)."""
    inv_freq = inverse_frequencies(rope, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    scale = attention_factor(rope)
    return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1).to(device)
