"""SwiGLU's gate: silu(gate) * up from the fused gate/up projection, in one launch.

The MLP computes gate and up with one matmul into [T, 2I]; this kernel reads both halves and writes
[T, I], where torch would launch a silu, a multiply and keep an intermediate. Computed in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import cdiv, use_triton


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    gate_up_stride,
    width,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * gate_up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * gate_up_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    if not use_triton(gate_up):
        return silu_and_mul_ref(gate_up)
    num_rows, two_width = gate_up.shape
    width = two_width // 2
    assert gate_up.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty((num_rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        block = 1024
        _silu_and_mul_kernel[(num_rows, cdiv(width, block))](
            gate_up, out, gate_up.stride(0), width, BLOCK=block
        )
    return out
