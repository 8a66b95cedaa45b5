"""Gated MLP activations: act(gate) * up from the fused gate/up projection, in one launch.

The MLP computes gate and up with one matmul into [T, 2I]; this kernel reads both halves and writes
[T, I], where torch would launch the activation, a multiply and keep an intermediate. Computed in fp32,
rounded once. Two gates: SiLU (SwiGLU: Llama, Qwen, Mistral, OLMo) and GELU with the tanh approximation
(GeGLU: Gemma).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import cdiv, use_triton
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl

ACTIVATIONS = ("silu", "gelu_tanh")


def act_and_mul_ref(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.float().chunk(2, dim=-1)
    if act == "silu":
        gated = torch.nn.functional.silu(gate)
    else:
        gated = torch.nn.functional.gelu(gate, approximate="tanh")
    return (gated * up).to(gate_up.dtype)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    return act_and_mul_ref(gate_up, "silu")


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    gate_up_stride,
    width,  # I
    GELU_TANH: tl.constexpr,  # False: silu
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (raystate.kernels._pdl)
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * gate_up_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 x (1 + tanh(y)), y = sqrt(2 / pi) (x + 0.044715 x^3); tanh from exp(-2|y|), which never
        # overflows
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(y))
        tanh_abs = (1.0 - e) / (1.0 + e)
        tanh = tl.where(y < 0, -tanh_abs, tanh_abs)
        out = 0.5 * gate * (1.0 + tanh) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    return act_and_mul(gate_up, "silu")


def act_and_mul(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """[T, 2I] (gate | up) -> act(gate) * up [T, I]; act is "silu" or "gelu_tanh"."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act: one of {ACTIVATIONS}, got {act!r}")
    if not use_triton(gate_up):
        return act_and_mul_ref(gate_up, act)
    num_rows, two_width = gate_up.shape
    width = two_width // 2
    assert gate_up.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = 1024
        pdl = use_pdl(gate_up)
        _silu_and_mul_kernel[(num_rows, cdiv(width, block))](
            gate_up,
            out,
            gate_up.stride(0),
            width,
            GELU_TANH=act == "gelu_tanh",
            BLOCK=block,
            USE_PDL=pdl,
            **launch_options(pdl),
        )
    return out
