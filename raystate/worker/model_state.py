"""Model-specific state of a hybrid (engram + sliding-window + full attention) model on one worker.

Two persistent buffers, allocated once at max size so captured graphs can read their addresses:
- `lookback[R, D]`: the D token ids before each batch row's chunk start (DESIGN section 1), gathered from
  the token history with one `gather_lookback` launch per step; none for a model without engram (D = 0,
  the Hugging Face families), whose lookback stays all -1 and unread.
- `replay_start[R]`: each batch row's replay start (DESIGN section 4), the replay start of its request for
  prefill rows and 0 for decode rows; staged on the host and copied without a sync. When any is nonzero
  one `pad_replayed_slots` launch pads the replayed tokens' slots in the prefix-cacheable groups, and the
  starts go to the sliding-window groups' metadata only (their key floor).

`build_metadata` is the one place a step's lookback and attention metadata are made, for an eager step
and inside a captured decode graph alike.
"""

from __future__ import annotations

import numpy as np
import torch

from raystate.kernels import gather_lookback, pad_replayed_slots
from raystate.kv_layout import KVCacheGroupSpec, replay_tokens
from raystate.model.attention import ForwardMetadata, GroupMetadata
from raystate.worker.block_table import BlockTables
from raystate.worker.input_batch import InputBatch
from raystate.worker.requests import RequestStates


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
        self.lookback_depth = lookback_depth  # 0: a model without engram (no gather is launched)
        # int32 [R, D]; no columns (no memory) without engram
        self.lookback = torch.full((max_num_reqs, lookback_depth), -1, dtype=torch.int32, device=device)
        self.replay_start = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)  # int32 [R]
        self._replay_start_host = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_replay_start = np.zeros(max_num_reqs, dtype=np.int64)  # per state slot, host
        # Host ints: pad_replayed_slots compiles them in (fixed per model) rather than take a tensor.
        self.cacheable_groups = tuple(i for i, g in enumerate(groups) if g.prefix_cacheable)

    def add_request(self, slot: int, replay_start: int) -> None:
        """Holds for all of the request's prefill chunks; decode rows always run with 0."""
        self.slot_replay_start[slot] = replay_start

    def replay_starts(self, batch: InputBatch) -> np.ndarray:
        """int64 [B], host: each batch row's replay start, its request's for a prefill chunk, else 0."""
        return np.where(batch.is_prefilling_np, self.slot_replay_start[batch.idx_mapping_np], 0)

    def build_metadata(
        self,
        states: RequestStates,
        block_tables: BlockTables,
        idx_mapping: torch.Tensor,  # int64 [B]: batch row -> state slot
        query_start_loc: torch.Tensor,  # int32 [B + 1]
        seq_lens: torch.Tensor,  # int32 [B]
        positions: torch.Tensor,  # int64 [T]
        max_query_len: int,
        replay_start: np.ndarray | None = None,  # int [B], host (`replay_starts`); None: no row replays
    ) -> tuple[torch.Tensor, ForwardMetadata]:
        """A step's engram lookback and per-group attention metadata, on the device, with no host sync.

        Returns the persistent `lookback` (int32 [R, D], its first B rows filled from the token history at
        `states.num_computed_tokens`, which the caller has brought up to date) and the metadata: slot
        mappings in the block tables' persistent buffer, the rows' block tables, and the replay starts as
        the sliding-window groups' key floor. `replay_start` None (decode rows, as in a captured graph)
        queues no host copy and pads nothing; otherwise replayed slots in the prefix-cacheable groups are
        padded in place.
        """
        b = idx_mapping.shape[0]
        if self.lookback_depth:
            gather_lookback(self.lookback, idx_mapping, states.num_computed_tokens, states.all_token_ids, b)
        slot_mappings = block_tables.slot_mappings(idx_mapping, query_start_loc, positions)  # int64 [G, T]
        tables = block_tables.batch_tables(idx_mapping)  # int32 [G, B, M]
        rs = None
        if replay_start is not None:
            rs_host = self._replay_start_host
            rs_host[:] = 0
            rs_host[:b] = replay_start
            if rs_host[:b].any():
                rs = self.replay_start[:b]
            self.replay_start.copy_(torch.from_numpy(rs_host), non_blocking=True)
        if rs is not None and self.replay_tokens > 0 and self.cacheable_groups:
            pad_replayed_slots(
                slot_mappings, self.cacheable_groups, query_start_loc, positions, rs, self.replay_tokens
            )
        groups = {}
        for g, spec in enumerate(self.groups):
            groups[spec.name] = GroupMetadata(
                block_table=tables[g],
                slot_mapping=slot_mappings[g],
                sliding_window=spec.sliding_window,
                kv_floor=rs if spec.is_sliding else None,
            )
        return self.lookback, ForwardMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, groups=groups, max_query_len=max_query_len
        )

    def prepare_dummy_inputs(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For graph capture and profiling: lookback all -1, replay starts all 0, same tensors as a step."""
        self.lookback.fill_(-1)
        self.replay_start.zero_()
        return self.lookback, self.replay_start[:num_reqs]
