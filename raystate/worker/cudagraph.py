"""CUDA graphs for decode-only steps, captured once per padded batch size (1, 2, 4, ... max_num_seqs).

A decode step launches dozens of small kernels per layer; replaying a captured graph removes the launch
gaps. Only persistent buffers cross the graph boundary: each step copies its rows into the first B rows
of the input buffers, and the rows from B to the captured size are padding (no query tokens, slot -1 so
no KV is written, lookback -1). The lookback and replay-start buffers are the model state's own
persistent tensors, so captured graphs keep reading the same addresses. Decode rows always run with
replay start 0 and full window reads, so the graph needs no key floor.
"""

from __future__ import annotations

import torch

from raystate.kernels import PAD_SLOT_ID
from raystate.model.attention import ForwardMetadata, GroupMetadata
from raystate.state.input_batch import InputBatch


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, worker) -> None:
        self.worker = worker
        w = worker
        self.sizes = capture_sizes(w.config.scheduler.max_num_seqs)
        max_b = self.sizes[-1]
        dev = w.device
        num_groups = len(w.groups)
        max_blocks = w.block_tables.max_blocks
        self.input_ids = torch.zeros(max_b, dtype=torch.int32, device=dev)  # int32 [Bmax]
        self.positions = torch.zeros(max_b, dtype=torch.int64, device=dev)  # int64 [Bmax]
        self.slot_mappings = torch.full((num_groups, max_b), PAD_SLOT_ID, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((num_groups, max_b, max_blocks), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(max_b + 1, dtype=torch.int32, device=dev)  # int32 [Bmax + 1]
        self.seq_lens = torch.zeros(max_b, dtype=torch.int32, device=dev)  # int32 [Bmax]
        self.logits = torch.zeros((max_b, w.model.config.vocab_size), dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_replays = 0

    def _metadata(self, size: int) -> ForwardMetadata:
        groups = {
            spec.name: GroupMetadata(
                block_table=self.block_tables[g, :size],
                slot_mapping=self.slot_mappings[g, :size],
                sliding_window=spec.sliding_window,
                kv_floor=None,
            )
            for g, spec in enumerate(self.worker.groups)
        }
        return ForwardMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            groups=groups,
            max_query_len=1,
        )

    def _forward(self, size: int) -> None:
        w = self.worker
        lookback = w.model_state.lookback
        hidden = w.model(
            self.input_ids[:size], self.positions[:size], lookback, self._metadata(size), w.kv_caches
        )
        self.logits[:size] = w.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size on dummy inputs: all padding, so nothing is read or written in the cache."""
        w = self.worker
        w.model_state.prepare_dummy_inputs(w.model_state.max_num_reqs)
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.slot_mappings.fill_(PAD_SLOT_ID)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def size_for(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def run(
        self,
        batch: InputBatch,
        tables: torch.Tensor,  # int32 [G, B, M]
        slot_mappings: torch.Tensor,  # int64 [G, B]
    ) -> torch.Tensor:  # fp32 [B, V]
        """Copies this decode step into the persistent buffers and replays the graph of the next size up."""
        b = batch.num_reqs
        size = self.size_for(b)
        self.input_ids[:b] = batch.input_ids
        self.positions[:b] = batch.positions
        self.slot_mappings[:, :b] = slot_mappings
        self.slot_mappings[:, b:size] = PAD_SLOT_ID
        self.block_tables[:, :b] = tables
        self.query_start_loc[: b + 1] = batch.query_start_loc
        self.query_start_loc[b + 1 : size + 1] = b  # padding rows: no query tokens
        self.seq_lens[:b] = batch.seq_lens
        self.seq_lens[b:size] = 0
        self.graphs[size].replay()
        self.num_replays += 1
        return self.logits[:b]
