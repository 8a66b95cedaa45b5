"""The engram's gated fusion into the residual stream, one launch per engram layer.

    d = <rmsnorm(h) * w_h, rmsnorm(key) * w_k> / sqrt(hidden)
    gate = sigmoid(sign(d) * sqrt(max(|d|, 1e-6)))
    out = h + gate * value

In torch this is about fifteen launches (two norms, casts, product, sum, sign, sqrt, sigmoid, scale, add)
on [T, hidden] rows; here each program reads one row of h, key and value once. The kernel rounds where
the torch formula rounds (the normed vectors, the gate and the gated value to the stream's dtype), so
it matches `engram_gate_ref` up to the fp32 summation order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from raystate.kernels._common import next_pow2, use_triton
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl
from raystate.kernels.norm import rms_norm_ref


def engram_gate_ref(
    hidden: torch.Tensor,  # [T, N]
    key: torch.Tensor,  # [T, N]
    value: torch.Tensor,  # [T, N]
    hidden_norm_weight: torch.Tensor,  # [N]
    key_norm_weight: torch.Tensor,  # [N]
    eps: float,
) -> torch.Tensor:  # [T, N]
    h = rms_norm_ref(hidden, hidden_norm_weight, eps)[0].float()
    k = rms_norm_ref(key, key_norm_weight, eps)[0].float()
    d = (h * k).sum(-1) / math.sqrt(hidden.shape[-1])  # fp32 [T]
    gate = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp(min=1e-6)))
    return hidden + gate.to(hidden.dtype)[:, None] * value


@triton.jit
def _rms_normed(x_ptr, w_ptr, cols, mask, num_cols, eps):
    """fp32 rmsnorm(x) * w of one row, rounded to x's dtype first (as the torch module returns it)."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / num_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return (x * inv_rms * w).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _engram_gate_kernel(
    hidden_ptr,  # [T, N]
    key_ptr,  # [T, N]
    value_ptr,  # [T, N]
    hidden_w_ptr,  # [N]
    key_w_ptr,  # [N]
    out_ptr,  # [T, N]
    hidden_stride,
    key_stride,
    value_stride,
    num_cols,
    eps,
    inv_sqrt_n,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (raystate.kernels._pdl)
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    h_normed = _rms_normed(hidden_ptr + row * hidden_stride, hidden_w_ptr, cols, mask, num_cols, eps)
    k_normed = _rms_normed(key_ptr + row * key_stride, key_w_ptr, cols, mask, num_cols, eps)
    d = tl.sum(h_normed * k_normed, axis=0) * inv_sqrt_n
    mag = tl.sqrt(tl.maximum(tl.abs(d), 1e-6))
    signed = tl.where(d > 0, mag, tl.where(d < 0, -mag, 0.0))
    gate = (1.0 / (1.0 + tl.exp(-signed))).to(out_ptr.dtype.element_ty).to(tl.float32)
    h = tl.load(hidden_ptr + row * hidden_stride + cols, mask=mask, other=0.0)
    v = tl.load(value_ptr + row * value_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gated = (gate * v).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = (h.to(tl.float32) + gated).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * num_cols + cols, out, mask=mask)


def engram_gate(
    hidden: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    key_norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """hidden + gate * value [T, N], the gate from the normed hidden and key rows. One launch."""
    if not use_triton(hidden):
        return engram_gate_ref(hidden, key, value, hidden_norm_weight, key_norm_weight, eps)
    num_rows, num_cols = hidden.shape
    for t in (hidden, key, value):
        assert t.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty((num_rows, num_cols), dtype=hidden.dtype, device=hidden.device)
    if num_rows:
        pdl = use_pdl(hidden)
        _engram_gate_kernel[(num_rows,)](
            hidden,
            key,
            value,
            hidden_norm_weight,
            key_norm_weight,
            out,
            hidden.stride(0),
            key.stride(0),
            value.stride(0),
            num_cols,
            eps,
            1.0 / math.sqrt(num_cols),
            BLOCK=next_pow2(num_cols),
            USE_PDL=pdl,
            **launch_options(pdl),
        )
    return out
