"""Sampled ids written into the token history on the device.

For row b: all_token_ids[slots[b], positions[b] + offset] = max(ids[b], 0). A failed row's id (negative)
is stored as 0, a valid id, so that a step planned on top of this one (async scheduling) reads a token;
the host never keeps it. Every write of sampled ids into the history goes through here: the decode
graph's greedy ids (offset 1: one past each row's input position, which is what its graph has staged;
padding rows, at position 0, write index 1 of the scratch slot) and the ids the worker samples on the
host side (offset 0, at the positions it computed).

Why a kernel: the decode graph wrote this as torch's add, clamp, cast and indexed store, four launches
of a few rows each at the end of every step; here it is one, launched as a programmatic dependent of the
greedy pick before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import next_pow2, use_triton
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl


def write_token_ids_ref(
    all_token_ids: torch.Tensor,  # int32 [S, L], written in place
    slots: torch.Tensor,  # int [B]: each row's state slot
    positions: torch.Tensor,  # int [B]: each row's id goes at positions + offset of its history
    ids: torch.Tensor,  # int [B]
    offset: int = 0,
) -> None:
    all_token_ids[slots.long(), positions.long() + offset] = ids.clamp(min=0).to(all_token_ids.dtype)


@triton.jit
def _write_token_ids_kernel(
    token_ids_ptr,  # int32 [S, L], unit column stride
    slots_ptr,  # int [B]
    positions_ptr,  # int [B]
    ids_ptr,  # int [B]
    num_rows,
    row_stride,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = b < num_rows
    slot = tl.load(slots_ptr + b, mask=valid, other=0).to(tl.int64)
    pos = tl.load(positions_ptr + b, mask=valid, other=0).to(tl.int64)
    token = tl.load(ids_ptr + b, mask=valid, other=0)
    tl.store(token_ids_ptr + slot * row_stride + pos + OFFSET, tl.maximum(token, 0).to(tl.int32), mask=valid)


def write_token_ids(
    all_token_ids: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    ids: torch.Tensor,
    offset: int = 0,
) -> None:
    """One launch, no host sync (CUDA-graph safe); the reference off the GPU without the interpreter."""
    if not use_triton(all_token_ids):
        write_token_ids_ref(all_token_ids, slots, positions, ids, offset)
        return
    assert all_token_ids.dtype == torch.int32 and all_token_ids.stride(1) == 1, "history: int32 rows"
    num_rows = slots.shape[0]
    if num_rows == 0:
        return
    block = min(1024, next_pow2(num_rows))
    pdl = use_pdl(all_token_ids)
    _write_token_ids_kernel[(triton.cdiv(num_rows, block),)](
        all_token_ids,
        slots,
        positions,
        ids,
        num_rows,
        all_token_ids.stride(0),
        OFFSET=offset,
        BLOCK=block,
        USE_PDL=pdl,
        **launch_options(pdl),
    )
