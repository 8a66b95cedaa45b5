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
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl
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
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (raystate.kernels._pdl)
    EARLY_BOUNDS: tl.constexpr,  # with USE_PDL: read the row's bounds before waiting (EARLY_BOUNDS below)
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
    if not EARLY_BOUNDS:
        pdl_prologue(USE_PDL)
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
    if EARLY_BOUNDS:
        pdl_prologue(USE_PDL)
    block_table_row = block_table_ptr + row.to(tl.int64) * bt_strides[0]
    k_head_ptr = k_cache_ptr + kv_head.to(tl.int64) * k_strides[2]
    v_head_ptr = v_cache_ptr + kv_head.to(tl.int64) * v_strides[2]
    kv = (block_table_row, bt_strides[1], k_head_ptr, v_head_ptr, k_strides, v_strides)
    io = (query_ptr, out_ptr, q_strides, o_strides)
    row_bounds = (q_start, q_len, seq_len, floor)
    if ROW_PROGRAMS:
        # Every query tile of the row. The first runs straight-line, outside the loop below: a decode
        # row has one tile, and a loop around the key loop costs about a microsecond a program. Later
        # tiles (a row longer than the launch's max_query_len said) run in the loop.
        if q_len > 0:
            _attend_query_tile(
                io, row_bounds, q_len * 0, kv_head, kv, sliding_window, scale_log2, SHAPE, TILE
            )
        tiles_lo = q_len * 0 + BLOCK_Q
        tiles_hi = q_len
    else:  # this program's one tile, or none past the row's last query (a surplus tile id)
        tiles_lo = (tile_id - (q_start // BLOCK_Q + row)) * BLOCK_Q
        tiles_hi = tl.minimum(tiles_lo + 1, q_len)
    for q_first in range(tiles_lo, tiles_hi, BLOCK_Q):
        _attend_query_tile(io, row_bounds, q_first, kv_head, kv, sliding_window, scale_log2, SHAPE, TILE)


@triton.jit
def _split_token(
    io,  # (query_ptr, acc_ptr, ml_ptr, q_strides, acc_strides, ml_strides)
    kv,  # (block_table_row, bt_col_stride, k_head_ptr, v_head_ptr, k_strides, v_strides)
    token,  # the query token's index in the batch
    q_pos,  # its position in the row
    live,  # False: an idle row's stand-in token; reads no key, writes nothing
    floor,
    sliding_window,
    scale_log2,
    split,  # (this program's split, the number of splits, the fewest keys a split takes)
    lanes,  # (offs_m, heads, m_valid, offs_d, d_valid): this kv head's query heads, the head dim
    SHAPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """One query token's GROUP heads over this program's split of the token's keys [lo, q_pos]: the
    partial softmax stored at (token, head, split). Its keys are cut into spans of chunk = cdiv(keys, S)
    rounded up to whole BLOCK_N steps (at least min_chunk) from lo; a span past the keys is empty and
    stores m = -inf, l = 0, acc = 0 (weight 0 in the combine)."""
    BLOCK_D: tl.constexpr = SHAPE[1]
    BLOCK_SIZE: tl.constexpr = SHAPE[2]
    DOT_PRECISION: tl.constexpr = SHAPE[5]
    DOT_IN_FP32: tl.constexpr = SHAPE[6]
    query_ptr, acc_ptr, ml_ptr, q_strides, acc_strides, ml_strides = io
    bt_row, bt_col, k_head, v_head, k_strides, v_strides = kv
    split_id, num_splits, min_chunk = split
    offs_m, heads, m_valid, offs_d, d_valid = lanes
    lo = tl.maximum(floor, tl.where(sliding_window > 0, q_pos - sliding_window + 1, 0))
    keys = tl.where(live, tl.maximum(q_pos + 1 - lo, 0), 0)
    per_split = (keys + num_splits - 1) // num_splits
    chunk = tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_chunk)
    span_lo = lo + split_id * chunk
    span_hi = tl.minimum(span_lo + chunk, lo + keys)
    tok = token.to(tl.int64)
    # `live` broadcast to [BLOCK_M] before the &: Triton's interpreter rejects a tensor & scalar-bool mask.
    mask_m = m_valid & ((offs_m * 0 + live.to(tl.int32)) != 0)  # [BLOCK_M]
    md_mask = mask_m[:, None] & d_valid[None, :]  # [BLOCK_M, BLOCK_D]

    q_ptrs = query_ptr + tok * q_strides[0] + heads[:, None] * q_strides[1] + offs_d[None, :] * q_strides[2]
    q = tl.load(q_ptrs, mask=md_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    q = q.to(tl.float32) if DOT_IN_FP32 else q.to(k_head.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in tl.range(span_lo, span_hi, BLOCK_N, num_stages=NUM_STAGES):
        k_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_valid = k_pos < span_hi
        blocks = tl.load(bt_row + (k_pos // BLOCK_SIZE) * bt_col, mask=k_valid, other=0).to(tl.int64)
        slots = k_pos % BLOCK_SIZE
        kv_mask = k_valid[:, None] & d_valid[None, :]  # [BLOCK_N, BLOCK_D]
        k_off = blocks * k_strides[0] + slots * k_strides[1]  # [BLOCK_N]
        v_off = blocks * v_strides[0] + slots * v_strides[1]
        # K and V of the step are requested together: V does not wait for the scores.
        k_t = tl.load(
            k_head + k_off[None, :] + offs_d[:, None] * k_strides[3], mask=tl.trans(kv_mask), other=0.0
        )  # [BLOCK_D, BLOCK_N]
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :] * v_strides[3], mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k_t = k_t.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        scores = tl.where(k_valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a span with no key: exp2 gives 0
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    ml_ptrs = ml_ptr + tok * ml_strides[0] + heads * ml_strides[1] + split_id * ml_strides[2]  # [BLOCK_M]
    tl.store(ml_ptrs, m_i, mask=mask_m)
    tl.store(ml_ptrs + ml_strides[3], l_i, mask=mask_m)
    a_ptrs = acc_ptr + tok * acc_strides[0] + heads[:, None] * acc_strides[1] + split_id * acc_strides[2]
    tl.store(a_ptrs + offs_d[None, :] * acc_strides[3], acc, mask=md_mask)


@triton.jit(do_not_specialize=["sliding_window", "min_chunk"])
def _split_kv_kernel(
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
    q_strides,  # query's (token, head, dim)
    k_strides,  # the K cache's (block, slot, head, dim)
    v_strides,
    acc_strides,  # acc's (token, head, split, dim)
    ml_strides,  # ml's (token, head, split, [m, l])
    bt_strides,
    SHAPE: tl.constexpr,  # as _paged_attention_kernel's
    BLOCK_M: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    BLOCK_N: tl.constexpr,  # keys per step
    NUM_STAGES: tl.constexpr,  # software pipelining of the key loop (1: none)
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent; so is the combine after it
    EARLY_BOUNDS: tl.constexpr,  # with USE_PDL: read the row's bounds before waiting (EARLY_BOUNDS below)
):
    """Split-KV decode, grid (B, H_kv, S): program (row, kv head, split) attends the GROUP query heads of
    each of the row's query tokens over split `split` of that token's keys and stores the partial softmax
    (base-2 max m, sum l, unnormalised output acc); _split_combine_kernel merges the S partials.

    Written for the launches it serves, batches too small to fill the GPU, where a call's time is a chain
    of dependent memory round trips more than the bytes it reads: the row's bounds (three independent
    loads), then the query and the span's block ids, then K and V of a key step together, before any
    arithmetic. The row's first token runs straight-line (no loop around it: on the H200 a token loop
    around the key loop cost ~1 us a call); a decode row has only that one, an idle row (q_len 0) runs it
    as a stand-in that reads and writes nothing, and a longer row (a caller whose max_query_len
    understated its rows) stays exact, its other tokens one at a time in a loop. Token t of a row of
    q_len sits at p_t = seq_len - q_len + t and reads keys [max(floor, p_t - W + 1), p_t]. S comes from
    the host (the grid), never from seq_lens: CUDA-graph safe."""
    HEAD_DIM: tl.constexpr = SHAPE[0]
    BLOCK_D: tl.constexpr = SHAPE[1]
    GROUP: tl.constexpr = SHAPE[3]
    HAS_FLOOR: tl.constexpr = SHAPE[4]
    # The combine may then be scheduled once every split program has started; it waits in
    # griddepcontrol.wait until this grid has finished and its partials are visible.
    if not EARLY_BOUNDS:
        pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = (tl.program_id(2), tl.num_programs(2), min_chunk)

    q_start = tl.load(query_start_loc_ptr + row)
    q_end = tl.load(query_start_loc_ptr + row + 1)
    seq_len = tl.load(seq_lens_ptr + row)
    floor = tl.maximum(tl.load(kv_floor_ptr + row), 0) if HAS_FLOOR else row * 0
    if EARLY_BOUNDS:
        pdl_prologue(USE_PDL)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    # A head dim that is its own power of two masks nothing: a constant mask keeps the loads and stores
    # vectorised along D.
    d_valid = offs_d < HEAD_DIM if HEAD_DIM != BLOCK_D else tl.full([BLOCK_D], 1, tl.int1)  # [BLOCK_D]
    lanes = (offs_m, kv_head * GROUP + offs_m, offs_m < GROUP, offs_d, d_valid)
    io = (query_ptr, acc_ptr, ml_ptr, q_strides, acc_strides, ml_strides)
    bt_row = block_table_ptr + row.to(tl.int64) * bt_strides[0]
    k_head = k_cache_ptr + kv_head.to(tl.int64) * k_strides[2]
    v_head = v_cache_ptr + kv_head.to(tl.int64) * v_strides[2]
    kv = (bt_row, bt_strides[1], k_head, v_head, k_strides, v_strides)
    first_pos = seq_len - q_end + q_start
    _split_token(
        io, kv, q_start, first_pos, q_end > q_start, floor, sliding_window, scale_log2, split, lanes,
        SHAPE, BLOCK_M, BLOCK_N, NUM_STAGES,
    )  # fmt: skip
    for token in range(q_start + 1, q_end):  # never for a decode row
        live = token < q_end  # a tensor under the interpreter too
        _split_token(
            io, kv, q_start * 0 + token, first_pos + (token - q_start), live, floor, sliding_window,
            scale_log2, split, lanes, SHAPE, BLOCK_M, BLOCK_N, NUM_STAGES,
        )  # fmt: skip


@triton.jit
def _merge_split_chunk(ml_row, acc_row, s0, num_splits, ml_strides, acc_strides, CHUNK_S: tl.constexpr):
    """Splits [s0, s0 + CHUNK_S) of one token and head, loaded at once and merged: (M, sum_s 2^(m_s - M)
    l_s, sum_s 2^(m_s - M) acc_s) with M their largest m (0 shift where every split is empty: weight 0)."""
    offs_s = s0 + tl.arange(0, CHUNK_S)
    s_valid = offs_s < num_splits
    m_s = tl.load(ml_row + offs_s * ml_strides[2], mask=s_valid, other=float("-inf"))  # [CHUNK_S]
    l_s = tl.load(ml_row + offs_s * ml_strides[2] + ml_strides[3], mask=s_valid, other=0.0)
    acc_s = tl.load(acc_row + offs_s[:, None] * acc_strides[2], mask=s_valid[:, None], other=0.0)
    m_max = tl.max(m_s, 0)
    weight = tl.exp2(m_s - tl.where(m_max == float("-inf"), 0.0, m_max))  # [CHUNK_S]; 0 for an empty split
    return m_max, tl.sum(weight * l_s, 0), tl.sum(acc_s * weight[:, None], 0)


@triton.jit(do_not_specialize=["num_rows", "num_splits"])
def _split_combine_kernel(
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
    D_SLICE: tl.constexpr,  # head-dim lanes per program
    CHUNK_S: tl.constexpr,  # splits loaded at once: all of them (S <= CHUNK_S) in one round trip
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent of the split kernel: wait for it
):
    """Grid (T, H_q, BLOCK_D / D_SLICE): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s (M = max_s
    m_s) for one query token, head and slice of the head dim, in split order (online over chunks of
    CHUNK_S splits where S is larger), so the result does not depend on the launch. Slicing the head dim
    spreads a batch-1 combine over several programs, each loading its splits' partials at once. An empty
    split (m_s = -inf) weighs 0; a query that saw no key gets 0 (as the one-launch kernel). Tokens past
    query_start_loc[B] (padding) are not written."""
    pdl_prologue(USE_PDL)  # the split kernel has finished; its partials are visible
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.program_id(2) * D_SLICE + tl.arange(0, D_SLICE)  # [D_SLICE]
    num_real = tl.load(query_start_loc_ptr + num_rows)  # tokens past it are padding
    ml_row = ml_ptr + token * ml_strides[0] + head * ml_strides[1]
    acc_row = acc_ptr + token * acc_strides[0] + head * acc_strides[1] + offs_d[None, :] * acc_strides[3]
    # The first chunk straight-line (every split of a small launch: one round trip), the rest in order.
    m_run, l_run, out = _merge_split_chunk(ml_row, acc_row, 0, num_splits, ml_strides, acc_strides, CHUNK_S)
    for s0 in range(CHUNK_S, num_splits, CHUNK_S):
        m_c, l_c, out_c = _merge_split_chunk(
            ml_row, acc_row, s0, num_splits, ml_strides, acc_strides, CHUNK_S
        )
        m_new = tl.maximum(m_run, m_c)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m_run - m_shift), tl.exp2(m_c - m_shift)
        l_run = l_run * alpha + l_c * beta
        out = out * alpha + out_c * beta
        m_run = m_new
    out = out / tl.where(l_run > 0.0, l_run, 1.0)
    store_mask = (offs_d < HEAD_DIM) & ((offs_d * 0 + token) < num_real)
    tl.store(
        out_ptr + token * o_strides[0] + head * o_strides[1] + offs_d * o_strides[2], out, mask=store_mask
    )


# Both decode kernels may read the row's bounds (query_start_loc, seq_lens, kv_floor) before
# griddepcontrol.wait, so that this first dependent round trip overlaps the previous kernel's tail. Safe
# because of what may still run then: only the kernel launched just before (every earlier one has
# finished: raystate.kernels._pdl), and no kernel launched as a programmatic dependent writes those
# tensors (the host and the step's metadata, before the first layer, do). Everything the previous
# kernel may write (the query, the KV cache, the partials) is read after the wait. Passed with or without
# PDL (without, the wait is a no-op: the same reads in the same order), so the interpreter runs the order
# the GPU does. A switch so that `bench_attention.py --split-only` and bench_decode.py can time both ways
# in one process. Measured on the H200 (BENCHMARKS.md "Row bounds before the PDL wait").
EARLY_BOUNDS = True

# The combine's head-dim slice and how many fp32 partials a program loads at once (CHUNK_S x D_SLICE).
COMBINE_D_SLICE = 32
COMBINE_CHUNK_ELEMS = 4096


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
    pdl = use_pdl(query)
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
        USE_PDL=pdl,
        EARLY_BOUNDS=EARLY_BOUNDS,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **launch_options(pdl),
    )
    return out


def _split_attention(
    args: tuple,
    plan: LaunchPlan,
    shape: tuple,
    floor_arg: torch.Tensor,
    out: torch.Tensor,
    compile_only: bool,
) -> None:
    """The split-KV path: _split_kv_kernel over grid (B, H_kv, S), then _split_combine_kernel over
    (T, H_q, head-dim slices). The partials are one fp32 buffer of T x H_q x S x (D + 2), sized from host
    values only (so a CUDA graph captures its allocation from the graph's pool); every split of every real
    token writes its partials before the combine reads them."""
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
    block_d = shape[1]
    d_slice = min(block_d, COMBINE_D_SLICE)
    chunk_s = min(next_pow2(splits), max(1, COMBINE_CHUNK_ELEMS // d_slice))
    split_grid, combine_grid = plan.grid, (num_tokens, num_q_heads, block_d // d_slice)
    pdl = use_pdl(query)
    split_kernel, combine_kernel = _split_kv_kernel, _split_combine_kernel
    if compile_only:
        run_split = functools.partial(split_kernel.warmup, grid=split_grid)
        run_combine = functools.partial(combine_kernel.warmup, grid=combine_grid)
    else:
        run_split, run_combine = split_kernel[split_grid], combine_kernel[combine_grid]
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
        SHAPE=shape,
        BLOCK_M=max(16, next_pow2(shape[3])),  # one token's GROUP heads, whatever tile the plan sized
        BLOCK_N=plan.tile[2],
        NUM_STAGES=plan.num_stages,
        USE_PDL=pdl,
        EARLY_BOUNDS=EARLY_BOUNDS,
        num_warps=plan.num_warps,
        **launch_options(pdl),
    )
    run_combine(
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
        D_SLICE=d_slice,
        CHUNK_S=chunk_s,
        USE_PDL=pdl,
        num_warps=4,
        **launch_options(pdl),
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
