"""Paged attention over a mixed batch of prefill chunks and decodes (one launch).

Row b has q_len = query_start_loc[b+1] - query_start_loc[b] query tokens, the last q_len positions of its
seq_lens[b] tokens; its keys live in the blocks block_table[b, :]. A query at position i reads keys in
[max(floor_b, i - W + 1), i] for a sliding window W (W = 0: [floor_b, i]), floor_b = kv_floor[b] (the
replay start; 0 when kv_floor is None). Nothing below the floor is read, so stale or poisoned window KV
there cannot leak in. fp32 accumulation; grouped-query heads (H_q a multiple of H_kv).

Shapes, for the three entry points alike: query and out [T, H_q, D]; k_cache and v_cache
[num_blocks, block_size, H_kv, D]; int32 block_table [B, max_blocks], query_start_loc [B + 1], seq_lens
[B] and kv_floor [B] (or None). The launch policy (layout, tile, warps, stages) is in attention_launch.py.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from raystate.kernels._common import interpreting, next_pow2, use_triton
from raystate.kernels.attention_launch import AttentionLaunch, LaunchPlan, plan_launch

_LOG2E = math.log2(math.e)


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    kv_floor: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_attention in plain PyTorch, one row at a time (it reads the row tables on the host)."""
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


# What the helpers share, as tuples (one argument each, unpacked where used):
#   bounds = (q_pos, m_lo, tile_lo, tile_hi): each score row's query position and lowest readable key
#            ([BLOCK_M] each), and the keys [tile_lo, tile_hi) any row of the tile reads;
#   kv     = (block_table_row, stride_bt_col, k_head_ptr, v_head_ptr, k_strides, v_strides): the row's
#            block table and the caches offset to the program's kv head, strides (block, slot, head, dim);
#   cols   = (offs_d, d_valid): the head-dim lanes [BLOCK_D] and which are real;
#   SHAPE  = (HEAD_DIM, BLOCK_D, BLOCK_SIZE, GROUP, HAS_FLOOR, DOT_PRECISION, DOT_IN_FP32): fixed by the
#            tensors;
#   TILE   = (BLOCK_Q, BLOCK_M, BLOCK_N, ROW_PROGRAMS): attention_launch's choice.
@triton.jit
def _attend_kv_block(
    acc,  # fp32 [BLOCK_M, BLOCK_D]: unnormalised output so far
    m_i,  # fp32 [BLOCK_M]: running max of the base-2 scores
    l_i,  # fp32 [BLOCK_M]: running sum of exp2(score - m_i)
    q,  # [BLOCK_M, BLOCK_D]
    kv_start,  # first key position of this block (a multiple of BLOCK_N)
    bounds,
    kv,
    cols,
    scale_log2,
    MASKED: tl.constexpr,  # False: every key of the block is visible to every row of the tile
    SHAPE: tl.constexpr,
    TILE: tl.constexpr,
):
    """One online-softmax step over keys [kv_start, kv_start + BLOCK_N); returns (acc, m_i, l_i).

    An unmasked block (MASKED False) skips the key bounds on the loads and the per-score visibility test
    and its -inf guard: in a compute-bound prefill those elementwise ops cost about as much as the two
    dots, so the bulk of the keys should not pay for them. The tile layout (prefill) loads K as
    contiguous [BLOCK_N, D] rows and transposes them for the dot, and folds the softmax scale into
    exp2's argument (one fma per score); the row layout (decode) loads K as [D, BLOCK_N] columns and
    scales the scores. (Triton plans to stop fusing the folded scale's multiply-add by default: that would
    cost speed, never correctness.)
    """
    HEAD_DIM: tl.constexpr = SHAPE[0]
    BLOCK_D: tl.constexpr = SHAPE[1]
    BLOCK_SIZE: tl.constexpr = SHAPE[2]
    DOT_PRECISION: tl.constexpr = SHAPE[5]  # "ieee" keeps fp32 inputs exact (no tf32) on the GPU
    DOT_IN_FP32: tl.constexpr = SHAPE[6]  # Triton's CPU interpreter gets bf16 tl.dot wrong: upcast there
    BLOCK_N: tl.constexpr = TILE[2]
    K_ROWS_FOLDED: tl.constexpr = not TILE[3]  # the tile layout's K rows and folded scale
    q_pos, m_lo, tile_lo, tile_hi = bounds
    block_table_row, stride_bt_col, k_head_ptr, v_head_ptr, k_strides, v_strides = kv
    offs_d, d_valid = cols

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

    k_off = block_ids * k_strides[0] + in_block * k_strides[1]  # [BLOCK_N]
    if K_ROWS_FOLDED:
        k = _load(k_head_ptr + k_off[:, None] + offs_d[None, :] * k_strides[3], kv_mask, use_mask)  # [N, D]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        k_t = tl.trans(k)  # [BLOCK_D, BLOCK_N]
    else:
        k_t = _load(
            k_head_ptr + k_off[None, :] + offs_d[:, None] * k_strides[3], tl.trans(kv_mask), use_mask
        )  # [BLOCK_D, BLOCK_N]
        if DOT_IN_FP32:
            k_t = k_t.to(tl.float32)
    scores = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if not K_ROWS_FOLDED:
        scores = scores * scale_log2
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= m_lo[:, None])
        scores = tl.where(visible, scores, float("-inf"))

    # m_i stays in base-2 units; a folded scale rides on the max and on one fma per score.
    block_max = tl.max(scores, 1) * scale_log2 if K_ROWS_FOLDED else tl.max(scores, 1)  # [BLOCK_M]
    m_new = tl.maximum(m_i, block_max)
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN. In
    # an unmasked block every row saw BLOCK_N finite scores, so m_new is finite already.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    base2 = scores * scale_log2 if K_ROWS_FOLDED else scores  # [BLOCK_M, BLOCK_N]; one fma with the shift
    p = tl.exp2(base2 - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.exp2(m_i - m_shift)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, 1)

    v_off = block_ids * v_strides[0] + in_block * v_strides[1]  # [BLOCK_N]
    v = _load(v_head_ptr + v_off[:, None] + offs_d[None, :] * v_strides[3], kv_mask, use_mask)  # [N, D]
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
    bounds,
    kv,
    cols,
    scale_log2,
    MASKED: tl.constexpr,
    SHAPE: tl.constexpr,
    TILE: tl.constexpr,
):
    """_attend_kv_block over the key blocks of [span_lo, span_hi); returns (acc, m_i, l_i). A plain loop,
    pipelined by the launch's num_stages (Triton applies it to the K and V loads feeding the dots)."""
    for kv_start in range(span_lo, span_hi, TILE[2]):
        acc, m_i, l_i = _attend_kv_block(
            acc, m_i, l_i, q, kv_start, bounds, kv, cols, scale_log2, MASKED, SHAPE, TILE
        )
    return acc, m_i, l_i


@triton.jit
def _attend_query_tile(
    io,  # (query_ptr, out_ptr, q_strides, o_strides), strides (token, head, dim)
    row,  # (q_start, q_len, seq_len, floor): the row's first query token in the batch, its query count,
    # its length and its lowest readable key (its replay start, or 0)
    q_first,  # first query of this tile, within the row
    kv_head,
    kv,
    sliding_window,
    scale_log2,
    SHAPE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Queries [q_first, q_first + BLOCK_Q) of one row times the GROUP query heads of one kv head: loads
    them, runs the online softmax over every key they may read and stores their outputs."""
    HEAD_DIM: tl.constexpr = SHAPE[0]
    BLOCK_D: tl.constexpr = SHAPE[1]
    GROUP: tl.constexpr = SHAPE[3]
    DOT_IN_FP32: tl.constexpr = SHAPE[6]
    BLOCK_Q: tl.constexpr = TILE[0]
    BLOCK_M: tl.constexpr = TILE[1]
    BLOCK_N: tl.constexpr = TILE[2]
    ROW_PROGRAMS: tl.constexpr = TILE[3]
    query_ptr, out_ptr, q_strides, o_strides = io
    q_start, q_len, seq_len, floor = row
    k_head_ptr = kv[2]
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
    q_ptrs = query_ptr + q_token[:, None] * q_strides[0] + q_head[:, None] * q_strides[1]
    q = tl.load(q_ptrs + offs_d[None, :] * q_strides[2], mask=qo_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    q = q.to(tl.float32) if DOT_IN_FP32 else q.to(k_head_ptr.dtype.element_ty)

    # Lowest key each query may read: the floor, raised by the window.
    m_lo = tl.maximum(q_pos * 0 + floor, tl.where(sliding_window > 0, q_pos - sliding_window + 1, 0))
    # The tile reads keys in [tile_lo, tile_hi): the union of its queries' ranges, never below the floor.
    tile_first_pos = context_len + q_first
    tile_lo = tl.maximum(floor, tl.where(sliding_window > 0, tile_first_pos - sliding_window + 1, 0))
    tile_hi = context_len + tl.minimum(q_first + BLOCK_Q, q_len)
    bounds = (q_pos, m_lo, tile_lo, tile_hi)
    cols = (offs_d, d_valid)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if ROW_PROGRAMS:
        # One masked loop from the tile's lowest key exactly (not rounded down to BLOCK_N): a decode
        # query's window of W keys then takes cdiv(W, BLOCK_N) steps, not one more.
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, tile_lo, tile_hi, bounds, kv, cols, scale_log2, True, SHAPE, TILE
        )
    else:
        # Keys in [full_lo, tile_first_pos] are visible to every query of the tile: at or below the
        # first query, and at or above the highest query's window start and the floor. The whole
        # BLOCK_N blocks inside that range ([mid_lo, mid_hi)) run unmasked; the blocks before them
        # (window edge) and after them (the causal diagonal) keep the mask. The three spans tile
        # [kv_first, tile_hi) exactly, in ascending order.
        kv_first = (tile_lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(floor, tl.where(sliding_window > 0, tile_hi - sliding_window, 0))
        mid_hi = ((tile_first_pos + 1) // BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, mid_hi)
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, kv_first, mid_lo, bounds, kv, cols, scale_log2, True, SHAPE, TILE
        )
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, mid_lo, mid_hi, bounds, kv, cols, scale_log2, False, SHAPE, TILE
        )
        acc, m_i, l_i = _attend_span(
            acc, m_i, l_i, q, mid_hi, tile_hi, bounds, kv, cols, scale_log2, True, SHAPE, TILE
        )

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_token[:, None] * o_strides[0] + q_head[:, None] * o_strides[1]
    tl.store(o_ptrs + offs_d[None, :] * o_strides[2], acc.to(out_ptr.dtype.element_ty), mask=qo_mask)


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
    kv_floor_ptr,  # int32 [B]; not read without HAS_FLOOR
    num_rows,  # B
    num_kv_heads,  # H_kv; read only by the tile layout
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    sliding_window,  # W; 0 = full attention
    q_strides,  # query's (token, head, dim)
    k_strides,  # the K cache's (block, slot, head, dim)
    v_strides,  # the V cache's (block, slot, head, dim)
    o_strides,  # out's (token, head, dim)
    bt_strides,  # the block table's (row, column)
    SHAPE: tl.constexpr,  # (HEAD_DIM, BLOCK_D, BLOCK_SIZE, GROUP, HAS_FLOOR, DOT_PRECISION, DOT_IN_FP32)
    TILE: tl.constexpr,  # (BLOCK_Q, BLOCK_M, BLOCK_N, ROW_PROGRAMS), from attention_launch
):
    """One program: BLOCK_Q query tokens of one batch row times the GROUP query heads of one kv head
    (the tile layout: grid (tiles * H_kv,)), or every query tile of one row (ROW_PROGRAMS, the decode
    layout: grid (B, H_kv)). BLOCK_D is D padded to a power of two >= 16 (tl.dot's minimum); BLOCK_M is
    BLOCK_Q * GROUP score rows, padded to a power of two >= 16.

    The tile layout numbers the query tiles over the whole batch with no host-side per-row table: row b
    owns the tile ids from query_start_loc[b] // BLOCK_Q + b on, at least cdiv(q_len, BLOCK_Q) of them,
    and a program finds its row by binary search. Surplus tile ids return at once. Its one grid axis of
    tiles * H_kv walks the tile ids backwards, kv heads fastest, so under causal masking the programs with
    the most keys start first and the cheap ones fill the tail of the launch. A decode step has one query
    per row, and there the search (log2 B dependent loads) and the surplus programs cost more than the
    attention over a short window: ROW_PROGRAMS maps program to row directly, and loops over the row's
    tiles so a longer row is still computed right.
    """
    HAS_FLOOR: tl.constexpr = SHAPE[4]
    BLOCK_Q: tl.constexpr = TILE[0]
    ROW_PROGRAMS: tl.constexpr = TILE[3]
    if ROW_PROGRAMS:
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        kv_head = pid % num_kv_heads
        tile_id = tl.num_programs(0) // num_kv_heads - 1 - pid // num_kv_heads
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
    block_table_row = block_table_ptr + row.to(tl.int64) * bt_strides[0]
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * k_strides[2]
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * v_strides[2]
    kv = (block_table_row, bt_strides[1], k_head_ptr, v_head_ptr, k_strides, v_strides)
    if ROW_PROGRAMS:  # every query tile of the row: once for a decode row
        tiles_lo = q_len * 0
        tiles_hi = q_len
    else:  # this program's one tile, or none past the row's last query (a surplus tile id)
        tiles_lo = (tile_id - (q_start // BLOCK_Q + row)) * BLOCK_Q
        tiles_hi = tl.minimum(tiles_lo + 1, q_len)
    for q_first in range(tiles_lo, tiles_hi, BLOCK_Q):
        _attend_query_tile(
            (query_ptr, out_ptr, q_strides, o_strides),
            (q_start, q_len, seq_len, floor),
            q_first,
            kv_head,
            kv,
            sliding_window,
            scale_log2,
            SHAPE,
            TILE,
        )


@triton.jit
def _attend_query_tile_split(
    io,  # (query_ptr, acc_ptr, ml_ptr, q_strides, acc_strides, ml_strides)
    row,  # (q_start, q_len, seq_len, floor), as in _attend_query_tile
    q_first,
    kv_head,
    kv,
    sliding_window,
    scale_log2,
    split,  # (this program's split, the number of splits, the fewest keys a split takes)
    SHAPE: tl.constexpr,
    TILE: tl.constexpr,
):
    """_attend_query_tile over one split of the tile's keys, storing the partial softmax (base-2 running
    max m, sum l, unnormalised output acc) of each of its queries instead of the output.

    The tile's keys [tile_lo, tile_hi) are cut into `num_splits` spans of `chunk` keys from tile_lo:
    chunk = cdiv(keys, num_splits) rounded up to whole BLOCK_N steps, and at least `min_chunk`, so each
    span's steps are the steps the one-launch row loop takes, and a row shorter than num_splits * chunk
    leaves its last splits empty. An empty span (or a query that sees none of the span's keys) stores
    m = -inf and l = 0 and no acc: the reduction gives it weight 0 and never reads its acc.
    """
    HEAD_DIM: tl.constexpr = SHAPE[0]
    BLOCK_D: tl.constexpr = SHAPE[1]
    GROUP: tl.constexpr = SHAPE[3]
    DOT_IN_FP32: tl.constexpr = SHAPE[6]
    BLOCK_Q: tl.constexpr = TILE[0]
    BLOCK_M: tl.constexpr = TILE[1]
    BLOCK_N: tl.constexpr = TILE[2]
    query_ptr, acc_ptr, ml_ptr, q_strides, acc_strides, ml_strides = io
    q_start, q_len, seq_len, floor = row
    split_id, num_splits, min_chunk = split
    k_head_ptr = kv[2]
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_first + offs_m // GROUP  # [BLOCK_M]
    q_head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    m_valid = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)  # [BLOCK_M]
    q_pos = context_len + q_local  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM  # [BLOCK_D]

    q_token = (q_start + q_local).to(tl.int64)
    qo_mask = m_valid[:, None] & d_valid[None, :]  # [BLOCK_M, BLOCK_D]
    q_ptrs = query_ptr + q_token[:, None] * q_strides[0] + q_head[:, None] * q_strides[1]
    q = tl.load(q_ptrs + offs_d[None, :] * q_strides[2], mask=qo_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    q = q.to(tl.float32) if DOT_IN_FP32 else q.to(k_head_ptr.dtype.element_ty)

    m_lo = tl.maximum(q_pos * 0 + floor, tl.where(sliding_window > 0, q_pos - sliding_window + 1, 0))
    tile_first_pos = context_len + q_first
    tile_lo = tl.maximum(floor, tl.where(sliding_window > 0, tile_first_pos - sliding_window + 1, 0))
    tile_hi = context_len + tl.minimum(q_first + BLOCK_Q, q_len)
    # This split's span [span_lo, span_hi) of the tile's keys.
    per_split = (tl.maximum(tile_hi - tile_lo, 0) + num_splits - 1) // num_splits
    chunk = tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_chunk)
    span_lo = tile_lo + split_id * chunk
    span_hi = tl.minimum(span_lo + chunk, tile_hi)
    # The loads stay within the span (tile bounds), and so does each query's visible range: its highest
    # key clamped to the span's last, its lowest raised to the span's first.
    bounds = (tl.minimum(q_pos, span_hi - 1), tl.maximum(m_lo, span_lo), span_lo, span_hi)
    cols = (offs_d, d_valid)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, m_i, l_i = _attend_span(
        acc, m_i, l_i, q, span_lo, span_hi, bounds, kv, cols, scale_log2, True, SHAPE, TILE
    )

    ml_ptrs = ml_ptr + q_token * ml_strides[0] + q_head * ml_strides[1] + split_id * ml_strides[2]  # [M]
    tl.store(ml_ptrs, m_i, mask=m_valid)
    tl.store(ml_ptrs + ml_strides[3], l_i, mask=m_valid)
    a_ptrs = acc_ptr + q_token[:, None] * acc_strides[0] + q_head[:, None] * acc_strides[1]
    a_ptrs += split_id * acc_strides[2] + offs_d[None, :] * acc_strides[3]
    non_empty = (offs_m * 0 + span_lo) < span_hi  # [BLOCK_M]: the span, broadcast to a mask's shape
    tl.store(a_ptrs, acc, mask=qo_mask & non_empty[:, None])


@triton.jit(do_not_specialize=["sliding_window", "min_chunk"])
def _paged_attention_split_kernel(
    query_ptr,  # [T, H_q, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    acc_ptr,  # fp32 [T, H_q, S, D]: each split's unnormalised output
    ml_ptr,  # fp32 [T, H_q, S, 2]: each split's base-2 running max and sum
    block_table_ptr,  # int32 [B, max_blocks]
    query_start_loc_ptr,  # int32 [B + 1]
    seq_lens_ptr,  # int32 [B]
    kv_floor_ptr,  # int32 [B]; not read without HAS_FLOOR
    scale_log2,
    sliding_window,
    min_chunk,  # fewest keys a split takes, a multiple of BLOCK_N
    q_strides,
    k_strides,
    v_strides,
    acc_strides,  # acc's (token, head, split, dim)
    ml_strides,  # ml's (token, head, split, [m, l])
    bt_strides,
    out_ptr,  # [T, H_q, D]; written here only with FUSED_REDUCE
    o_strides,
    arrivals_ptr,  # int32 [>= B * H_kv], zero between launches; read only with FUSED_REDUCE
    SHAPE: tl.constexpr,
    TILE: tl.constexpr,  # the row layout's (BLOCK_Q, BLOCK_M, BLOCK_N, True)
    FUSED_REDUCE: tl.constexpr,  # the last split of a (row, kv head) to finish combines the partials
    CHUNK_S: tl.constexpr,  # splits combined per step (_combine_splits)
):
    """Split-KV row layout, grid (B, H_kv, S): program (row, kv head, split) runs every query tile of the
    row over split `split` of each tile's keys and stores the partials. With FUSED_REDUCE the program
    that arrives last for its (row, kv head) (an atomic counter) combines them into the output in split
    order, so the result does not depend on which one that is, and re-arms the counter for the next
    launch: one launch instead of two (a graph node and a launch gap fewer). Without it,
    _split_reduce_kernel combines them in a second launch. S comes from the host (the grid), never from
    seq_lens: CUDA-graph safe."""
    HAS_FLOOR: tl.constexpr = SHAPE[4]
    HEAD_DIM: tl.constexpr = SHAPE[0]
    BLOCK_D: tl.constexpr = SHAPE[1]
    GROUP: tl.constexpr = SHAPE[3]
    BLOCK_Q: tl.constexpr = TILE[0]
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    num_splits = tl.num_programs(2)

    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    floor = tl.maximum(tl.load(kv_floor_ptr + row), 0) if HAS_FLOOR else row * 0
    block_table_row = block_table_ptr + row.to(tl.int64) * bt_strides[0]
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * k_strides[2]
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * v_strides[2]
    kv = (block_table_row, bt_strides[1], k_head_ptr, v_head_ptr, k_strides, v_strides)
    for q_first in range(q_len * 0, q_len, BLOCK_Q):  # once for a decode row, never for an idle one
        _attend_query_tile_split(
            (query_ptr, acc_ptr, ml_ptr, q_strides, acc_strides, ml_strides),
            (q_start, q_len, seq_len, floor),
            q_first,
            kv_head,
            kv,
            sliding_window,
            scale_log2,
            (split_id, num_splits, min_chunk),
            SHAPE,
            TILE,
        )
    if FUSED_REDUCE:
        tl.debug_barrier()  # every thread's partials are written before the count says so
        arrivals = arrivals_ptr + row * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last of this row's splits: every partial is in memory
            offs_d = tl.arange(0, BLOCK_D)
            d_valid = offs_d < HEAD_DIM  # [BLOCK_D]
            for t in range(q_len * 0, q_len):  # once for a decode row
                token = (q_start + t).to(tl.int64)
                for g in tl.static_range(GROUP):  # unrolled: the heads' loads can overlap
                    head = kv_head * GROUP + g
                    _combine_splits(
                        ml_ptr + token * ml_strides[0] + head * ml_strides[1],
                        acc_ptr + token * acc_strides[0] + head * acc_strides[1],
                        out_ptr + token * o_strides[0] + head * o_strides[1] + offs_d * o_strides[2],
                        num_splits,
                        (ml_strides[2], ml_strides[3], acc_strides[2], acc_strides[3]),
                        offs_d,
                        d_valid,
                        HEAD_DIM,
                        CHUNK_S,
                    )
            tl.atomic_xchg(arrivals, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


@triton.jit
def _combine_splits(
    ml_row,  # this query and head's partials: [S, (m, l)]
    acc_row,  # [S, D]
    o_ptrs,  # [BLOCK_D]: its output
    num_splits,
    strides,  # (ml's split and m/l strides, acc's split and dim strides)
    offs_d,  # [BLOCK_D]
    store_mask,  # [BLOCK_D]
    HEAD_DIM: tl.constexpr,
    CHUNK_S: tl.constexpr,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s, online over chunks of
    CHUNK_S splits in split order. Splits with m_s = -inf (empty) weigh 0 and their acc (never written)
    is discarded with a select, not a load mask, so every load of a chunk issues at once; a query that
    saw no key at all gets 0 (as the one-launch kernel). The loads bypass L1 (.cg): other programs wrote
    the partials."""
    ml_split, ml_l, acc_split, acc_dim = strides
    offs_c = tl.arange(0, CHUNK_S)
    d_valid = offs_d < HEAD_DIM
    m_run = tl.max(tl.full([CHUNK_S], float("-inf"), tl.float32), 0)  # fp32 scalar
    l_run = tl.sum(tl.zeros([CHUNK_S], tl.float32), 0)
    out = tl.zeros(offs_d.shape, tl.float32)  # [BLOCK_D]
    for s0 in range(0, num_splits, CHUNK_S):
        offs_s = s0 + offs_c
        s_valid = offs_s < num_splits
        s_ptrs = ml_row + offs_s * ml_split
        m_s = tl.load(s_ptrs, mask=s_valid, other=float("-inf"), cache_modifier=".cg")  # [CHUNK_S]
        l_s = tl.load(s_ptrs + ml_l, mask=s_valid, other=0.0, cache_modifier=".cg")
        a_ptrs = acc_row + offs_s[:, None] * acc_split + offs_d[None, :] * acc_dim
        acc_s = tl.load(
            a_ptrs, mask=s_valid[:, None] & d_valid[None, :], other=0.0, cache_modifier=".cg"
        )  # [CHUNK_S, BLOCK_D]
        seen = m_s > float("-inf")
        acc_s = tl.where(seen[:, None], acc_s, 0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_shift)
        weight = tl.exp2(m_s - m_shift)  # 0 where empty
        l_run = l_run * alpha + tl.sum(tl.where(seen, weight * l_s, 0.0), 0)
        out = out * alpha + tl.sum(acc_s * weight[:, None], 0)
        m_run = m_new
    out = out / tl.where(l_run > 0.0, l_run, 1.0)
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _split_reduce_kernel(
    acc_ptr,  # fp32 [T, H_q, S, D]
    ml_ptr,  # fp32 [T, H_q, S, 2]
    out_ptr,  # [T, H_q, D]
    query_start_loc_ptr,  # int32 [B + 1]
    num_rows,  # B
    num_splits,  # S
    acc_strides,
    ml_strides,
    o_strides,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK_S: tl.constexpr,  # splits combined per step: all of them (S <= CHUNK_S) in one step
):
    """Grid (T, H_q): combines the S partials of one query token and head into its output
    (_combine_splits). Tokens past query_start_loc[B] (padding) are not written."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_real = tl.load(query_start_loc_ptr + num_rows)  # tokens past it are padding
    offs_d = tl.arange(0, BLOCK_D)
    real = (offs_d * 0 + token) < num_real  # [BLOCK_D]: this token, broadcast to the store's shape
    _combine_splits(
        ml_ptr + token * ml_strides[0] + head * ml_strides[1],
        acc_ptr + token * acc_strides[0] + head * acc_strides[1],
        out_ptr + token * o_strides[0] + head * o_strides[1] + offs_d * o_strides[2],
        num_splits,
        (ml_strides[2], ml_strides[3], acc_strides[2], acc_strides[3]),
        offs_d,
        (offs_d < HEAD_DIM) & real,
        HEAD_DIM,
        CHUNK_S,
    )


def _paged_attention_triton(
    args: tuple, max_query_len: int | None, launch: AttentionLaunch | None = None, compile_only: bool = False
) -> torch.Tensor:
    """The Triton path of paged_attention, given its first ten arguments as `args`; `compile_only`
    compiles the kernel for these arguments and launches nothing (a benchmark compiles its variants up
    front, in parallel)."""
    query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window, kv_floor, out = (
        args
    )
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
    plan = plan_launch(
        num_tokens,
        num_rows,
        num_kv_heads,
        group,
        block_d * k_cache.element_size(),
        k_cache.device,
        max_query_len,
        sliding_window,
        launch,
        block_table.shape[1] * block_size,  # the most keys a row can have (max_model_len): host-known
    )
    dot_precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    dot_in_fp32 = interpreting() and k_cache.dtype == torch.bfloat16
    shape = (head_dim, block_d, block_size, group, kv_floor is not None, dot_precision, dot_in_fp32)
    floor_arg = kv_floor if kv_floor is not None else seq_lens
    if plan.kv_splits > 1:
        _split_attention(args, plan, shape, floor_arg, out, compile_only)
        return out
    kernel = _paged_attention_kernel
    run = functools.partial(kernel.warmup, grid=plan.grid) if compile_only else kernel[plan.grid]
    run(
        query,
        k_cache,
        v_cache,
        out,
        block_table,
        query_start_loc,
        seq_lens,
        floor_arg,
        num_rows,
        num_kv_heads,
        scale * _LOG2E,
        sliding_window,
        query.stride(),
        k_cache.stride(),
        v_cache.stride(),
        out.stride(),
        block_table.stride(),
        SHAPE=shape,
        TILE=plan.tile,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return out


# Per device, the split kernel's arrival counters (int32, zero between launches: each launch's last
# program of a (row, kv head) re-arms its own). A CUDA graph keeps the address it captured, so a buffer
# that grows is replaced, never freed: _RETIRED holds the old ones.
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
_MIN_ARRIVALS = 4096  # the policy splits only launches of at most one (row, kv head) per multiprocessor


def _arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """At least `needed` zeroed counters on `device`, the same tensor for every launch that fits it.
    Growing one inside a CUDA graph capture would record a memset into the graph and allocate from its
    pool: refused (the policy's launches need at most one counter per multiprocessor)."""
    have = _ARRIVALS.get(device)
    if have is not None and have.numel() >= needed:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"split-KV attention needs {needed} arrival counters, {0 if have is None else have.numel()} "
            "exist, and none can be allocated during CUDA graph capture: run the launch once before capturing"
        )
    if have is not None:
        _RETIRED.append(have)
    _ARRIVALS[device] = torch.zeros(max(needed, _MIN_ARRIVALS), dtype=torch.int32, device=device)
    return _ARRIVALS[device]


def _split_attention(
    args: tuple,
    plan: LaunchPlan,
    shape: tuple,
    floor_arg: torch.Tensor,
    out: torch.Tensor,
    compile_only: bool,
) -> None:
    """The split-KV path: the partials kernel over grid (B, H_kv, S), which combines them itself
    (plan.fused_reduce) or leaves that to a second launch over (T, H_q). The partials are one fp32
    buffer of T x H_q x S x (D + 2), sized from host values only (so a CUDA graph captures its allocation
    from the graph's pool); nothing of it is read before it is written."""
    query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window, _, _ = args
    num_tokens, num_q_heads, head_dim = query.shape
    num_rows = seq_lens.shape[0]
    splits = plan.kv_splits
    partials = torch.empty(
        num_tokens * num_q_heads * splits * (head_dim + 2), dtype=torch.float32, device=query.device
    )
    n_acc = num_tokens * num_q_heads * splits * head_dim
    acc = partials[:n_acc].view(num_tokens, num_q_heads, splits, head_dim)
    ml = partials[n_acc:].view(num_tokens, num_q_heads, splits, 2)
    split_kernel, reduce_kernel = _paged_attention_split_kernel, _split_reduce_kernel
    reduce_grid = (num_tokens, num_q_heads)
    if compile_only:
        run_split = functools.partial(split_kernel.warmup, grid=plan.grid)
        run_reduce = functools.partial(reduce_kernel.warmup, grid=reduce_grid)
    else:
        run_split, run_reduce = split_kernel[plan.grid], reduce_kernel[reduce_grid]
    block_d = shape[1]
    chunk_s = min(next_pow2(splits), max(1, 8192 // block_d))
    arrivals = _arrival_counters(query.device, num_rows * k_cache.shape[2]) if plan.fused_reduce else seq_lens
    run_split(
        query,
        k_cache,
        v_cache,
        acc,
        ml,
        block_table,
        query_start_loc,
        seq_lens,
        floor_arg,
        scale * _LOG2E,
        sliding_window,
        plan.split_min_keys,
        query.stride(),
        k_cache.stride(),
        v_cache.stride(),
        acc.stride(),
        ml.stride(),
        block_table.stride(),
        out,
        out.stride(),
        arrivals,
        SHAPE=shape,
        TILE=plan.tile,
        FUSED_REDUCE=plan.fused_reduce,
        CHUNK_S=chunk_s,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if plan.fused_reduce:
        return
    run_reduce(
        acc,
        ml,
        out,
        query_start_loc,
        num_rows,
        splits,
        acc.stride(),
        ml.stride(),
        out.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        CHUNK_S=chunk_s,
        num_warps=4,
    )


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
    program instead of a prefill-sized tile. `launch` overrides the layout and tiling chosen by
    `attention_launch` (benchmarks and tests); the reference path ignores it.
    """
    args = (
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
    )
    if use_triton(query):
        return _paged_attention_triton(args, max_query_len, launch)
    return paged_attention_ref(*args)
