"""RMSNorm, optionally fused with the residual add before it: one launch instead of about six torch ops.

A decoder layer adds each sublayer's output to the residual stream and normalises the sum for the next
sublayer. Fusing the two saves a read and a write of the stream and, in a decode step, the launches: a
step of the bench model runs ~50 of these. The sum is rounded to the stream's dtype before it is
normalised, exactly as the unfused `residual + x` followed by the norm would round it.

Gemma 3 also normalises each sublayer's output before adding it (four norms a layer): `pre_weight` runs
that norm in the same launch, its result rounded to the stream's dtype before the add, as the unfused
norm would round it. At the Gemma-3-4B shape that halves a decode step's 137 norm launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import next_pow2, use_triton
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl
from raystate.kernels.split_k import PartialSums


def rms_norm_ref(
    x: torch.Tensor | PartialSums,  # [T, N], or a split-K projection's fp32 partials of it
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]: added to x first
    weight_offset: float = 0.0,  # the gain is weight + offset (Gemma's norms: 1 + w)
    pre_weight: torch.Tensor | None = None,  # [N]: x is first normalised with this gain (same eps, offset)
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (normed [T, N], x' + residual [T, N] or None)
    if isinstance(x, PartialSums):
        x = x.total()
    if pre_weight is not None:
        x = rms_norm_ref(x, pre_weight, eps, None, weight_offset)[0]
    summed = None
    if residual is not None:
        x = summed = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32 * (weight.float() + weight_offset)).to(x.dtype), summed


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]; with X_SPLITS, fp32 [X_SPLITS, T, N] partial sums of it
    residual_ptr,  # [T, N] (unused without HAS_RESIDUAL)
    out_ptr,  # [T, N]
    summed_ptr,  # [T, N]: x + residual (unused without HAS_RESIDUAL)
    weight_ptr,  # [N]
    pre_weight_ptr,  # [N]: x's own norm first (unused without PRE_NORM)
    x_stride,
    x_split_stride,  # between partials (unused without X_SPLITS)
    residual_stride,
    num_cols,
    eps,
    weight_offset,
    X_SPLITS: tl.constexpr,  # 0: x is the tensor; S > 0: x is the sum of S partials, rounded to out's dtype
    HAS_RESIDUAL: tl.constexpr,
    PRE_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (raystate.kernels._pdl)
):
    # One program per row; outputs are contiguous [T, N]. Every load is issued first: they are
    # independent, and a store between them would keep the compiler from hoisting the later ones (it
    # cannot prove the pointers apart), making the row a chain of memory round trips.
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    for split in tl.static_range(1, X_SPLITS):
        x += tl.load(x_ptr + split * x_split_stride + row * x_stride + cols, mask=mask, other=0.0)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
    if PRE_NORM:
        pre_w = tl.load(pre_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    if X_SPLITS > 0:  # the projection's output as its GEMM would have rounded it
        x = x.to(out_ptr.dtype.element_ty)
    if PRE_NORM:  # rounded to the stream's dtype, as the unfused norm's output would be
        x32 = x.to(tl.float32)
        pre_inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / num_cols + eps)
        x = (x32 * pre_inv_rms * pre_w).to(out_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(summed_ptr.dtype.element_ty)  # rounded like torch's add
        tl.store(summed_ptr + row * num_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / num_cols
    inv_rms = 1.0 / tl.sqrt(mean_sq + eps)
    tl.store(out_ptr + row * num_cols + cols, (x32 * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor | PartialSums,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    pre_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * (weight + offset), x + residual), or (norm(x) * (weight + offset), None)
    without a residual. With `pre_weight`, x stands for norm(x) * (pre_weight + offset) throughout. x may
    be a split-K projection's `PartialSums` [T, N]: they are summed in the same launch."""
    splits, split_stride = 0, 0
    if isinstance(x, PartialSums):
        parts, dtype = x
        if not use_triton(parts):
            return rms_norm_ref(x, weight, eps, residual, weight_offset, pre_weight)
        assert parts.dim() == 3 and parts.stride(-1) == 1, "partials [S, T, N], rows contiguous"
        splits, split_stride, x2, shape = parts.shape[0], parts.stride(0), parts[0], parts.shape[1:]
    elif not use_triton(x):
        return rms_norm_ref(x, weight, eps, residual, weight_offset, pre_weight)
    else:
        dtype, shape = x.dtype, x.shape
        x2 = x.reshape(-1, shape[-1])
    num_rows, num_cols = x2.shape
    assert x2.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty((num_rows, num_cols), dtype=dtype, device=x2.device)
    summed = None
    res2 = x2
    if residual is not None:
        res2 = residual.reshape(-1, num_cols)
        assert res2.stride(-1) == 1, "residual rows must be contiguous"
        summed = torch.empty_like(out)
    if num_rows:
        pdl = use_pdl(x2)
        _rms_norm_kernel[(num_rows,)](
            x2,
            res2,
            out,
            summed if summed is not None else out,
            weight,
            pre_weight if pre_weight is not None else weight,
            x2.stride(0),
            split_stride,
            res2.stride(0),
            num_cols,
            eps,
            weight_offset,
            X_SPLITS=splits,
            HAS_RESIDUAL=residual is not None,
            PRE_NORM=pre_weight is not None,
            BLOCK=next_pow2(num_cols),
            USE_PDL=pdl,
            **launch_options(pdl),
        )
    return out.view(shape), (summed.view(shape) if summed is not None else None)


def rms_norm_heads_ref(
    x: torch.Tensor,  # [T, N]: normalised in place
    weight: torch.Tensor,  # [head_dim]
    eps: float,
    weight_offset: float,
    col_start: int,
    head_dim: int,
    num_heads: int,
) -> torch.Tensor:
    span = x[:, col_start : col_start + num_heads * head_dim]
    heads = span.reshape(x.shape[0], num_heads, head_dim)
    normed = rms_norm_ref(heads, weight, eps, None, weight_offset)[0]
    span.copy_(normed.reshape(span.shape))
    return x


@triton.jit
def _rms_norm_heads_kernel(
    x_ptr,  # [T, N], normalised in place
    weight_ptr,  # [HEAD_DIM]
    x_stride,
    col_start,
    eps,
    weight_offset,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (token, head).
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HEAD_DIM
    ptrs = x_ptr + row * x_stride + col_start + head * HEAD_DIM + cols
    x32 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / HEAD_DIM + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    tl.store(ptrs, (x32 * inv_rms * w).to(x_ptr.dtype.element_ty), mask=mask)


def rms_norm_heads_(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    col_start: int,
    head_dim: int,
    num_heads: int,
) -> torch.Tensor:
    """RMSNorm, in place, of `num_heads` consecutive spans of `head_dim` columns of each row of x [T, N],
    from column `col_start`, all with the one gain weight [head_dim] (+ offset): the q or k norms of a
    fused qkv projection (per head: Qwen3, Gemma 3; over the whole projection, one span: OLMo 3) in one
    launch, where slicing, normalising and concatenating would take several and copy q, k and v."""
    if not use_triton(x):
        return rms_norm_heads_ref(x, weight, eps, weight_offset, col_start, head_dim, num_heads)
    assert x.dim() == 2 and x.stride(-1) == 1, "rows must be contiguous"
    if x.shape[0]:
        pdl = use_pdl(x)
        _rms_norm_heads_kernel[(x.shape[0], num_heads)](
            x,
            weight,
            x.stride(0),
            col_start,
            eps,
            weight_offset,
            HEAD_DIM=head_dim,
            BLOCK=next_pow2(head_dim),
            USE_PDL=pdl,
            **launch_options(pdl),
        )
    return x
