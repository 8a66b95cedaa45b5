"""Plain-torch building blocks of the reference model: RMSNorm, rotary embedding, SwiGLU MLP, embedding.

Normalisation and rotation run in fp32 whatever the weights' dtype, so a bf16 model on the GPU and the
fp32 model on the CPU differ only by the rounding of their matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raystate.kernels.activation import silu_and_mul
from raystate.kernels.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x + residual), x + residual), each [T, dim]
        """The residual add before the norm, fused with it (one launch on the GPU)."""
        return rms_norm(x, self.weight, self.eps, residual)


def apply_rotary(
    x: torch.Tensor,  # [T, H, head_dim]
    positions: torch.Tensor,  # int64 [T]: absolute positions in the sequence
    theta: float,
) -> torch.Tensor:
    """Rotates the two halves of each head by angles position * theta^(-2i/head_dim).

    Angles come from absolute positions, so a token's key is the same whichever chunk computed it: that is
    what lets a chunked, paged forward reuse cached keys. The frequencies are built on the fly (a handful
    of elements) rather than kept as a buffer that `.to(bfloat16)` would round.
    """
    half = x.shape[-1] // 2
    exponents = torch.arange(0, half, device=x.device, dtype=torch.float32) * (2.0 / x.shape[-1])
    inv_freq = theta ** (-exponents)  # fp32 [half]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # fp32 [T, half]
    cos = angles.cos()[:, None, :]  # [T, 1, half]
    sin = angles.sin()[:, None, :]
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def rotary_table(head_dim: int, theta: float, max_positions: int, device: torch.device) -> torch.Tensor:
    """fp32 [max_positions, head_dim]: cos of each position's angles, then sin, computed exactly as
    `apply_rotary` computes them, so a kernel reading the table rotates by bitwise the same values."""
    half = head_dim // 2
    exponents = torch.arange(0, half, device=device, dtype=torch.float32) * (2.0 / head_dim)
    inv_freq = theta ** (-exponents)  # fp32 [half]
    positions = torch.arange(max_positions, device=device, dtype=torch.int64)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # fp32 [P, half]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up as one projection (one matmul, one fused gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class TokenEmbedding(nn.Module):
    """Token ids of any integer dtype (the worker keeps them as int32) -> vectors."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        if not self.weight.is_meta:  # (a normal draw on meta costs seconds of torch._refs imports)
            nn.init.normal_(self.weight)  # overwritten by the seeded init of raystate.model.weights

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # int [T] -> [T, hidden]
        return F.embedding(token_ids.long(), self.weight)
