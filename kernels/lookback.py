"""Engram lookback gather (DESIGN section 1).

For batch row b < num_reqs with state slot s = idx_mapping[b] and chunk start c = num_computed_tokens[s]:
lookback[b, k] = all_token_ids[s, c - 1 - k] for k = 0..D-1 (newest first), -1 where c - 1 - k < 0.
Rows b >= num_reqs are set to -1. The ids come from the request's token history on the device, never from
KV, so they are exact after chunked prefill, prefix hits, preemption and migration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import interpreting, reference_forced
from raystate.kernels._launch import FastLaunch

# Lookback ids per program: a module constant, not a kernel parameter (Triton's launch cost grows with
# every parameter, defaulted constexprs included; a constexpr global costs nothing per launch).
_BLOCK_IDS = 256
_BLOCK = tl.constexpr(_BLOCK_IDS)


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
    lookback_ptr,  # int32 [R, D], contiguous: flat element e is row e // D, column e % D
    idx_mapping_ptr,  # int32/int64 [>= num_reqs]
    num_computed_ptr,  # int32 [S]
    token_ids_ptr,  # int32 [S, L], unit column stride
    num_reqs,
    LAYOUT: tl.constexpr,  # (D, all_token_ids row stride, R * D): fixed per model, one parameter
):
    DEPTH: tl.constexpr = LAYOUT[0]
    IDS_ROW_STRIDE: tl.constexpr = LAYOUT[1]
    NUM_IDS: tl.constexpr = LAYOUT[2]
    # The R * D outputs as one flat range, _BLOCK per program: a few programs of full vectors rather than
    # R programs of D lanes, and rows past num_reqs are reset to -1 in the same launch.
    e = tl.program_id(0) * _BLOCK + tl.arange(0, _BLOCK)  # int32 [_BLOCK]
    in_buf = e < NUM_IDS
    row = e // DEPTH
    k = e % DEPTH
    is_req = in_buf & (row < num_reqs)
    slot = tl.load(idx_mapping_ptr + row, mask=is_req, other=0).to(tl.int64)
    chunk_start = tl.load(num_computed_ptr + slot, mask=is_req, other=0).to(tl.int64)
    pos = chunk_start - 1 - k  # int64 [_BLOCK], newest first
    valid = is_req & (pos >= 0)
    ids = tl.load(token_ids_ptr + slot * IDS_ROW_STRIDE + pos, mask=valid, other=-1)
    tl.store(lookback_ptr + e, ids.to(tl.int32), mask=in_buf)


def gather_lookback(
    lookback: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    all_token_ids: torch.Tensor,
    num_reqs: int,
) -> None:
    """One launch, no host sync: fills all R rows of `lookback` in place.

    Launch-bound (a few thousand ids), so what it costs is its launch: `FastLaunch` relaunches the compiled
    kernel without Triton's per-call dispatch, and the launcher passes as few parameters as it can (each
    one costs): the four tensors, `num_reqs` and one constexpr tuple of what is fixed per model (D, the
    history's row stride, R * D: compiled once per model); unit strides are assumed (`lookback`
    contiguous, history rows contiguous) and checked here, not passed. Nothing is read from the device.
    """
    # use_triton(lookback), inlined: ~0.1 us less per launch.
    if reference_forced() or not (lookback.is_cuda or interpreting()):
        gather_lookback_ref(lookback, idx_mapping, num_computed_tokens, all_token_ids, num_reqs)
        return
    num_rows, depth = lookback.shape
    ids_row_stride, ids_col_stride = all_token_ids.stride()
    assert ids_col_stride == 1 and lookback.is_contiguous(), "lookback and history rows must be contiguous"
    num_ids = num_rows * depth
    if num_ids:
        _launch_gather(
            ((num_ids + _BLOCK_IDS - 1) // _BLOCK_IDS, 1, 1),
            lookback,
            idx_mapping,
            num_computed_tokens,
            all_token_ids,
            num_reqs,
            (depth, ids_row_stride, num_ids),
        )


# The compiled kernel relaunched without Triton's per-call dispatch once its signature is known.
_launch_gather = FastLaunch(_gather_lookback_kernel, pointer_args=(0, 1, 2, 3))
