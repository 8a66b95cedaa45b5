"""Slot mappings from block tables, and padding of replayed slots (DESIGN section 4).

Token i of batch row b at position p writes its KV, in group g, to slot
block_tables[g, idx_mapping[b], p // block_size] * block_size + p % block_size; tokens past qsl[B] up to
the buffer's end (graph padding) get PAD_SLOT_ID, so a padded step writes no KV.

After a prefix hit with bounded replay, a prefilling row b recomputes tokens from rs[b] = replay_start.
Tokens with rs[b] <= position < rs[b] + P already have KV in the prefix-cacheable groups (shared, cached
blocks), so their slots in those groups are set to PAD_SLOT_ID and the KV write skips them: cached KV
stays bit-for-bit as it is. Window groups keep their slots (their KV is being rebuilt).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from raystate.kernels._common import PAD_SLOT_ID, interpreting, reference_forced
from raystate.kernels._launch import FastLaunch


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


# What `cacheable_groups` may be: host ints, an integer index tensor or a bool mask tensor (see
# `cacheable_group_indices`).
CacheableGroups = Sequence[int] | torch.Tensor

# Host-int tuples already checked, by identity: id(tuple) -> (the tuple, its sorted distinct indices, its
# largest index + 1). Keyed by identity, not equality, because (True,) == (1,) and (1.0,) == (1,): an equal
# tuple of bools or floats must not pass as the ints it equals. Holding the tuple keeps its id from being
# reused while it is cached.
_CHECKED_GROUPS: dict[int, tuple[tuple, tuple[int, ...], int]] = {}
_CHECKED_GROUPS_MAX = 256  # tuples kept; past it the cache starts over (tests build many, models one)
# The entry of the tuple checked last. The callers pass one per-model tuple object every step, so the
# launcher's check is an identity test against this (about half the cost of the dict lookup above).
# Starts on a private object, which no caller can pass (None would pass as "no groups").
_last_checked: tuple[object, tuple[int, ...], int] = (object(), (), 0)


def cacheable_group_indices(cacheable_groups: CacheableGroups, num_groups: int) -> tuple[int, ...]:
    """`cacheable_groups` as sorted distinct host ints in [0, num_groups): what every path pads.

    Accepted forms, all meaning the same set of groups:
      - a tuple or list of ints (Python or numpy ints; not bools, which would silently mean groups 0/1),
      - an integer tensor [C] of group indices,
      - a bool tensor [G] (G = num_groups) masking the groups.
    Anything else raises TypeError, an index outside [0, num_groups) IndexError (the kernel would write
    outside slot_mappings and the reference would wrap a negative index), and a mask of the wrong length
    ValueError, each naming the argument. Sorting and dropping duplicates changes nothing padded but keeps
    one compiled kernel per set of groups. A tensor is read with `tolist()`: on CUDA that is a device to
    host copy, a sync, so hot-path callers pass host ints (a tuple is checked once, then cached).
    """
    global _last_checked
    hit = _CHECKED_GROUPS.get(id(cacheable_groups))
    if hit is not None and hit[0] is cacheable_groups and hit[2] <= num_groups:
        _last_checked = hit
        return hit[1]
    if isinstance(cacheable_groups, torch.Tensor):
        if cacheable_groups.dim() != 1:
            raise ValueError(
                f"cacheable_groups: a 1-D tensor expected, got shape {tuple(cacheable_groups.shape)}"
            )
        if cacheable_groups.dtype == torch.bool:
            if cacheable_groups.shape[0] != num_groups:
                raise ValueError(
                    f"cacheable_groups: a bool mask must have one entry per group ({num_groups}), "
                    f"got {cacheable_groups.shape[0]}"
                )
            indices = cacheable_groups.nonzero().flatten().tolist()
        elif cacheable_groups.dtype.is_floating_point or cacheable_groups.dtype.is_complex:
            raise TypeError(
                f"cacheable_groups: an integer or bool tensor expected, got {cacheable_groups.dtype}"
            )
        else:
            indices = cacheable_groups.tolist()
    elif isinstance(cacheable_groups, tuple | list):
        indices = []
        for g in cacheable_groups:
            if isinstance(g, bool | torch.Tensor):
                raise TypeError(
                    "cacheable_groups: a tuple or list must hold ints (group indices), got "
                    f"{type(g).__name__}; pass a mask as a bool tensor"
                )
            try:
                indices.append(operator.index(g))
            except TypeError:
                raise TypeError(
                    f"cacheable_groups: a tuple or list must hold ints, got {type(g).__name__}"
                ) from None
    else:
        raise TypeError(
            "cacheable_groups: a tuple or list of ints, an integer index tensor or a bool mask tensor "
            f"expected, got {type(cacheable_groups).__name__}"
        )
    groups = tuple(sorted(set(indices)))
    for g in groups:
        if not 0 <= g < num_groups:
            raise IndexError(f"cacheable_groups: group index {g} outside [0, {num_groups})")
    if type(cacheable_groups) is tuple and all(type(g) is int for g in cacheable_groups):
        if len(_CHECKED_GROUPS) >= _CHECKED_GROUPS_MAX:
            _CHECKED_GROUPS.clear()
        _last_checked = (cacheable_groups, groups, groups[-1] + 1 if groups else 0)
        _CHECKED_GROUPS[id(cacheable_groups)] = _last_checked
    return groups


def pad_replayed_slots_ref(
    slot_mappings: torch.Tensor,  # int64 [G, T_max], edited in place
    cacheable_groups: CacheableGroups,  # host ints [C], int tensor [C] or bool mask [G]: groups to pad
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    positions: torch.Tensor,  # int64 [>= T]
    replay_start: torch.Tensor,  # int32 [B]: 0 = no replay for that row
    window: int,  # P, the replay length
    pad_slot_id: int = PAD_SLOT_ID,
) -> None:
    groups = cacheable_group_indices(cacheable_groups, slot_mappings.shape[0])
    num_rows = replay_start.shape[0]
    if num_rows == 0 or not groups:
        return
    qsl = query_start_loc[: num_rows + 1].long()
    num_tokens = int(qsl[-1])
    if num_tokens == 0:
        return
    row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=qsl.device), qsl.diff())
    rs = replay_start.long()[row_of_token]  # [T]
    pos = positions[:num_tokens].long()
    replayed = (rs > 0) & (pos >= rs) & (pos < rs + window)  # [T]
    for g in groups:
        row = slot_mappings[g, :num_tokens]
        row.masked_fill_(replayed, pad_slot_id)


# Tokens per program of both kernels, and the pad id of compute_slot_mappings: module constants, not kernel
# parameters (Triton's launch cost grows with every parameter, defaulted constexprs included; a constexpr
# global costs nothing per launch). 256 spreads an 8k-token step over 32 token blocks (times groups).
_BLOCK_TOKENS = 256
_BLOCK = tl.constexpr(_BLOCK_TOKENS)
_PAD = tl.constexpr(PAD_SLOT_ID)


@triton.jit
def _row_of_tokens(query_start_loc_ptr, tokens, num_rows):
    """Batch row of each token: the last b in [0, num_rows) with qsl[b] <= token (0 when num_rows is 0).

    A branchless binary search, one vector load per halving (log2 B + 1 of them), so programs are laid out
    over tokens with no per-row table built on the host. Empty rows (qsl[b] == qsl[b + 1]) are skipped
    because the last match wins; tokens at or past qsl[B] land on row B - 1 and are masked by the caller.
    """
    row = tokens * 0  # int32 [BLOCK]
    step = num_rows * 0 + 1
    while step * 2 <= num_rows:  # the largest power of two <= num_rows
        step = step * 2
    while step > 0:
        cand = row + step  # [BLOCK]
        ok = cand < num_rows
        start = tl.load(query_start_loc_ptr + cand, mask=ok, other=0)
        row = tl.where(ok & (start <= tokens), cand, row)
        step = step // 2
    return row


@triton.jit(do_not_specialize=["out_group_stride", "num_rows", "max_tokens"])
def _compute_slot_mappings_kernel(
    slot_mappings_ptr,  # int64 [G, T_max], unit column stride
    out_group_stride,
    block_tables_ptr,  # int32 [G, R, M], unit column stride
    idx_mapping_ptr,  # int32/int64 [>= B]
    query_start_loc_ptr,  # int32 [B + 1]
    positions_ptr,  # int64 [>= T]
    num_rows,
    max_tokens,
    LAYOUT: tl.constexpr,  # (block tables' group stride, their row stride, block size): fixed per model
):
    TABLE_GROUP_STRIDE: tl.constexpr = LAYOUT[0]
    TABLE_ROW_STRIDE: tl.constexpr = LAYOUT[1]
    BLOCK_SIZE: tl.constexpr = LAYOUT[2]
    # Program (i, g): tokens [i * _BLOCK, (i + 1) * _BLOCK) of group g. Tokens at or past qsl[B] (graph
    # padding) get the pad id, so the tail is written without the host reading qsl[B].
    tokens = tl.program_id(0) * _BLOCK + tl.arange(0, _BLOCK)  # int32 [_BLOCK]
    group = tl.program_id(1).to(tl.int64)
    in_buf = tokens < max_tokens
    is_token = in_buf & (tokens < tl.load(query_start_loc_ptr + num_rows))  # [_BLOCK]
    row = _row_of_tokens(query_start_loc_ptr, tokens, num_rows)  # [_BLOCK]
    state_slot = tl.load(idx_mapping_ptr + row, mask=is_token, other=0).to(tl.int64)
    pos = tl.load(positions_ptr + tokens, mask=is_token, other=0).to(tl.int64)
    table = block_tables_ptr + group * TABLE_GROUP_STRIDE + state_slot * TABLE_ROW_STRIDE  # [_BLOCK]
    block_ids = tl.load(table + pos // BLOCK_SIZE, mask=is_token, other=0).to(tl.int64)
    slots = tl.where(is_token, block_ids * BLOCK_SIZE + pos % BLOCK_SIZE, _PAD)
    tl.store(slot_mappings_ptr + group * out_group_stride + tokens, slots, mask=in_buf)


@triton.jit(do_not_specialize=["group_stride", "num_rows"])
def _pad_replayed_slots_kernel(
    slot_mappings_ptr,  # int64 [G, T_max], unit column stride
    group_stride,
    query_start_loc_ptr,  # int32 [B + 1]
    positions_ptr,  # int64 [>= T]
    replay_start_ptr,  # int32 [B]
    num_rows,
    CONFIG: tl.constexpr,  # (cacheable group indices, replay length P, pad id): fixed per model
):
    CACHEABLE_GROUPS: tl.constexpr = CONFIG[0]
    REPLAY_LEN: tl.constexpr = CONFIG[1]
    PAD: tl.constexpr = CONFIG[2]
    # Program i: tokens [i * _BLOCK, (i + 1) * _BLOCK), every cacheable group. The grid is sized from T_max
    # on the host, so no program needs qsl[B] before it starts.
    tokens = tl.program_id(0) * _BLOCK + tl.arange(0, _BLOCK)  # int32 [_BLOCK]
    is_token = tokens < tl.load(query_start_loc_ptr + num_rows)  # [_BLOCK]
    row = _row_of_tokens(query_start_loc_ptr, tokens, num_rows)  # [_BLOCK]
    replay_start = tl.load(replay_start_ptr + row, mask=is_token, other=0).to(tl.int64)
    # replay_start == 0 means no replay for the row: its tokens read no position and write nothing.
    replaying = is_token & (replay_start > 0)
    pos = tl.load(positions_ptr + tokens, mask=replaying, other=0).to(tl.int64)
    replayed = replaying & (pos >= replay_start) & (pos < replay_start + REPLAY_LEN)  # [_BLOCK]
    pad = tl.full([_BLOCK], PAD, dtype=tl.int64)
    for c in tl.static_range(len(CACHEABLE_GROUPS)):
        out = slot_mappings_ptr + CACHEABLE_GROUPS[c] * group_stride.to(tl.int64)
        tl.store(out + tokens, pad, mask=replayed)


def compute_slot_mappings(
    block_tables: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    slot_mappings: torch.Tensor,
) -> None:
    """One launch, no host sync: fills all T_max columns of every group's slot mapping in place.

    Runs every step. Programs are laid out over (token block, group), each token finding its row by binary
    search, so the work spreads evenly whatever the rows' lengths. It is relaunched through `FastLaunch`,
    and its launch cost still grows with every kernel parameter, so what is fixed per model (the block
    tables' strides, the block size) travels as one constexpr tuple, compiled once per model, and unit
    column strides are checked, not passed.
    """
    # use_triton(slot_mappings), inlined: ~0.1 us less per launch.
    if reference_forced() or not (slot_mappings.is_cuda or interpreting()):
        compute_slot_mappings_ref(
            block_tables, idx_mapping, query_start_loc, positions, block_size, slot_mappings
        )
        return
    num_groups, max_tokens = slot_mappings.shape
    out_group_stride, out_col_stride = slot_mappings.stride()
    table_group_stride, table_row_stride, table_col_stride = block_tables.stride()
    assert out_col_stride == 1 and table_col_stride == 1, "rows must be contiguous"
    if num_groups and max_tokens:
        _launch_slots(
            ((max_tokens + _BLOCK_TOKENS - 1) // _BLOCK_TOKENS, num_groups, 1),
            slot_mappings,
            out_group_stride,
            block_tables,
            idx_mapping,
            query_start_loc,
            positions,
            query_start_loc.numel() - 1,  # B: query_start_loc is 1-D [B + 1]
            max_tokens,
            (table_group_stride, table_row_stride, block_size),
        )


def pad_replayed_slots(
    slot_mappings: torch.Tensor,
    cacheable_groups: CacheableGroups,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    replay_start: torch.Tensor,
    window: int,
    pad_slot_id: int = PAD_SLOT_ID,
) -> None:
    """One launch over the batch's tokens, no host sync; rows with replay_start 0 are untouched.

    Launch-bound (a step's replayed tokens are few), so what it costs is its launch (through `FastLaunch`,
    without Triton's per-call dispatch), which grows with every kernel parameter (a tensor, an int and a
    constexpr alike). So what is fixed per model travels as one constexpr tuple, compiled once per model: the
    cacheable groups as host ints (a tensor would be one more parameter), the window P and the pad id.
    Slot mapping rows are assumed contiguous (checked).

    `cacheable_groups` may be host ints, an index tensor or a bool mask (`cacheable_group_indices`); every
    path turns it into the same sorted host ints first, so the reference and the kernel pad the same
    groups. Callers on the hot path pass a tuple of ints: checked on first sight, then an identity test, no
    sync (a CUDA tensor costs a device to host copy).
    """
    num_groups, max_tokens = slot_mappings.shape
    # The per-model tuple checked last time: no call, no dict lookup (cacheable_group_indices otherwise).
    last = _last_checked
    if cacheable_groups is last[0] and last[2] <= num_groups:
        groups = last[1]
    else:
        groups = cacheable_group_indices(cacheable_groups, num_groups)
    # use_triton(slot_mappings), inlined: ~0.1 us less per launch.
    if reference_forced() or not (slot_mappings.is_cuda or interpreting()):
        pad_replayed_slots_ref(
            slot_mappings, groups, query_start_loc, positions, replay_start, window, pad_slot_id
        )
        return
    num_rows = replay_start.numel()  # 1-D: numel is the cheapest length
    group_stride, col_stride = slot_mappings.stride()
    assert col_stride == 1, "slot mapping rows must be contiguous"
    if num_rows and groups and max_tokens and window > 0:
        _launch_pad(
            ((max_tokens + _BLOCK_TOKENS - 1) // _BLOCK_TOKENS, 1, 1),
            slot_mappings,
            group_stride,
            query_start_loc,
            positions,
            replay_start,
            num_rows,
            (groups, window, pad_slot_id),
        )


# The compiled kernels relaunched without Triton's per-call dispatch once their signatures are known.
_launch_slots = FastLaunch(_compute_slot_mappings_kernel, pointer_args=(0, 2, 3, 4, 5))
_launch_pad = FastLaunch(_pad_replayed_slots_kernel, pointer_args=(0, 2, 3, 4))
