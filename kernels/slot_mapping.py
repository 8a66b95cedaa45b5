"""Slot mappings from block tables, and padding of replayed slots (SPEC section 4).

After a prefix hit with bounded replay, a prefilling row b recomputes tokens from rs[b] = replay_start.
Tokens with rs[b] <= position < rs[b] + P already have KV in the prefix-cacheable groups (shared, cached
blocks), so their slots in those groups are set to PAD_SLOT_ID and the KV write skips them: cached KV
stays bit-for-bit as it is. Window groups keep their slots (their KV is being rebuilt).
"""

from __future__ import annotations

import torch

from raystate.kernels._common import PAD_SLOT_ID, use_triton


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


def _pad_replayed_slots_triton(*args) -> None:
    raise NotImplementedError("Triton pad_replayed_slots: being written")
