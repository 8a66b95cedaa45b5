"""Paged attention over a mixed batch of prefill chunks and decodes (one launch).

Row b has q_len = query_start_loc[b+1] - query_start_loc[b] query tokens, the last q_len positions of its
seq_lens[b] tokens; its keys live in the blocks block_table[b, :]. A query at position i reads keys in
[max(floor_b, i - W + 1), i] for a sliding window W (W = 0: [floor_b, i]), floor_b = kv_floor[b] (the
replay start; 0 when kv_floor is None). Nothing below the floor is read, so stale or poisoned window KV
there cannot leak in. fp32 accumulation; grouped-query heads (H_q a multiple of H_kv).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

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
def _load(ptrs, mask, USE_MASK: tl.constexpr):
    """tl.load, with `mask` (other = 0) only when USE_MASK: a tile known to be in range loads unmasked."""
    return tl.load(ptrs, mask=mask, other=0.0) if USE_MASK else tl.load(ptrs)


@triton.jit
def _attend_kv_block(
    acc,  # fp32 [BLOCK_M, BLOCK_D]: unnormalised output so far
    m_i,  # fp32 [BLOCK_M]: running max of the base-2 scores
    l_i,  # fp32 [BLOCK_M]: running sum of exp2(score - m_i)
    q,  # [BLOCK_M, BLOCK_D]
    kv_start,  # first key position of this block (a multiple of BLOCK_N)
    q_pos,  # int32 [BLOCK_M]: each score row's query position
    m_lo,  # int32 [BLOCK_M]: each score row's lowest readable key
    tile_lo,  # lowest key any row of the tile reads
    tile_hi,  # one past the highest key any row of the tile reads
    block_table_row,  # this row's block table
    stride_bt_col,
    k_head_ptr,  # the K cache, offset to this program's kv head
    v_head_ptr,  # the V cache, offset to this program's kv head
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    offs_d,  # [BLOCK_D]
    d_valid,  # [BLOCK_D]
    scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the block is visible to every row (see SPLIT_MASK)
    K_ROWS: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One online-softmax step over keys [kv_start, kv_start + BLOCK_N); returns (acc, m_i, l_i).

    An unmasked block (MASKED False) skips the key bounds on the loads and the per-score visibility test
    and its -inf guard: in a compute-bound prefill those elementwise ops cost about as much as the two
    dots, so the bulk of the keys should not pay for them.
    """
    k_pos = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if MASKED:
        k_valid = (k_pos >= tile_lo) & (k_pos < tile_hi)  # [BLOCK_N]
        block_ids = tl.load(block_table_row + (k_pos // BLOCK_SIZE) * stride_bt_col, mask=k_valid, other=0)
        kv_mask = k_valid[:, None] & d_valid[None, :]  # [BLOCK_N, BLOCK_D]
    else:
        block_ids = tl.load(block_table_row + (k_pos // BLOCK_SIZE) * stride_bt_col)
        # Only the head-dim padding can be out of range; broadcast so the mask has the tile's shape.
        kv_mask = tl.broadcast_to(d_valid[None, :], (BLOCK_N, BLOCK_D))  # [BLOCK_N, BLOCK_D]
    use_mask: tl.constexpr = MASKED or (HEAD_DIM != BLOCK_D)
    block_ids = block_ids.to(tl.int64)
    in_block = k_pos % BLOCK_SIZE

    k_off = block_ids * stride_kb + in_block * stride_ks  # [BLOCK_N]
    if K_ROWS:
        # Each key's D values are contiguous in the cache: load whole rows; the dot takes the transpose.
        k = _load(k_head_ptr + k_off[:, None] + offs_d[None, :] * stride_kd, kv_mask, use_mask)  # [N, D]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        k_t = tl.trans(k)  # [BLOCK_D, BLOCK_N]
    else:
        k_t = _load(
            k_head_ptr + k_off[None, :] + offs_d[:, None] * stride_kd, tl.trans(kv_mask), use_mask
        )  # [BLOCK_D, BLOCK_N]
        if DOT_IN_FP32:
            k_t = k_t.to(tl.float32)
    scores = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if not FOLD_SCALE:
        scores = scores * scale_log2
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= m_lo[:, None])
        scores = tl.where(visible, scores, float("-inf"))

    # m_i stays in base-2 units; with FOLD_SCALE the scale rides on the max and on one fma per score.
    block_max = tl.max(scores, 1) * scale_log2 if FOLD_SCALE else tl.max(scores, 1)  # [BLOCK_M]
    m_new = tl.maximum(m_i, block_max)
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN. In
    # an unmasked block every row saw BLOCK_N finite scores, so m_new is finite already.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    base2 = scores * scale_log2 if FOLD_SCALE else scores  # [BLOCK_M, BLOCK_N]; one fma with the shift
    p = tl.exp2(base2 - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_shift)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, 1)

    v_off = block_ids * stride_vb + in_block * stride_vs  # [BLOCK_N]
    v = _load(v_head_ptr + v_off[:, None] + offs_d[None, :] * stride_vd, kv_mask, use_mask)  # [N, D]
    if DOT_IN_FP32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_span(
    acc,
    m_i,
    l_i,
    q,
    span_lo,  # first key block start (a multiple of BLOCK_N)
    span_hi,  # keys up to here
    MASKED: tl.constexpr,
    STAGES: tl.constexpr,  # 0: a plain loop; else tl.range(num_stages=STAGES)
    q_pos,
    m_lo,
    tile_lo,
    tile_hi,
    block_table_row,
    stride_bt_col,
    k_head_ptr,
    v_head_ptr,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    offs_d,
    d_valid,
    scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ROWS: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """_attend_kv_block over the key blocks of [span_lo, span_hi); returns (acc, m_i, l_i).

    A plain loop is pipelined by the launch's num_stages, which Triton applies to the loads feeding a
    dot (K and V) only; tl.range(num_stages=...) also pipelines the block-table loads whose ids those
    K and V addresses need, and num_stages=1 turns pipelining off for a loop of a block or two.
    """
    if STAGES > 0:
        for kv_start in tl.range(span_lo, span_hi, BLOCK_N, num_stages=STAGES):
            acc, m_i, l_i = _attend_kv_block(
                acc, m_i, l_i, q, kv_start, q_pos, m_lo, tile_lo, tile_hi, block_table_row, stride_bt_col,
                k_head_ptr, v_head_ptr, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                offs_d, d_valid, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, MASKED, K_ROWS,
                FOLD_SCALE, DOT_PRECISION, DOT_IN_FP32,
            )  # fmt: skip
    else:
        for kv_start in range(span_lo, span_hi, BLOCK_N):
            acc, m_i, l_i = _attend_kv_block(
                acc, m_i, l_i, q, kv_start, q_pos, m_lo, tile_lo, tile_hi, block_table_row, stride_bt_col,
                k_head_ptr, v_head_ptr, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
                offs_d, d_valid, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, MASKED, K_ROWS,
                FOLD_SCALE, DOT_PRECISION, DOT_IN_FP32,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_query_tile(
    query_ptr,
    out_ptr,
    q_start,  # the row's first query token in the batch
    q_len,  # the row's query tokens
    q_first,  # first query of this tile, within the row
    seq_len,
    kv_head,
    floor,  # the row's lowest readable key (its replay start, or 0)
    sliding_window,
    scale_log2,
    block_table_row,
    k_head_ptr,
    v_head_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt_col,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_ROWS: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    EDGE_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Queries [q_first, q_first + BLOCK_Q) of one row times the GROUP query heads of one kv head: loads
    them, runs the online softmax over every key they may read and stores their outputs."""
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
    q = q.to(tl.float32) if DOT_IN_FP32 else q.to(k_head_ptr.dtype.element_ty)

    # Lowest key each query may read: the floor, raised by the window.
    m_lo = tl.maximum(q_pos * 0 + floor, tl.where(sliding_window > 0, q_pos - sliding_window + 1, 0))
    # The tile reads keys in [tile_lo, tile_hi): the union of its queries' ranges, never below the floor.
    tile_first_pos = context_len + q_first
    tile_lo = tl.maximum(floor, tl.where(sliding_window > 0, tile_first_pos - sliding_window + 1, 0))
    tile_hi = context_len + tl.minimum(q_first + BLOCK_Q, q_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if SPLIT_MASK:
        # Keys in [full_lo, tile_first_pos] are visible to every query of the tile: at or below the
        # first query, and at or above the highest query's window start and the floor. The whole
        # BLOCK_N blocks inside that range ([mid_lo, mid_hi)) run unmasked; the blocks before them
        # (window edge) and after them (the causal diagonal) keep the mask. The three spans tile
        # [kv_first, tile_hi) exactly, in ascending order like the single loop.
        kv_first = (tile_lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(floor, tl.where(sliding_window > 0, tile_hi - sliding_window, 0))
        mid_hi = ((tile_first_pos + 1) // BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, mid_hi)
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, kv_first, mid_lo, True, EDGE_STAGES,
            q_pos, m_lo, tile_lo, tile_hi, block_table_row, stride_bt_col, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, offs_d, d_valid, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, K_ROWS, FOLD_SCALE, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, mid_lo, mid_hi, False, LOOP_STAGES,
            q_pos, m_lo, tile_lo, tile_hi, block_table_row, stride_bt_col, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, offs_d, d_valid, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, K_ROWS, FOLD_SCALE, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, mid_hi, tile_hi, True, EDGE_STAGES,
            q_pos, m_lo, tile_lo, tile_hi, block_table_row, stride_bt_col, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, offs_d, d_valid, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, K_ROWS, FOLD_SCALE, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip
    else:
        # One masked loop from the tile's lowest key exactly (not rounded down to BLOCK_N): a decode
        # query's window of W keys then takes cdiv(W, BLOCK_N) steps, not one more.
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, tile_lo, tile_hi, True, LOOP_STAGES,
            q_pos, m_lo, tile_lo, tile_hi, block_table_row, stride_bt_col, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, offs_d, d_valid, scale_log2,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, K_ROWS, FOLD_SCALE, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_token[:, None] * stride_ot + q_head[:, None] * stride_oh
    tl.store(o_ptrs + offs_d[None, :] * stride_od, acc.to(out_ptr.dtype.element_ty), mask=qo_mask)


# Triton would compile separate copies for batch sizes / windows of 1, multiples of 16 and the rest; these
# two only bound a binary search and a few compares, so one copy serves all values.
@triton.jit(do_not_specialize=["num_rows", "sliding_window"])
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
    num_kv_heads,  # H_kv; read only when HEAVY_FIRST
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
    BLOCK_Q: tl.constexpr,  # query tokens per program (per tile with ROW_PROGRAMS)
    BLOCK_M: tl.constexpr,  # score rows per tile: BLOCK_Q * GROUP, padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
    HAS_FLOOR: tl.constexpr,
    K_ROWS: tl.constexpr,  # load K as [BLOCK_N, BLOCK_D] rows and transpose for the dot
    SPLIT_MASK: tl.constexpr,  # key blocks every row of the tile fully sees skip the mask
    FOLD_SCALE: tl.constexpr,  # apply the softmax scale inside exp2's argument (one fma per score)
    HEAVY_FIRST: tl.constexpr,  # 1-D grid, kv heads fastest, last query tiles (the longest) first
    ROW_PROGRAMS: tl.constexpr,  # one program per (row, kv head), looping over the row's query tiles
    LOOP_STAGES: tl.constexpr,  # key loop: 0 = plain loop (launch num_stages), else tl.range(num_stages=)
    EDGE_STAGES: tl.constexpr,  # the same for SPLIT_MASK's masked loops (a block or two each)
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs exact (no tf32) on the GPU
    DOT_IN_FP32: tl.constexpr,  # Triton's CPU interpreter gets bf16 tl.dot wrong: upcast there
):
    """One program: BLOCK_Q query tokens of one batch row times the GROUP query heads of one kv head, or
    with ROW_PROGRAMS every query tile of one row (the decode layout: grid (B, H_kv)).

    Without ROW_PROGRAMS the query tiles over the whole batch are numbered with no host-side per-row
    table: row b owns the tile ids from query_start_loc[b] // BLOCK_Q + b on, at least
    cdiv(q_len, BLOCK_Q) of them, and a program finds its row by binary search. Surplus tile ids return at
    once. The grid is (tiles, H_kv), or with HEAVY_FIRST one axis of tiles * H_kv walking the tile ids
    backwards, so under causal masking the programs with the most keys start first and the cheap ones fill
    the tail of the launch. A decode step has one query per row, and there the search (log2 B dependent
    loads) and the surplus programs cost more than the attention over a short window: ROW_PROGRAMS maps
    program to row directly, and loops over the row's tiles so a longer row is still computed right.
    """
    if ROW_PROGRAMS:
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
    else:
        if HEAVY_FIRST:
            pid = tl.program_id(0)
            kv_head = pid % num_kv_heads
            tile_id = tl.num_programs(0) // num_kv_heads - 1 - pid // num_kv_heads
        else:
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
    seq_len = tl.load(seq_lens_ptr + row)
    floor = tl.maximum(tl.load(kv_floor_ptr + row), 0) if HAS_FLOOR else row * 0
    block_table_row = block_table_ptr + row.to(tl.int64) * stride_bt_row
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    if ROW_PROGRAMS:  # every query tile of the row: once for a decode row
        tiles_lo = q_len * 0
        tiles_hi = q_len
    else:  # this program's one tile, or none past the row's last query (a surplus tile id)
        tiles_lo = (tile_id - (q_start // BLOCK_Q + row)) * BLOCK_Q
        tiles_hi = tl.minimum(tiles_lo + 1, q_len)
    for q_first in range(tiles_lo, tiles_hi, BLOCK_Q):
        _attend_query_tile(
            query_ptr, out_ptr, q_start, q_len, q_first, seq_len, kv_head, floor, sliding_window,
            scale_log2, block_table_row, k_head_ptr, v_head_ptr, stride_qt, stride_qh, stride_qd,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, stride_ot, stride_oh,
            stride_od, stride_bt_col, HEAD_DIM, BLOCK_D, BLOCK_SIZE, GROUP, BLOCK_Q, BLOCK_M, BLOCK_N,
            K_ROWS, SPLIT_MASK, FOLD_SCALE, LOOP_STAGES, EDGE_STAGES, DOT_PRECISION, DOT_IN_FP32,
        )  # fmt: skip


@dataclass(frozen=True)
class AttentionLaunch:
    """How one launch tiles and compiles the kernel: the knobs `bench_attention.py --sweep` times.

    The flags change speed only, never the result beyond float rounding: the tests run every one.
    """

    block_m: int = 64  # most score rows per program; a short-query (decode) tile shrinks below this
    block_n: int = 64  # keys per inner-loop step
    num_warps: int | None = None  # None: 4 for up to 64 score rows, else 8
    num_stages: int = 2  # software-pipelining depth of the key loop
    k_rows: bool = False  # K loaded as contiguous [BLOCK_N, D] rows and transposed for the dot
    split_mask: bool = False  # fully visible key blocks run without the causal/window/floor mask
    fold_scale: bool = False  # softmax scale folded into exp2's argument
    heavy_first: bool = False  # longest (causal) tiles launched first, kv heads of a tile adjacent
    loop_stages: int | None = None  # key loop as tl.range(num_stages=): also pipelines block-table loads
    edge_stages: int | None = None  # the same for split_mask's masked loops (None: as the key loop)
    # One program per (row, kv head) over the row's query tiles, no search for the row: the decode layout.
    # The default launches use it only where one tile holds every row's queries (max_query_len known).
    row_programs: bool = False

    def tag(self) -> str:
        """A short name for tables: tile, warps, stages, then the flags that are on."""
        warps = "auto" if self.num_warps is None else self.num_warps
        parts = [f"M{self.block_m} N{self.block_n} w{warps} s{self.num_stages}"]
        flags = ("k_rows", "split_mask", "fold_scale", "heavy_first", "row_programs")
        parts += [name for name in flags if getattr(self, name)]
        if self.loop_stages is not None:
            parts.append(f"loop_s{self.loop_stages}")
        if self.edge_stages is not None:
            parts.append(f"edge_s{self.edge_stages}")
        return " ".join(parts)


# The launcher's defaults: the first for tiles of block_m rows (prefill), the second for tiles that
# `max_query_len` shrinks below that (decode, short chunks). From `bench/bench_attention.py --sweep` on an
# H200 (bf16, 32 q / 8 kv heads of 128, causal; bench/results/attention_sweep.log): 128 score rows x 128
# keys, 8 warps, 3 stages, K as rows, unmasked interior blocks, folded scale, heaviest tiles first runs
# at 1.18 / 1.10 / 1.07 / 1.04x flash SDPA (4k / 8k / 16k / 4 x 4k), the old 64 x 64 tile at 0.80 /
# 0.77 / 0.76 / 0.77x. (Triton plans to stop fusing the folded scale's multiply-add by default; that
# would cost speed, never correctness.) Decode: one program per (row, kv head). With at most two waves of
# such programs, 128-key steps: on the bench model's heads (16 q / 4 kv of 128) at batch 64, 2k context
# (256 programs) 75.7 us against 97.2 us for 64-key steps and 99.7 us for the earlier tile-search layout;
# with more programs (32 q / 8 kv heads at B = 64 and beyond: 512+) 128-key steps ran 4-5% slower than
# 64-key ones, and over a window of up to 128 keys 64-key steps are as fast (11.3 us at B = 64) and faster
# at B = 256 (27.7 against 33.2 us): `bench_attention.py`, H200 (bench/results/attention.log). The prefill
# flags only add registers there.
PREFILL_LAUNCH = AttentionLaunch(
    block_m=128,
    block_n=128,
    num_warps=8,
    num_stages=3,
    k_rows=True,
    split_mask=True,
    fold_scale=True,
    heavy_first=True,
)
DECODE_LAUNCH = AttentionLaunch(block_n=128, row_programs=True)
# Decode with more than DECODE_MAX_WAVES waves of programs, or over a window of at most
# SHORT_WINDOW keys (two 64-key steps from the window's first key).
DECODE_SHORT_STEP_LAUNCH = AttentionLaunch(block_n=64, row_programs=True)
DECODE_MAX_WAVES = 2
SHORT_WINDOW = 128


def _tile_shape(group: int, max_query_len: int | None, max_block_m: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per program and its padded score-row count.

    Known short queries (decode) get one token per program with its GROUP heads packed into the rows, so
    a decode step reads each KV tile once for the whole group. Sizes are powers of two (given a
    power-of-two GROUP) so the number of compiled variants stays small.
    """
    block_m = max(max_block_m, next_pow2(group))
    if max_query_len is not None:
        block_m = min(block_m, max(16, next_pow2(max(1, max_query_len) * group)))
    return max(1, block_m // group), block_m


def _launch_config(
    group: int,
    max_query_len: int | None,
    launch: AttentionLaunch | None,
    sliding_window: int = 0,
    key_row_bytes: int = 0,
    smem_limit: int | None = None,
    decode_waves: float = 0.0,
) -> tuple[int, AttentionLaunch]:
    """(BLOCK_Q, the launch with block_m and num_warps resolved) for this call.

    Without an explicit `launch`, a full-size tile takes PREFILL_LAUNCH and a shrunken one DECODE_LAUNCH
    (DECODE_SHORT_STEP_LAUNCH for a short window or more than DECODE_MAX_WAVES `decode_waves`: rows x kv
    heads over the GPU's multiprocessors), in the row-program layout only when one tile holds the
    longest row's queries, and made to fit `smem_limit` bytes of shared memory for keys of
    `key_row_bytes` (the defaults are sized for bf16: fp32 caches of D = 128 would not compile); an
    explicit one applies as given (its block_m still caps the tile, which short queries shrink).
    """
    short = 0 < sliding_window <= SHORT_WINDOW or decode_waves > DECODE_MAX_WAVES
    decode = DECODE_SHORT_STEP_LAUNCH if short else DECODE_LAUNCH
    return _resolve_launch(group, max_query_len, launch, PREFILL_LAUNCH, decode, key_row_bytes, smem_limit)


def _key_loop_smem(launch: AttentionLaunch, key_row_bytes: int) -> int:
    """A bound on the shared memory the pipelined key loop takes: max(num_stages, 2) buffered K and V
    tiles. (Triton 3.6 asked 262656 bytes for 128-key fp32 tiles of D = 128 at 3 stages and 262144 at 2,
    of the H200's 232448; the bf16 defaults stay within it as tuned.)"""
    return max(launch.num_stages, 2) * 2 * launch.block_n * key_row_bytes


@functools.lru_cache(maxsize=512)
def _resolve_launch(
    group: int,
    max_query_len: int | None,
    launch: AttentionLaunch | None,
    prefill: AttentionLaunch,
    decode: AttentionLaunch,
    key_row_bytes: int = 0,
    smem_limit: int | None = None,
) -> tuple[int, AttentionLaunch]:
    """_launch_config's work, cached: it runs on every launch and builds a dataclass."""
    if launch is None:
        launch = prefill
        block_q, block_m = _tile_shape(group, max_query_len, launch.block_m)
        if block_m < launch.block_m:
            launch = decode
            block_q, block_m = _tile_shape(group, max_query_len, launch.block_m)
            if launch.row_programs and not (max_query_len is not None and max_query_len <= block_q):
                launch = replace(launch, row_programs=False)  # rows of several tiles: spread them out
        # Fewer stages first (down to 2), then fewer keys per step, until the key loop fits.
        while smem_limit is not None and _key_loop_smem(launch, key_row_bytes) > smem_limit:
            if launch.num_stages > 2:
                launch = replace(launch, num_stages=launch.num_stages - 1)
            elif launch.block_n > 16:
                launch = replace(launch, block_n=launch.block_n // 2)
            else:
                break
    else:
        block_q, block_m = _tile_shape(group, max_query_len, launch.block_m)
    num_warps = launch.num_warps if launch.num_warps is not None else (4 if block_m <= 64 else 8)
    return block_q, replace(launch, block_m=block_m, num_warps=num_warps)


@functools.lru_cache(maxsize=16)
def _device_limits(device_index: int) -> tuple[int, int]:
    """(bytes of shared memory a program may take, less 8 KiB for the kernel's own scratch; the number of
    multiprocessors) of this GPU."""
    props = torch.cuda.get_device_properties(device_index)
    limit = getattr(props, "shared_memory_per_block_optin", 0)
    if not limit:  # an older torch: ask Triton's driver
        import triton.runtime

        limit = triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
    return int(limit) - 8192, max(1, props.multi_processor_count)


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
    launch: AttentionLaunch | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """The Triton path of paged_attention; `compile_only` compiles the kernel for these arguments and
    launches nothing (a benchmark compiles its variants up front, in parallel)."""
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
    block_d = max(16, next_pow2(head_dim))
    if interpreting():
        smem, waves = None, 0.0
    else:
        smem, sms = _device_limits(k_cache.device.index or 0)
        waves = num_rows * num_kv_heads / sms
    block_q, launch = _launch_config(
        group, max_query_len, launch, sliding_window, block_d * k_cache.element_size(), smem, waves
    )
    if launch.row_programs:
        grid = (num_rows, num_kv_heads)
    else:
        # Row b's tiles start at query_start_loc[b] // block_q + b, so this many ids cover every row.
        num_tiles = num_tokens // block_q + num_rows
        grid = (num_tiles * num_kv_heads,) if launch.heavy_first else (num_tiles, num_kv_heads)
    kernel = _paged_attention_kernel
    run = functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]
    run(
        query,
        k_cache,
        v_cache,
        out,
        block_table,
        query_start_loc,
        seq_lens,
        kv_floor if kv_floor is not None else seq_lens,
        num_rows,
        num_kv_heads,
        scale * _LOG2E,
        sliding_window,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_table.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        HAS_FLOOR=kv_floor is not None,
        K_ROWS=launch.k_rows,
        SPLIT_MASK=launch.split_mask,
        FOLD_SCALE=launch.fold_scale,
        HEAVY_FIRST=launch.heavy_first and not launch.row_programs,
        ROW_PROGRAMS=launch.row_programs,
        LOOP_STAGES=launch.loop_stages or 0,
        EDGE_STAGES=launch.edge_stages if launch.edge_stages is not None else launch.loop_stages or 0,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=interpreting() and k_cache.dtype == torch.bfloat16,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
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
    launch: AttentionLaunch | None = None,
) -> torch.Tensor:
    """One launch for the whole batch; returns `out` (allocated like `query` when None).

    The Triton path never reads the device tensors on the host, so it is safe inside CUDA graph capture.
    `max_query_len` (a host int, the longest row's q_len) only picks the tile shape, so any value gives
    the same result: a caller that knows the step is pure decode passes 1 and gets one query token per
    program instead of a prefill-sized tile. `launch` overrides the tiling and kernel variant chosen
    from PREFILL_LAUNCH / DECODE_LAUNCH (benchmarks and tests); the reference path ignores it.
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
            launch,
        )
    return paged_attention_ref(
        query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window, kv_floor, out
    )
