"""Per-group block tables on the device, indexed by state slot, and slot mappings from them.

The scheduler sends block ids (full lists for new requests, appended ids for running ones); the host
mirror takes them and only the rows that changed are copied to the device before a step. Entries a
request no longer needs (sliding-window blocks released by the scheduler) may stay stale here: the
attention window and the read floor never reach them and no slot mapping points into them.

The slot mappings are written into one persistent buffer, allocated once for the largest step and sliced
to each step's tokens: no allocation per step, and a captured decode graph reads and writes the same
address every replay.
"""

from __future__ import annotations

import numpy as np
import torch

from raystate.kernels import compute_slot_mappings


class BlockTables:
    def __init__(
        self,
        num_groups: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        max_num_tokens: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_req
        self.max_num_tokens = max_num_tokens
        self.host = np.zeros((num_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int64)
        # One more row than state slots: the scratch slot of graph padding rows (all null blocks).
        self.device_tables = torch.zeros(
            (num_groups, max_num_reqs + 1, max_blocks_per_req), dtype=torch.int32, device=device
        )  # int32 [G, R + 1, M]
        # Every step's slot mappings: its first T columns (T: the step's tokens, graph padding included).
        self._slot_buf = torch.empty(
            (num_groups, max_num_tokens), dtype=torch.int64, device=device
        )  # int64 [G, T_max]
        self._dirty: set[int] = set()

    def set_row(self, slot: int, block_ids: list[list[int]]) -> None:
        for g, ids in enumerate(block_ids):
            self._check_len(len(ids))
            self.host[g, slot, : len(ids)] = ids
            self.host[g, slot, len(ids) :] = 0
            self.num_blocks[g, slot] = len(ids)
        self._dirty.add(slot)

    def append(self, slot: int, new_block_ids: list[list[int]]) -> None:
        for g, ids in enumerate(new_block_ids):
            if not ids:
                continue
            n = int(self.num_blocks[g, slot])
            self._check_len(n + len(ids))
            self.host[g, slot, n : n + len(ids)] = ids
            self.num_blocks[g, slot] = n + len(ids)
            self._dirty.add(slot)

    def _check_len(self, n: int) -> None:
        if n > self.max_blocks:
            raise ValueError(f"block_ids: at most {self.max_blocks} blocks per request, got {n}")

    def commit(self) -> None:
        """Copies the rows that changed since the last step to the device, queued without waiting.

        Why pinned: a copy from pageable memory (`.to(device)`) returns only once everything queued on
        the stream before it has run. Under async scheduling that is the whole step in flight, and rows
        change in most decode steps (each request takes a new block every `block_size` tokens, at its
        own position), so the next step's launch reached the GPU only after the last step had ended: the
        GPU idled between the two for the rest of the launch (BENCHMARKS.md, "Where the rest of the step
        goes"). From pinned memory the copies are queued like the kernels behind them."""
        if not self._dirty:
            return
        rows = sorted(self._dirty)
        self._dirty.clear()
        idx = torch.tensor(rows, dtype=torch.long)  # int64 [n]
        src = torch.from_numpy(self.host[:, rows])  # int32 [G, n, M]
        dev = self.device_tables.device
        if dev.type == "cuda":  # torch keeps a pinned block until the copies out of it have run
            idx, src = idx.pin_memory(), src.pin_memory()
        self.device_tables[:, idx.to(dev, non_blocking=True)] = src.to(dev, non_blocking=True)

    def slot_mappings(
        self,
        idx_mapping: torch.Tensor,  # int64 [B]: batch row -> state slot
        query_start_loc: torch.Tensor,  # int32 [B + 1]
        positions: torch.Tensor,  # int64 [T]
    ) -> torch.Tensor:
        """int64 [G, T], a view of the persistent buffer, valid until the next step writes it:
        slot = block_table[g, slot, pos // block_size] * block_size + pos % block_size, one launch.
        Tokens past query_start_loc[B] (graph padding) get PAD_SLOT_ID."""
        num_tokens = positions.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"num_scheduled: {num_tokens} tokens in one step, more than the {self.max_num_tokens} "
                "the worker is sized for (max_num_batched_tokens)"
            )
        out = self._slot_buf[:, :num_tokens]
        compute_slot_mappings(
            self.device_tables, idx_mapping, query_start_loc, positions, self.block_size, out
        )
        return out

    def batch_tables(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """int32 [G, B, M]: the batch rows' block tables."""
        return self.device_tables[:, idx_mapping]
