"""Paged attention over a mixed batch of prefill chunks and decodes (one launch).

Row b has q_len = query_start_loc[b+1] - query_start_loc[b] query tokens, the last q_len positions of its
seq_lens[b] tokens; its keys live in the blocks block_table[b, :]. A query at position i reads keys in
[max(floor_b, i - W + 1), i] for a sliding window W (W = 0: [floor_b, i]), floor_b = kv_floor[b] (the
replay start; 0 when kv_floor is None). Nothing below the floor is read, so stale or poisoned window KV
there cannot leak in. fp32 accumulation; grouped-query heads (H_q a multiple of H_kv).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from raystate.kernels._common import interpreting, next_pow2, use_triton

_LOG2E = math.log2(math.e)


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


@triton.jit
def _paged_attention_kernel(
    query_ptr,  # [T, H_q, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    out_ptr,  # [T, H_q, D]
    block_table_ptr,  # int32 [B, max_blocks]
    query_start_loc_ptr,  # int32 [B + 1]
    seq_lens_ptr,  # int32 [B]
    kv_floor_ptr,  # int32 [B]; not read when HAS_FLOOR is False
    num_rows,  # B
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    sliding_window,  # W; 0 = full attention
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt_row,
    stride_bt_col,
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,  # D padded to a power of two >= 16 (tl.dot's minimum)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # score rows per program: BLOCK_Q * GROUP, padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    HAS_FLOOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs exact (no tf32) on the GPU
    DOT_IN_FP32: tl.constexpr,  # Triton's CPU interpreter gets bf16 tl.dot wrong: upcast there
):
    """One program: BLOCK_Q query tokens of one batch row times the GROUP query heads of one kv head.

    Axis 0 enumerates query tiles over the whole batch with no host-side per-row table: row b owns the
    programs from query_start_loc[b] // BLOCK_Q + b on, at least cdiv(q_len, BLOCK_Q) of them, and a
    program finds its row by binary search. Surplus programs return at once.
    """
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Last row b whose first tile id query_start_loc[b] // BLOCK_Q + b is <= tile_id.
    lo = tile_id * 0
    hi = lo + num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        at_or_before = mid_first_tile <= tile_id
        lo = tl.where(at_or_before, mid + 1, lo)
        hi = tl.where(at_or_before, hi, mid)
    row = lo - 1

    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    q_first = (tile_id - (q_start // BLOCK_Q + row)) * BLOCK_Q  # first query of this tile, within the row
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    context_len = seq_len - q_len  # position of the row's first query

    # Score row m holds query token q_first + m // GROUP and query head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_first + offs_m // GROUP  # [BLOCK_M]
    q_head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    m_valid = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)  # [BLOCK_M]
    q_pos = context_len + q_local  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM  # [BLOCK_D]

    q_token = (q_start + q_local).to(tl.int64)
    qo_mask = m_valid[:, None] & d_valid[None, :]  # [BLOCK_M, BLOCK_D]
    q_ptrs = query_ptr + q_token[:, None] * stride_qt + q_head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=qo_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    q = q.to(tl.float32) if DOT_IN_FP32 else q.to(k_cache_ptr.dtype.element_ty)

    # Lowest key each query may read: the floor, raised by the window.
    floor = tl.maximum(tl.load(kv_floor_ptr + row), 0) if HAS_FLOOR else row * 0
    m_lo = tl.maximum(q_pos * 0 + floor, tl.where(sliding_window > 0, q_pos - sliding_window + 1, 0))
    # The tile reads keys in [tile_lo, tile_hi): the union of its queries' ranges, never below the floor.
    tile_first_pos = context_len + q_first
    tile_lo = tl.maximum(floor, tl.where(sliding_window > 0, tile_first_pos - sliding_window + 1, 0))
    tile_hi = context_len + tl.minimum(q_first + BLOCK_Q, q_len)

    block_table_row = block_table_ptr + row.to(tl.int64) * stride_bt_row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kv_start in range((tile_lo // BLOCK_N) * BLOCK_N, tile_hi, BLOCK_N):
        k_pos = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_valid = (k_pos >= tile_lo) & (k_pos < tile_hi)
        block_ids = tl.load(block_table_row + (k_pos // BLOCK_SIZE) * stride_bt_col, mask=k_valid, other=0)
        block_ids = block_ids.to(tl.int64)
        in_block = k_pos % BLOCK_SIZE
        kv_mask = k_valid[:, None] & d_valid[None, :]  # [BLOCK_N, BLOCK_D]

        k_off = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        k_t = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kd, mask=tl.trans(kv_mask), other=0.0
        )  # [BLOCK_D, BLOCK_N]
        if DOT_IN_FP32:
            k_t = k_t.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= m_lo[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_shift)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)

        v_off = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh  # [BLOCK_N]
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if DOT_IN_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_token[:, None] * stride_ot + q_head[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty), mask=qo_mask)


# Score rows per program for prefill tiles (query tokens x heads of one kv group).
_PREFILL_BLOCK_M = 64


def _launch_config(block_m: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a tile of block_m score rows.

    From `bench/bench_attention.py --sweep` on an H200 (D = 128, bf16): 64 keys, 4 warps, 2 stages is the
    best decode choice and within 4% of the best prefill one (128 rows, 8 warps).
    """
    return 64, (4 if block_m <= 64 else 8), 2


def _tile_shape(group: int, max_query_len: int | None) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per program and its padded score-row count.

    Known short queries (decode) get one token per program with its GROUP heads packed into the rows, so
    a decode step reads each KV tile once for the whole group. Sizes are powers of two (given a
    power-of-two GROUP) so the number of compiled variants stays small.
    """
    block_m = max(_PREFILL_BLOCK_M, next_pow2(group))
    if max_query_len is not None:
        block_m = min(block_m, max(16, next_pow2(max(1, max_query_len) * group)))
    return max(1, block_m // group), block_m


def _paged_attention_triton(
    query: torch.Tensor,  # [T, H_q, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    block_table: torch.Tensor,  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    seq_lens: torch.Tensor,  # int32 [B]
    scale: float,
    sliding_window: int,
    kv_floor: torch.Tensor | None,  # int32 [B]
    out: torch.Tensor | None,  # [T, H_q, D]
    max_query_len: int | None,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if out is None:
        out = torch.empty_like(query)
    num_rows = seq_lens.shape[0]
    if num_tokens == 0 or num_rows == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_q, block_m = _tile_shape(group, max_query_len)
    block_n, num_warps, num_stages = _launch_config(block_m, head_dim)
    # Row b's tiles start at query_start_loc[b] // block_q + b, so this many ids cover every row.
    grid = (num_tokens // block_q + num_rows, num_kv_heads)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_table,
        query_start_loc,
        seq_lens,
        kv_floor if kv_floor is not None else seq_lens,
        num_rows,
        scale * _LOG2E,
        sliding_window,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_table.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_FLOOR=kv_floor is not None,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=interpreting() and k_cache.dtype == torch.bfloat16,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_attention(
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
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """One launch for the whole batch; returns `out` (allocated like `query` when None).

    The Triton path never reads the device tensors on the host, so it is safe inside CUDA graph capture.
    `max_query_len` (a host int, the longest row's q_len) only picks the tile shape, so any value gives
    the same result: a caller that knows the step is pure decode passes 1 and gets one query token per
    program instead of a prefill-sized tile.
    """
    if use_triton(query):
        return _paged_attention_triton(
            query,
            k_cache,
            v_cache,
            block_table,
            query_start_loc,
            seq_lens,
            scale,
            sliding_window,
            kv_floor,
            out,
            max_query_len,
        )
    return paged_attention_ref(
        query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window, kv_floor, out
    )
