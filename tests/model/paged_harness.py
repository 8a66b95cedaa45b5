"""A minimal paged runtime for model tests: block allocation, slot mappings, lookback, metadata, steps.

It plays the worker's part with the least machinery, so that `TinyHybrid.forward` can be driven over any
chunking, batch composition and block layout, and checked against the dense oracles. Block ids come from
a shuffled free list (never contiguous, never in order); block 0 is the null block. A request may start
from a prefix hit with SWA bounded replay (DESIGN sections 3 and 4): it shares the cold request's full-group
blocks, gets null window blocks below its replay start, has its replayed slots padded in the full group
and a key floor in the sliding group.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from raystate.kernels import PAD_SLOT_ID, gather_lookback
from raystate.kv_layout import KVCacheGroupSpec, replay_tokens
from raystate.model import ForwardMetadata, GroupMetadata, TinyHybrid


@dataclass
class _Request:
    slot: int
    length: int
    replay_start: int = 0
    blocks: dict[str, list[int]] = field(default_factory=dict)  # group name -> block ids


class PagedHarness:
    def __init__(
        self, model: TinyHybrid, block_size: int, num_blocks: int, max_reqs: int, max_len: int, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.groups: tuple[KVCacheGroupSpec, ...] = model.kv_cache_group_specs(block_size)
        self.replay_tokens = replay_tokens(self.groups)  # P
        self.rng = random.Random(seed)
        dtype = model.lm_head.weight.dtype
        self.device = dev = model.lm_head.weight.device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [None] * model.config.num_layers  # type: ignore
        self.free: dict[str, list[int]] = {}
        for g in self.groups:
            shape = (num_blocks, block_size, g.num_kv_heads, g.head_dim)
            for layer in g.layer_ids:
                # NaN-filled: a read of a slot nobody wrote poisons the logits instead of passing silently.
                self.kv_caches[layer] = (
                    torch.full(shape, float("nan"), dtype=dtype, device=dev),
                    torch.full(shape, float("nan"), dtype=dtype, device=dev),
                )
            pool = list(range(1, num_blocks))
            self.rng.shuffle(pool)
            self.free[g.name] = pool
        self.all_token_ids = torch.full(
            (max_reqs, max_len), -1, dtype=torch.int32, device=dev
        )  # int32 [R, L]
        self.num_computed = torch.zeros(max_reqs, dtype=torch.int32, device=dev)  # int32 [R]
        depth = max(model.token_lookback_depth, 1)
        self.lookback = torch.full((max_reqs, depth), -1, dtype=torch.int32, device=dev)  # int32 [R, D]
        self.requests: dict[int, _Request] = {}

    def add_request(
        self,
        slot: int,
        token_ids: list[int],
        hit_from: int | None = None,
        hit_tokens: int = 0,
    ) -> int:
        """Registers a request in state slot `slot`; returns its first position to compute.

        With `hit_from` (the slot of a cold request sharing the first `hit_tokens` ids, whole blocks), the
        request starts from that prefix hit the way DESIGN section 3 admits it with bounded replay on.
        """
        req = _Request(slot, len(token_ids), blocks={g.name: [] for g in self.groups})
        self.all_token_ids[slot, : len(token_ids)] = torch.tensor(token_ids, dtype=torch.int32)
        start = 0
        if hit_from is not None:
            assert hit_tokens % self.block_size == 0 and hit_tokens > self.replay_tokens > 0
            start = req.replay_start = hit_tokens - self.replay_tokens
            cold = self.requests[hit_from]
            for g in self.groups:
                if g.prefix_cacheable:
                    req.blocks[g.name] = cold.blocks[g.name][: hit_tokens // self.block_size]
                else:
                    req.blocks[g.name] = [0] * (start // self.block_size)  # null blocks wholly below start
        self.num_computed[slot] = start
        self.requests[slot] = req
        return start

    def _ensure_blocks(self, req: _Request, num_tokens: int) -> None:
        needed = -(-num_tokens // self.block_size)
        for g in self.groups:
            table = req.blocks[g.name]
            while len(table) < needed:
                table.append(self.free[g.name].pop())

    def step(
        self, rows: list[tuple[int, int]], lookback_override: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Runs one batch: `rows` is (state slot, number of tokens) per batch row, in batch order.

        Returns each row's logits fp32 [n, vocab]. `lookback_override` replaces the gathered lookback (a
        negative control).
        """
        dev = self.device  # metadata is built on the host, then moved
        slots = [s for s, _ in rows]
        counts = [n for _, n in rows]
        starts = [int(self.num_computed[s]) for s in slots]
        qsl = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([c + n for c, n in zip(starts, counts, strict=True)], dtype=torch.int32)
        positions = torch.cat(
            [torch.arange(c, c + n) for c, n in zip(starts, counts, strict=True)]
        )  # int64 [T]
        token_slots = torch.cat([torch.full((n,), s) for s, n in rows])  # int64 [T]
        reqs = [self.requests[s] for s in slots]
        for req, c, n in zip(reqs, starts, counts, strict=True):
            assert c + n <= req.length
            self._ensure_blocks(req, c + n)
        rs = torch.tensor([r.replay_start for r in reqs], dtype=torch.int32)  # int32 [B]
        any_replay = bool((rs > 0).any())
        row_of_token = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(counts))
        groups = {}
        for g in self.groups:
            width = max(len(r.blocks[g.name]) for r in reqs)
            table = torch.zeros((len(rows), width), dtype=torch.int32)  # int32 [B, max_blocks]
            for b, r in enumerate(reqs):
                table[b, : len(r.blocks[g.name])] = torch.tensor(r.blocks[g.name], dtype=torch.int32)
            blocks = table[row_of_token, positions // self.block_size].long()
            slot_mapping = blocks * self.block_size + positions % self.block_size  # int64 [T]
            if g.prefix_cacheable and any_replay:
                rs_tok = rs.long()[row_of_token]
                replayed = (rs_tok > 0) & (positions >= rs_tok) & (positions < rs_tok + self.replay_tokens)
                slot_mapping = slot_mapping.masked_fill(replayed, PAD_SLOT_ID)
            groups[g.name] = GroupMetadata(
                block_table=table.to(dev),
                slot_mapping=slot_mapping.to(dev),
                sliding_window=g.sliding_window,
                kv_floor=rs.to(dev) if (g.is_sliding and any_replay) else None,
            )
        positions, token_slots = positions.to(dev), token_slots.to(dev)
        input_ids = self.all_token_ids[token_slots, positions]  # int32 [T]
        meta = ForwardMetadata(qsl.to(dev), seq_lens.to(dev), groups, max_query_len=max(counts))
        idx_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
        gather_lookback(self.lookback, idx_mapping, self.num_computed, self.all_token_ids, len(rows))
        lookback = self.lookback if lookback_override is None else lookback_override
        with torch.no_grad():
            hidden = self.model(input_ids, positions, lookback, meta, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        for s, n in rows:
            self.num_computed[s] += n
        return [logits[int(qsl[b]) : int(qsl[b + 1])] for b in range(len(rows))]


def random_chunks(rng: random.Random, total: int, max_chunk: int) -> list[int]:
    """Chunk sizes summing to `total`, with plenty of 1s and boundaries anywhere."""
    out = []
    while total > 0:
        n = 1 if rng.random() < 0.3 else rng.randint(1, max_chunk)
        n = min(n, total)
        out.append(n)
        total -= n
    return out


def run_chunked(
    harness: PagedHarness,
    sequences: dict[int, list[int]],
    rng: random.Random,
    max_chunk: int,
    starts: dict[int, int] | None = None,
) -> dict[int, torch.Tensor]:
    """Drives every request in `sequences` (slot -> ids, already added) to its end in mixed batches.

    Each step takes a random subset of the unfinished requests, in random row order, each with its next
    chunk. Returns each request's logits fp32 [L - start, vocab], in position order.
    """
    starts = starts or {}
    plans = {s: random_chunks(rng, len(ids) - starts.get(s, 0), max_chunk) for s, ids in sequences.items()}
    out: dict[int, list[torch.Tensor]] = {s: [] for s in sequences}
    while any(plans.values()):
        ready = [s for s, p in plans.items() if p]
        batch = rng.sample(ready, rng.randint(1, len(ready)))
        results = harness.step([(s, plans[s].pop(0)) for s in batch])
        for s, logits in zip(batch, results, strict=True):
            out[s].append(logits)
    return {s: torch.cat(chunks) for s, chunks in out.items()}


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: one scale for a whole logits tensor."""
    return float((got - want).abs().max() / want.abs().max())
