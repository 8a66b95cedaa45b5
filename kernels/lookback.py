"""Engram lookback gather (SPEC section 1).

For batch row b < num_reqs with state slot s = idx_mapping[b] and chunk start c = num_computed_tokens[s]:
lookback[b, k] = all_token_ids[s, c - 1 - k] for k = 0..D-1 (newest first), -1 where c - 1 - k < 0.
Rows b >= num_reqs are set to -1. The ids come from the request's token history on the device, never from
KV, so they are exact after chunked prefill, prefix hits, preemption and migration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import next_pow2, use_triton


def gather_lookback_ref(
    lookback: torch.Tensor,  # int32 [R, D], written in place
    idx_mapping: torch.Tensor,  # int32/int64 [>= num_reqs]: batch row -> state slot
    num_computed_tokens: torch.Tensor,  # int32 [S]
    all_token_ids: torch.Tensor,  # int32 [S, L] (row stride may exceed L)
    num_reqs: int,
) -> None:
    lookback.fill_(-1)
    if num_reqs == 0 or lookback.shape[1] == 0:
        return
    depth = lookback.shape[1]
    slots = idx_mapping[:num_reqs].long()
    starts = num_computed_tokens[slots].long()  # [num_reqs]
    k = torch.arange(depth, device=lookback.device)
    pos = starts[:, None] - 1 - k[None, :]  # [num_reqs, D]
    ids = all_token_ids[slots[:, None], pos.clamp(min=0)]
    lookback[:num_reqs] = torch.where(pos >= 0, ids, torch.full_like(ids, -1)).to(lookback.dtype)


@triton.jit(do_not_specialize=["num_reqs"])
def _gather_lookback_kernel(
    lookback_ptr,  # int32 [R, D]
    lookback_row_stride,
    idx_mapping_ptr,  # int32/int64 [>= num_reqs]
    num_computed_ptr,  # int32 [S]
    token_ids_ptr,  # int32 [S, L]
    token_ids_row_stride,
    token_ids_col_stride,
    num_reqs,
    depth,
    BLOCK_D: tl.constexpr,
):
    # One program per lookback row, so rows past num_reqs are reset to -1 in the same launch.
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    in_depth = k < depth
    # The row's "is a request" flag as a vector: a scalar bool in a mask trips the interpreter.
    is_req = (tl.zeros([BLOCK_D], dtype=tl.int32) + row) < num_reqs  # [BLOCK_D]
    slot = tl.load(idx_mapping_ptr + row, mask=row < num_reqs, other=0).to(tl.int64)
    chunk_start = tl.load(num_computed_ptr + slot, mask=row < num_reqs, other=0).to(tl.int64)
    pos = chunk_start - 1 - k  # int64 [BLOCK_D], newest first
    valid = is_req & in_depth & (pos >= 0)
    ids = tl.load(
        token_ids_ptr + slot * token_ids_row_stride + pos * token_ids_col_stride, mask=valid, other=-1
    )
    out_ptr = lookback_ptr + row.to(tl.int64) * lookback_row_stride + k
    tl.store(out_ptr, ids.to(tl.int32), mask=in_depth)


def gather_lookback(
    lookback: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    all_token_ids: torch.Tensor,
    num_reqs: int,
) -> None:
    """One launch, no host sync: fills all R rows of `lookback` in place."""
    if use_triton(lookback):
        _gather_lookback_triton(lookback, idx_mapping, num_computed_tokens, all_token_ids, num_reqs)
    else:
        gather_lookback_ref(lookback, idx_mapping, num_computed_tokens, all_token_ids, num_reqs)


def _gather_lookback_triton(lookback, idx_mapping, num_computed_tokens, all_token_ids, num_reqs) -> None:
    num_rows, depth = lookback.shape
    if num_rows == 0 or depth == 0:
        return
    assert lookback.stride(1) == 1, "lookback rows must be contiguous"
    _gather_lookback_kernel[(num_rows,)](
        lookback,
        lookback.stride(0),
        idx_mapping,
        num_computed_tokens,
        all_token_ids,
        all_token_ids.stride(0),
        all_token_ids.stride(1),
        num_reqs,
        depth,
        BLOCK_D=next_pow2(depth),
    )
