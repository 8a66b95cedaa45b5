"""Rotary position embedding: the inverse frequencies of each `RopeConfig` type and the cos/sin table.

Computed as Hugging Face transformers computes them (same formulas, same fp32 operation order), so a
checkpoint rotated here and there agrees bit for bit in fp32: `1 / base ** (2i / d)` for the default
rope, divided by `factor` for "linear", Llama 3.1's wavelength-banded rescaling for "llama3", and YaRN's
ramp between interpolated and extrapolated frequencies for "yarn", whose attention factor scales cos and
sin both. Rotation always runs in fp32 whatever the weights' dtype.
"""

from __future__ import annotations

import math

import torch

from raystate.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """fp32 [head_dim / 2]: the angle per position of each rotated pair."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
    pos_freqs = rope.theta**exponents  # fp32 [dim / 2]
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_rescale(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_blend(pos_freqs, rope, dim, device)
    return inv_freq


def _llama3_rescale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band between blended."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_blend(
    pos_freqs: torch.Tensor, rope: RopeConfig, dim: int, device: torch.device | None
) -> torch.Tensor:
    """YaRN: pairs that turn fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those that turn more than `beta_fast` times are kept, with a linear ramp
    between."""

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float32)  # fp32 [dim / 2]: 1 = extrapolate (keep)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep


def rotary_table(
    head_dim: int, rope: RopeConfig | float, max_positions: int, device: torch.device
) -> torch.Tensor:
    """fp32 [max_positions, head_dim]: each position's cos, then its sin, times the attention factor, as
    `apply_rotary` computes them, so a kernel reading the table rotates by bitwise the same values. A float
    `rope` is the default rope's base."""
    rope = RopeConfig(theta=rope) if not isinstance(rope, RopeConfig) else rope
    inv_freq = rope_inv_freq(rope, head_dim, device)  # fp32 [half]
    positions = torch.arange(max_positions, device=device, dtype=torch.int64)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # fp32 [P, half]
    scale = rope.attention_factor
    return torch.cat((angles.cos() * scale, angles.sin() * scale), dim=-1).contiguous()


def apply_rotary(
    x: torch.Tensor,  # [T, H, head_dim]
    positions: torch.Tensor,  # int64 [T]: absolute positions in the sequence
    rope: RopeConfig | float,
) -> torch.Tensor:
    """Rotates the two halves of each head by angles position * inv_freq (in fp32; the result in x's dtype).

    Angles come from absolute positions, so a token's key is the same whichever chunk computed it: that is
    what lets a chunked, paged forward reuse cached keys. A float `rope` is the default rope's base.
    """
    rope = RopeConfig(theta=rope) if not isinstance(rope, RopeConfig) else rope
    half = x.shape[-1] // 2
    inv_freq = rope_inv_freq(rope, x.shape[-1], x.device)  # fp32 [half]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # fp32 [T, half]
    cos = (angles.cos() * rope.attention_factor)[:, None, :]  # [T, 1, half]
    sin = (angles.sin() * rope.attention_factor)[:, None, :]
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
