"""Model-specific state of a hybrid (engram + sliding-window + full attention) model on one worker.

Two persistent buffers, allocated once at max size so captured graphs can read their addresses:
- `lookback[R, D]`: the D token ids before each batch row's chunk start (SPEC section 1), gathered from
  the token history with one `gather_lookback` launch per step.
- `replay_start[R]`: each batch row's replay start (SPEC section 4), the replay start of its request for
  prefill rows and 0 for decode rows; staged on the host and copied without a sync. When any is nonzero
  one `pad_replayed_slots` launch pads the replayed tokens' slots in the prefix-cacheable groups, and the
  starts go to the sliding-window groups' metadata only (their key floor).
"""

from __future__ import annotations

import numpy as np
import torch

from raystate.config import KVCacheGroupSpec, replay_tokens
from raystate.kernels import gather_lookback, pad_replayed_slots
from raystate.model.attention import ForwardMetadata, GroupMetadata
from raystate.state.input_batch import InputBatch
from raystate.state.requests import RequestStates


class HybridModelState:
    def __init__(
        self,
        groups: tuple[KVCacheGroupSpec, ...],
        lookback_depth: int,
        max_num_reqs: int,
        device: torch.device,
    ) -> None:
        self.groups = groups
        self.replay_tokens = replay_tokens(groups)  # P
        self.max_num_reqs = max_num_reqs
        self.lookback = torch.full(
            (max_num_reqs, max(lookback_depth, 1)), -1, dtype=torch.int32, device=device
        )
        self.replay_start = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # int32 [R]
        self._replay_start_host = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_replay_start = np.zeros(max_num_reqs, dtype=np.int64)  # per state slot, host
        # Host ints: pad_replayed_slots compiles them in (fixed per model) rather than take a tensor.
        self.cacheable_groups = tuple(i for i, g in enumerate(groups) if g.prefix_cacheable)

    def add_request(self, slot: int, replay_start: int) -> None:
        """Holds for all of the request's prefill chunks; decode rows always run with 0."""
        self.slot_replay_start[slot] = replay_start

    def prepare_inputs(self, batch: InputBatch, states: RequestStates) -> torch.Tensor:
        """Fills `lookback` for this batch (one launch, no sync) and returns it."""
        gather_lookback(
            self.lookback, batch.idx_mapping, states.num_computed_tokens, states.all_token_ids, batch.num_reqs
        )
        return self.lookback

    def prepare_attn(
        self,
        batch: InputBatch,
        states: RequestStates,
        block_tables: torch.Tensor,  # int32 [G, B, M]
        slot_mappings: torch.Tensor,  # int64 [G, T], padded in place
    ) -> ForwardMetadata:
        """Per-group attention metadata; replay starts reach the sliding-window groups only."""
        rs_host = self._replay_start_host
        rs_host[:] = 0
        b = batch.num_reqs
        rs_host[:b] = np.where(batch.is_prefilling_np, self.slot_replay_start[batch.idx_mapping_np], 0)
        any_replay = bool(rs_host[:b].any())
        self.replay_start.copy_(torch.from_numpy(rs_host), non_blocking=True)
        rs = self.replay_start[:b]
        if any_replay and self.replay_tokens > 0 and self.cacheable_groups:
            pad_replayed_slots(
                slot_mappings,
                self.cacheable_groups,
                batch.query_start_loc,
                batch.positions,
                rs,
                self.replay_tokens,
            )
        groups = {}
        for g, spec in enumerate(self.groups):
            groups[spec.name] = GroupMetadata(
                block_table=block_tables[g],
                slot_mapping=slot_mappings[g],
                sliding_window=spec.sliding_window,
                kv_floor=rs if (spec.is_sliding and any_replay) else None,
            )
        return ForwardMetadata(
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            groups=groups,
            max_query_len=batch.max_query_len,
        )

    def prepare_dummy_inputs(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For graph capture and profiling: lookback all -1, replay starts all 0, same tensors as a step."""
        self.lookback.fill_(-1)
        self.replay_start.zero_()
        return self.lookback, self.replay_start[:num_reqs]
