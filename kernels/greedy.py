"""Greedy ids of a decode step, checked: each row's argmax, or a failure id where the row's maximum is not
finite (a NaN anywhere, a +inf, or every logit -inf), read straight from the head's output in the model's
dtype.

Why: the decode graph used to convert the head's bf16 output into an fp32 buffer (at a 262k vocabulary
and batch 64, 100 MB of traffic, 49 us a step) and take torch's row max over it, which works one row per
thread block, 64 of 132 SMs (34 us). A batch whose every row is greedy needs neither: the argmax of a
bf16 row is the argmax of its exact fp32 conversion. Here a grid of rows x column chunks reads the bf16
logits once, each program keeping its chunk's max and the first column that holds it, and a second launch
(a programmatic dependent of the first) picks each row's winner in chunk order, so ties go to the lowest
id as torch.max's do. NaN is tracked explicitly, so a NaN anywhere in a row fails the row whatever order
the reductions take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import cdiv, next_pow2, use_triton
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl

CHUNK = 8192  # columns per program of the first launch


def greedy_checked_ref(logits: torch.Tensor, failed_id: int) -> torch.Tensor:  # [N, V] -> int64 [N]
    """One torch reduction (max propagates NaN, and its index is the first maximal column)."""
    top, ids = torch.max(logits, dim=-1)
    return torch.where(torch.isfinite(top), ids, failed_id)


@triton.jit
def _chunk_max_kernel(
    logits_ptr,  # [N, V]
    chunk_max_ptr,  # fp32 [N, C]: the chunk's max (NaN if the chunk holds one)
    chunk_arg_ptr,  # int32 [N, C]: the first column of the chunk that holds it
    row_stride,
    vocab,
    num_chunks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    num_nan = tl.sum((x != x).to(tl.int32), axis=0)
    top = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
    first = tl.min(tl.where(x == top, cols, vocab), axis=0)
    tl.store(chunk_max_ptr + row * num_chunks + chunk, tl.where(num_nan > 0, float("nan"), top))
    tl.store(chunk_arg_ptr + row * num_chunks + chunk, first)


@triton.jit
def _row_pick_kernel(
    chunk_max_ptr,  # fp32 [N, C]
    chunk_arg_ptr,  # int32 [N, C]
    out_ptr,  # int64 [N]
    num_chunks,
    failed_id,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    valid = c < num_chunks
    m = tl.load(chunk_max_ptr + row * num_chunks + c, mask=valid, other=float("-inf"))
    arg = tl.load(chunk_arg_ptr + row * num_chunks + c, mask=valid, other=0)
    num_nan = tl.sum((m != m).to(tl.int32), axis=0)
    top = tl.max(tl.where(m != m, float("-inf"), m), axis=0)
    # Chunks are in column order: the first chunk holding the max holds its first column.
    winner = tl.min(tl.where(m == top, c, BLOCK_C), axis=0)
    best = tl.sum(tl.where(c == winner, arg, 0), axis=0).to(tl.int64)
    finite = (top < float("inf")) & (top > float("-inf")) & (num_nan == 0)
    tl.store(out_ptr + row, tl.where(finite, best, failed_id))


def greedy_checked(logits: torch.Tensor, failed_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [N]: each row's first maximal column of logits [N, V] (any float dtype), or `failed_id` where
    the row's maximum is not finite; written into `out` (int64 [N], contiguous) when given, which saves
    the decode graph a copy launch. Two launches, no host sync (CUDA-graph safe)."""
    if not use_triton(logits):
        ids = greedy_checked_ref(logits, failed_id)
        return ids if out is None else out.copy_(ids)
    n, vocab = logits.shape
    assert logits.stride(1) == 1, "rows must be contiguous"
    block = min(CHUNK, next_pow2(vocab))
    chunks = cdiv(vocab, block)
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    assert out.shape == (n,) and out.dtype == torch.int64 and out.is_contiguous(), (
        "out: int64 [N], contiguous"
    )
    if n == 0:
        return out
    chunk_max = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty((n, chunks), dtype=torch.int32, device=logits.device)
    pdl = use_pdl(logits)
    _chunk_max_kernel[(n, chunks)](
        logits,
        chunk_max,
        chunk_arg,
        logits.stride(0),
        vocab,
        chunks,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=8 if block >= 4096 else 4,
        **launch_options(pdl),
    )
    _row_pick_kernel[(n,)](
        chunk_max,
        chunk_arg,
        out,
        chunks,
        failed_id,
        BLOCK_C=next_pow2(chunks),
        USE_PDL=pdl,
        **launch_options(pdl),
    )
    return out
