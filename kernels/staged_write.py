"""Applies a step's staged row writes to a persistent device buffer in one launch.

The host collects the step's edits to a buffer such as the token history `all_token_ids[S, L]` or a
block table `[R, M]` (new requests, appended tokens, appended block ids) as K writes: write k puts
values[value_offsets[k] : value_offsets[k + 1]] at dst[row_ids[k], col_starts[k] : ...]. The four small
arrays travel in one host-to-device copy each and one kernel scatters them, instead of one copy per row.
Writes must not overlap (they run in parallel). Columns past the row's end are dropped, never wrapped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import use_triton


def apply_staged_writes_ref(
    dst: torch.Tensor,  # [R, C], written in place
    row_ids: torch.Tensor,  # int32/int64 [K]
    col_starts: torch.Tensor,  # int32/int64 [K]
    value_offsets: torch.Tensor,  # int32/int64 [K + 1]: write k's values are values[off[k] : off[k + 1]]
    values: torch.Tensor,  # [V], dst's dtype
) -> None:
    num_cols = dst.shape[1]
    offsets = value_offsets.tolist()
    for k, (row, col) in enumerate(zip(row_ids.tolist(), col_starts.tolist(), strict=True)):
        length = min(offsets[k + 1] - offsets[k], max(num_cols - col, 0))
        dst[row, col : col + length] = values[offsets[k] : offsets[k] + length]


@triton.jit
def _apply_staged_writes_kernel(
    dst_ptr,  # [R, C]
    dst_row_stride,
    num_cols,
    row_ids_ptr,  # int32/int64 [K]
    col_starts_ptr,  # int32/int64 [K]
    value_offsets_ptr,  # int32/int64 [K + 1]
    values_ptr,  # [V]
    BLOCK: tl.constexpr,
):
    # One program per write; it walks the write's values in BLOCK steps.
    write = tl.program_id(0)
    row = tl.load(row_ids_ptr + write).to(tl.int64)
    col_start = tl.load(col_starts_ptr + write).to(tl.int64)
    value_start = tl.load(value_offsets_ptr + write).to(tl.int64)
    num_values = (tl.load(value_offsets_ptr + write + 1).to(tl.int64) - value_start).to(tl.int32)
    row_ptr = dst_ptr + row * dst_row_stride
    for block_start in range(0, num_values, BLOCK):
        offsets = block_start + tl.arange(0, BLOCK)  # int32 [BLOCK]
        cols = col_start + offsets
        mask = (offsets < num_values) & (cols < num_cols)
        chunk = tl.load(values_ptr + value_start + offsets, mask=mask)
        tl.store(row_ptr + cols, chunk.to(dst_ptr.dtype.element_ty), mask=mask)


def apply_staged_writes(
    dst: torch.Tensor,
    row_ids: torch.Tensor,
    col_starts: torch.Tensor,
    value_offsets: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """One launch for all K writes; no host sync (K is the host-side length of row_ids)."""
    if use_triton(dst):
        _apply_staged_writes_triton(dst, row_ids, col_starts, value_offsets, values)
    else:
        apply_staged_writes_ref(dst, row_ids, col_starts, value_offsets, values)


def _apply_staged_writes_triton(dst, row_ids, col_starts, value_offsets, values) -> None:
    num_writes = row_ids.shape[0]
    if num_writes == 0 or dst.numel() == 0:
        return
    assert dst.stride(1) == 1 and values.stride(0) == 1, "rows and values must be contiguous"
    _apply_staged_writes_kernel[(num_writes,)](
        dst, dst.stride(0), dst.shape[1], row_ids, col_starts, value_offsets, values, BLOCK=256
    )
