"""Paged attention over a mixed batch of prefill chunks and decodes (one launch).

Row b has q_len = query_start_loc[b+1] - query_start_loc[b] query tokens, the last q_len positions of its
seq_lens[b] tokens; its keys live in the blocks block_table[b, :]. A query at position i reads keys in
[max(floor_b, i - W + 1), i] for a sliding window W (W = 0: [floor_b, i]), floor_b = kv_floor[b] (the
replay start; 0 when kv_floor is None). Nothing below the floor is read, so stale or poisoned window KV
there cannot leak in. fp32 accumulation; grouped-query heads (H_q a multiple of H_kv).
"""

from __future__ import annotations

import torch

from raystate.kernels._common import use_triton


def paged_attention_ref(
    query: torch.Tensor,  # [T, H_q, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    sliding_window: int = 0,
    kv_floor: torch.Tensor | None = None,  # int32 [B]
    out: torch.Tensor | None = None,  # [T, H_q, D]
) -> torch.Tensor:
    num_rows = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    block_size = k_cache.shape[1]
    h_q, h_kv = query.shape[1], k_cache.shape[2]
    group = h_q // h_kv
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    floors = kv_floor.tolist() if kv_floor is not None else [0] * num_rows
    for b in range(num_rows):
        q0, q1, seq_len = qsl[b], qsl[b + 1], lens[b]
        q_len = q1 - q0
        if q_len == 0:
            continue
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
        lo = floors[b]
        if sliding_window:
            lo = max(lo, seq_len - q_len - sliding_window + 1)
        lo = max(lo, 0)
        k_pos = torch.arange(lo, seq_len, device=query.device)  # [K]
        blocks = block_table[b, k_pos // block_size].long()
        offs = k_pos % block_size
        keys = k_cache[blocks, offs].float()  # [K, H_kv, D]
        vals = v_cache[blocks, offs].float()
        keys = keys.repeat_interleave(group, dim=1)  # [K, H_q, D]
        vals = vals.repeat_interleave(group, dim=1)
        q = query[q0:q1].float()  # [q_len, H_q, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vals).to(out.dtype)
    return out


def paged_attention(
    query,
    k_cache,
    v_cache,
    block_table,
    query_start_loc,
    seq_lens,
    scale: float,
    sliding_window: int = 0,
    kv_floor=None,
    out=None,
) -> torch.Tensor:
    if use_triton(query):
        return _paged_attention_triton(
            query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window, kv_floor, out
        )
    return paged_attention_ref(
        query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window, kv_floor, out
    )


def _paged_attention_triton(*args):
    raise NotImplementedError("Triton paged_attention: being written")
