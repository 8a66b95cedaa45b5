"""Slot mappings from block tables, and padding of replayed slots (SPEC section 4).

Token i of batch row b at position p writes its KV, in group g, to slot
block_tables[g, idx_mapping[b], p // block_size] * block_size + p % block_size; tokens past qsl[B] up to
the buffer's end (graph padding) get PAD_SLOT_ID, so a padded step writes no KV.

After a prefix hit with bounded replay, a prefilling row b recomputes tokens from rs[b] = replay_start.
Tokens with rs[b] <= position < rs[b] + P already have KV in the prefix-cacheable groups (shared, cached
blocks), so their slots in those groups are set to PAD_SLOT_ID and the KV write skips them: cached KV
stays bit-for-bit as it is. Window groups keep their slots (their KV is being rebuilt).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import PAD_SLOT_ID, cdiv, next_pow2, use_triton


def compute_slot_mappings_ref(
    block_tables: torch.Tensor,  # int32 [G, R, M]: per group, state slot -> block ids
    idx_mapping: torch.Tensor,  # int32/int64 [>= B]: batch row -> state slot
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    positions: torch.Tensor,  # int64 [>= T]
    block_size: int,
    slot_mappings: torch.Tensor,  # int64 [G, T_max], written in place (all T_max columns)
) -> None:
    num_rows = query_start_loc.shape[0] - 1
    qsl = query_start_loc.long()
    num_tokens = int(qsl[-1]) if num_rows > 0 else 0
    slot_mappings[:, num_tokens:] = PAD_SLOT_ID
    if num_tokens == 0:
        return
    row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=qsl.device), qsl.diff())  # [T]
    state_slot = idx_mapping[:num_rows].long()[row_of_token]  # [T]
    pos = positions[:num_tokens].long()
    block_ids = block_tables[:, state_slot, pos // block_size].long()  # [G, T]
    slot_mappings[:, :num_tokens] = block_ids * block_size + pos % block_size


def pad_replayed_slots_ref(
    slot_mappings: torch.Tensor,  # int64 [G, T_max], edited in place
    cacheable_groups: torch.Tensor,  # int32 [C]: group indices into slot_mappings
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    positions: torch.Tensor,  # int64 [>= T]
    replay_start: torch.Tensor,  # int32 [B]: 0 = no replay for that row
    window: int,  # P, the replay length
    pad_slot_id: int = PAD_SLOT_ID,
) -> None:
    num_rows = replay_start.shape[0]
    if num_rows == 0 or cacheable_groups.numel() == 0:
        return
    qsl = query_start_loc[: num_rows + 1].long()
    num_tokens = int(qsl[-1])
    if num_tokens == 0:
        return
    row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=qsl.device), qsl.diff())
    rs = replay_start.long()[row_of_token]  # [T]
    pos = positions[:num_tokens].long()
    replayed = (rs > 0) & (pos >= rs) & (pos < rs + window)  # [T]
    for g in cacheable_groups.tolist():
        row = slot_mappings[g, :num_tokens]
        row.masked_fill_(replayed, pad_slot_id)


@triton.jit(do_not_specialize=["num_rows", "max_tokens"])
def _compute_slot_mappings_kernel(
    slot_mappings_ptr,  # int64 [G, T_max]
    slot_mappings_group_stride,
    block_tables_ptr,  # int32 [G, R, M]
    block_tables_group_stride,
    block_tables_row_stride,
    idx_mapping_ptr,  # int32/int64 [>= B]
    query_start_loc_ptr,  # int32 [B + 1]
    positions_ptr,  # int64 [>= T]
    num_rows,
    max_tokens,
    block_size,
    pad_slot_id,
    BLOCK: tl.constexpr,
):
    # Program (g, b) walks row b's tokens in BLOCK steps; the extra program b = B pads [qsl[B], T_max),
    # so the padded tail is written without the host reading qsl[B].
    group = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    is_row = row < num_rows
    row_start = tl.load(query_start_loc_ptr + row)
    row_end = tl.load(query_start_loc_ptr + row + 1, mask=is_row, other=0)
    row_end = tl.where(is_row, row_end, max_tokens)
    state_slot = tl.load(idx_mapping_ptr + row, mask=is_row, other=0).to(tl.int64)
    table_ptr = block_tables_ptr + group * block_tables_group_stride + state_slot * block_tables_row_stride
    out_ptr = slot_mappings_ptr + group * slot_mappings_group_stride
    # The row flag as a vector: a scalar bool in a mask trips the interpreter.
    is_row_vec = (tl.zeros([BLOCK], dtype=tl.int32) + row) < num_rows  # [BLOCK]
    for block_start in range(row_start, row_end, BLOCK):
        tokens = block_start + tl.arange(0, BLOCK)  # [BLOCK]
        in_row = tokens < row_end
        pos = tl.load(positions_ptr + tokens, mask=in_row & is_row_vec, other=0).to(tl.int64)
        block_ids = tl.load(table_ptr + pos // block_size, mask=in_row & is_row_vec, other=0).to(tl.int64)
        slots = tl.where(is_row_vec, block_ids * block_size + pos % block_size, pad_slot_id)
        tl.store(out_ptr + tokens, slots, mask=in_row)


@triton.jit(do_not_specialize=["num_cacheable", "replay_len", "pad_slot_id"])
def _pad_replayed_slots_kernel(
    slot_mappings_ptr,  # int64 [G, T_max]
    slot_mappings_row_stride,
    cacheable_groups_ptr,  # int32 [C]
    num_cacheable,
    query_start_loc_ptr,  # int32 [B + 1]
    positions_ptr,  # int64 [>= T]
    replay_start_ptr,  # int32 [B]
    replay_len,
    pad_slot_id,
    BLOCK: tl.constexpr,
):
    # Program (b, i) covers tokens [qsl[b] + i * BLOCK, qsl[b] + (i + 1) * BLOCK) clipped to row b's end:
    # the grid is sized from T_max on the host, so no program needs qsl[B] before it starts.
    row = tl.program_id(0)
    block = tl.program_id(1)
    row_start = tl.load(query_start_loc_ptr + row)
    row_end = tl.load(query_start_loc_ptr + row + 1)
    replay_start = tl.load(replay_start_ptr + row).to(tl.int64)
    tokens = row_start + block * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    # replay_start == 0 empties the range, so those rows read and write nothing.
    in_row = tokens < tl.where(replay_start > 0, row_end, row_start)
    pos = tl.load(positions_ptr + tokens, mask=in_row, other=0).to(tl.int64)
    replayed = in_row & (pos >= replay_start) & (pos < replay_start + replay_len)  # [BLOCK]
    pad = tl.zeros([BLOCK], dtype=tl.int64) + pad_slot_id
    for c in range(num_cacheable):
        group = tl.load(cacheable_groups_ptr + c).to(tl.int64)
        tl.store(slot_mappings_ptr + group * slot_mappings_row_stride + tokens, pad, mask=replayed)


def compute_slot_mappings(
    block_tables: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    slot_mappings: torch.Tensor,
) -> None:
    """One launch, no host sync: fills all T_max columns of every group's slot mapping in place."""
    if use_triton(slot_mappings):
        _compute_slot_mappings_triton(
            block_tables, idx_mapping, query_start_loc, positions, block_size, slot_mappings
        )
    else:
        compute_slot_mappings_ref(
            block_tables, idx_mapping, query_start_loc, positions, block_size, slot_mappings
        )


def _compute_slot_mappings_triton(
    block_tables, idx_mapping, query_start_loc, positions, block_size, slot_mappings
) -> None:
    num_groups, max_tokens = slot_mappings.shape
    if num_groups == 0 or max_tokens == 0:
        return
    assert slot_mappings.stride(1) == 1 and block_tables.stride(2) == 1, "rows must be contiguous"
    num_rows = query_start_loc.shape[0] - 1
    _compute_slot_mappings_kernel[(num_groups, num_rows + 1)](
        slot_mappings,
        slot_mappings.stride(0),
        block_tables,
        block_tables.stride(0),
        block_tables.stride(1),
        idx_mapping,
        query_start_loc,
        positions,
        num_rows,
        max_tokens,
        block_size,
        PAD_SLOT_ID,
        BLOCK=min(1024, next_pow2(max_tokens)),
    )


def pad_replayed_slots(
    slot_mappings: torch.Tensor,
    cacheable_groups: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    replay_start: torch.Tensor,
    window: int,
    pad_slot_id: int = PAD_SLOT_ID,
) -> None:
    """One launch over the batch's tokens; rows with replay_start 0 are untouched."""
    if use_triton(slot_mappings):
        _pad_replayed_slots_triton(
            slot_mappings, cacheable_groups, query_start_loc, positions, replay_start, window, pad_slot_id
        )
    else:
        pad_replayed_slots_ref(
            slot_mappings, cacheable_groups, query_start_loc, positions, replay_start, window, pad_slot_id
        )


def _pad_replayed_slots_triton(
    slot_mappings, cacheable_groups, query_start_loc, positions, replay_start, window, pad_slot_id
) -> None:
    num_rows = replay_start.shape[0]
    max_tokens = slot_mappings.shape[1]
    num_cacheable = cacheable_groups.shape[0]
    if num_rows == 0 or num_cacheable == 0 or max_tokens == 0 or window <= 0:
        return
    assert slot_mappings.stride(1) == 1, "slot mapping rows must be contiguous"
    block = min(1024, next_pow2(max_tokens))
    _pad_replayed_slots_kernel[(num_rows, cdiv(max_tokens, block))](
        slot_mappings,
        slot_mappings.stride(0),
        cacheable_groups,
        num_cacheable,
        query_start_loc,
        positions,
        replay_start,
        window,
        pad_slot_id,
        BLOCK=block,
    )
