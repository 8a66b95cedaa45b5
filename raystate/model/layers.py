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
from raystate.kernels.split_k import PartialSums, split_k_linear, splits_for
from raystate.model.rope import apply_rotary, rotary_table

__all__ = [
    "RMSNorm",
    "SwiGLU",
    "TokenEmbedding",
    "apply_rotary",
    "head_logits",
    "logits_fp32",
    "project",
    "rotary_table",
]


def project(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor | PartialSums:  # [T, K] -> [T, N]
    """linear(x), or for a decode-sized x on the GPU and a bias-free projection too narrow to fill it,
    the projection as split-K partial sums (`raystate.kernels.split_k`). Only for an output that goes
    straight into an RMSNorm (`rms_norm` sums the partials in its launch)."""
    if linear.bias is None:
        splits = splits_for(x, linear.weight)
        if splits > 1:
            return split_k_linear(x, linear.weight, splits)
    return linear(x)


class RMSNorm(nn.Module):
    """x / rms(x) * (weight + weight_offset), in fp32. Gemma stores its gains as w for a gain of 1 + w
    (offset 1); the offset is added in fp32 in the kernel, never folded into a bf16 weight."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        return rms_norm(x, self.weight, self.eps, None, self.weight_offset)[0]

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor, x_norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (norm(x' + residual), x' + residual), each [T, dim]
        """The residual add before the norm, fused with it (one launch on the GPU). With `x_norm`, x' is
        x_norm(x) (a sandwich layout's norm of the sublayer's output), in the same launch; else x' = x."""
        if x_norm is None:
            return rms_norm(x, self.weight, self.eps, residual, self.weight_offset)
        if (x_norm.eps, x_norm.weight_offset) != (self.eps, self.weight_offset):
            raise ValueError("x_norm: a fused pair of norms needs one eps and one weight offset")
        return rms_norm(x, self.weight, self.eps, residual, self.weight_offset, x_norm.weight)


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


def logits_fp32(
    lm_head: nn.Linear,
    hidden: torch.Tensor,  # [N, hidden]
    out: torch.Tensor | None = None,  # fp32 [N, vocab]: written in place (the decode graph's buffer)
) -> torch.Tensor:  # fp32 [N, vocab]
    """The head's output in fp32; into `out` by the one converting copy, without an fp32 temporary."""
    logits = lm_head(hidden)
    return logits.float() if out is None else out.copy_(logits)


def head_logits(
    lm_head: nn.Linear,  # bias-free
    hidden: torch.Tensor,  # [N, hidden]
    out: torch.Tensor,  # [N, vocab] in the head's dtype: written in place (the decode graph's buffer)
) -> torch.Tensor:  # out
    """The head's output in its own dtype, written by the GEMM straight into `out` (the same product
    `lm_head(hidden)` computes): what a greedy decode step needs, without an fp32 copy of the logits."""
    return torch.mm(hidden, lm_head.weight.t(), out=out)
