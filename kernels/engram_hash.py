"""Engram n-gram hash over a mixed batch (DESIGN sections 1 and 2).

For token t at chunk offset j of row b, the compressed id at distance s (s = 0..N-1) is
  v_s = compress[input_ids[t - s]]          if s <= j   (inside the chunk)
  v_s = compress[lookback[b, s - j - 1]]    otherwise   (before the chunk start; newest first)
A lookback entry of -1 is a position below 0: a block, and so is a distance past the D stored columns.
So is any token id outside [0, vocab), in the chunk or in the lookback (vocab = len(compress)).
From the first blocked distance on, every v_s is pad_id. Rolling mix: h_0 = v_0 * m_0,
h_s = h_{s-1} XOR (v_s * m_s); for order s + 1 (s = 1..N-1) and head k, column (s-1)*H + k holds
h_s mod primes[s-1, k] + offsets[(s-1)*H + k]. All arithmetic is int64 and cannot overflow: v < V' and
m < 2 * ((2**63 - 1) // V' // 2) + 1.

Every token of input_ids is hashed, also those past qsl[B] (a batch padded for graph replay): they are
blocked from distance 0 and get the all-pad bucket, a valid row, so a padded lookup never leaves the table.
The Triton launcher cannot read qsl[B] without a host sync, and the reference follows it.

Out-of-range ids are blocks on every path (the scalar oracle, the reference and the Triton kernel) and
are never looked up in `compress`, so no path reads out of bounds and all give the same hash. Why a
block: negative ids already were one (the lookback's -1), so ids >= vocab join that rule instead of
making a second; the result is a valid bucket (pad from that distance on), never a row past the table;
and clamping would instead hash some real token's n-grams as if it had been seen. The engine rejects
such ids before they reach a kernel (Scheduler.add_request for prompts, SamplingParams.validate for
stop_token_ids), so one here is a bug upstream; it must not also become a wild read or an IndexError
that only the CPU path raises.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import cdiv, next_pow2, use_triton
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl


def engram_hash_scalar(
    ids: list[int],
    lookback: list[int],
    compress: list[int],
    multipliers: list[int],
    primes: list[list[int]],
    offsets: list[int],
    pad_id: int,
) -> list[list[int]]:
    """Plain-Python hash of one chunk `ids` whose preceding ids (newest first) are `lookback`.

    The test oracle: it follows the DESIGN section 2 literally, one token at a time. An id outside
    [0, len(compress)) is a block, like a position below 0 (see the module docstring).
    """
    n = len(multipliers)
    heads = len(primes[0])
    rows = []
    for j in range(len(ids)):
        blocked = False
        h = 0
        row = []
        for s in range(n):
            if s <= j:
                tok = ids[j - s]
            else:
                k = s - j - 1
                tok = lookback[k] if k < len(lookback) else -1
            if not 0 <= tok < len(compress):
                blocked = True
            v = pad_id if blocked else compress[tok]
            h = v * multipliers[s] if s == 0 else h ^ (v * multipliers[s])
            if s >= 1:
                for k in range(heads):
                    row.append(h % primes[s - 1][k] + offsets[(s - 1) * heads + k])
        rows.append(row)
    return rows


def engram_hash_ref(
    input_ids: torch.Tensor,  # int32/int64 [T]
    query_start_loc: torch.Tensor,  # int32 [B + 1]
    lookback: torch.Tensor,  # int32 [>= B, D]; -1 = before position 0
    compress: torch.Tensor,  # int64 [vocab]: token id -> compressed id
    multipliers: torch.Tensor,  # int64 [N]
    primes: torch.Tensor,  # int64 [N - 1, H]
    offsets: torch.Tensor,  # int64 [(N - 1) * H]
    pad_id: int,
    out: torch.Tensor | None = None,  # int64 [>= T, (N - 1) * H]
) -> torch.Tensor:
    n = multipliers.shape[0]
    heads = primes.shape[1] if primes.dim() == 2 else 0
    depth = lookback.shape[1]
    num_rows = query_start_loc.shape[0] - 1
    num_tokens = input_ids.shape[0] if out is None else min(input_ids.shape[0], out.shape[0])
    if out is None:
        out = torch.empty(num_tokens, (n - 1) * heads, dtype=torch.int64, device=input_ids.device)
    if num_tokens == 0 or n < 2 or heads == 0:
        return out
    dev = input_ids.device
    qsl = query_start_loc.long()
    t = torch.arange(num_tokens, device=dev)
    row = torch.searchsorted(qsl, t, right=True) - 1  # [T]: last row starting at or before t
    real = (row >= 0) & (row < num_rows)  # tokens past qsl[B] are padding
    row = row.clamp(min=0, max=max(num_rows - 1, 0))
    j = t - qsl[row] if num_rows > 0 else torch.zeros_like(t)  # chunk offset [T]
    s = torch.arange(n, device=dev)
    inside = s[None, :] <= j[:, None]  # [T, N]
    in_tok = input_ids.long()[(t[:, None] - s[None, :]).clamp(min=0)]
    # Distance s before offset j is lookback column s - j - 1; past the D stored ids counts as a block.
    lb_col = s[None, :] - j[:, None] - 1  # [T, N]
    lb_tok = torch.full_like(lb_col, -1)
    if depth > 0 and num_rows > 0:
        stored = (lb_col >= 0) & (lb_col < depth)
        gathered = lookback.long()[row[:, None], lb_col.clamp(min=0, max=depth - 1)]
        lb_tok = torch.where(stored, gathered, lb_tok)
    tok = torch.where(inside, in_tok, lb_tok)  # [T, N]
    vocab = compress.shape[0]
    invalid = (tok < 0) | (tok >= vocab)  # [T, N]: below position 0, or not a token id at all
    blocked = (torch.cumsum(invalid.int(), dim=1) > 0) | ~real[:, None]
    # Blocked entries look up id 0 (then replaced by pad_id), so the gather stays in bounds.
    looked_up = compress.long()[torch.where(blocked, 0, tok)] if vocab > 0 else torch.zeros_like(tok)
    v = torch.where(blocked, torch.full_like(tok, pad_id), looked_up)
    prod = v * multipliers.long()[None, :]
    h = prod[:, 0]
    cols = []
    for order in range(1, n):
        h = torch.bitwise_xor(h, prod[:, order])
        cols.append(torch.remainder(h[:, None], primes[order - 1].long()[None, :]))
    out[:num_tokens] = torch.cat(cols, dim=1) + offsets.long()[None, :]
    return out


@triton.jit(do_not_specialize=["num_tokens", "num_rows", "search_steps", "vocab", "pad_id"])
def _engram_hash_kernel(
    out_ptr,  # int64 [>= T, (N - 1) * H]
    out_row_stride,
    input_ids_ptr,  # int32/int64 [T]
    query_start_loc_ptr,  # int32 [B + 1]
    lookback_ptr,  # int32 [>= B, D]
    lookback_row_stride,
    compress_ptr,  # int64 [vocab]
    multipliers_ptr,  # int64 [N]
    primes_ptr,  # int64 [N - 1, H]
    primes_row_stride,
    offsets_ptr,  # int64 [(N - 1) * H]
    num_tokens,
    num_rows,
    search_steps,
    depth,
    num_heads,
    vocab,
    pad_id,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (raystate.kernels._pdl)
):
    pdl_prologue(USE_PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # int32 [BLOCK_T]
    in_range = tokens < num_tokens
    heads = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = heads < num_heads

    # Each token finds its batch row by binary search over query_start_loc (the last b with qsl[b] <= t),
    # so the grid is sized from T alone and nothing is read on the host.
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = lo + num_rows + 1
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        starts_at_or_before = tl.load(query_start_loc_ptr + mid) <= tokens
        lo = tl.where(starts_at_or_before, mid, lo)
        hi = tl.where(starts_at_or_before, hi, mid)
    row = lo
    chunk_start = tl.load(query_start_loc_ptr + row)
    # Tokens past qsl[B] (a padded batch) are blocked from the start: a valid all-pad bucket.
    blocked = (row >= num_rows) | (chunk_start > tokens) | (tokens >= num_tokens)  # [BLOCK_T]
    offset_in_chunk = tokens - chunk_start  # [BLOCK_T]
    lookback_row_ptr = lookback_ptr + row.to(tl.int64) * lookback_row_stride

    pad = tl.zeros([BLOCK_T], dtype=tl.int64) + pad_id
    mix = tl.zeros([BLOCK_T], dtype=tl.int64)
    for s in tl.static_range(N):
        inside = offset_in_chunk >= s
        chunk_id = tl.load(input_ids_ptr + tokens - s, mask=inside & ~blocked, other=-1).to(tl.int64)
        lookback_col = s - offset_in_chunk - 1  # newest first
        stored = ~inside & (lookback_col < depth) & ~blocked
        history_id = tl.load(lookback_row_ptr + lookback_col, mask=stored, other=-1).to(tl.int64)
        tok = tl.where(inside, chunk_id, history_id)  # int64 [BLOCK_T]
        # An id outside [0, vocab) is a block: masked out of the compress load, so never read past it.
        blocked = blocked | (tok < 0) | (tok >= vocab)
        compressed = tl.load(compress_ptr + tok, mask=~blocked, other=0)
        value = tl.where(blocked, pad, compressed.to(tl.int64))
        mix = mix ^ (value * tl.load(multipliers_ptr + s).to(tl.int64))
        if s >= 1:
            primes = tl.load(primes_ptr + (s - 1) * primes_row_stride + heads, mask=head_mask, other=1)
            bucket = mix[:, None] % primes.to(tl.int64)[None, :]  # [BLOCK_T, BLOCK_H]
            # Floor-mod like Python and torch.remainder (C's % keeps the sign of a negative mix).
            bucket = tl.where(bucket < 0, bucket + primes.to(tl.int64)[None, :], bucket)
            col = (s - 1) * num_heads + heads  # [BLOCK_H]
            bucket = bucket + tl.load(offsets_ptr + col, mask=head_mask, other=0).to(tl.int64)[None, :]
            dst = out_ptr + tokens.to(tl.int64)[:, None] * out_row_stride + col[None, :]
            tl.store(dst, bucket, mask=in_range[:, None] & head_mask[None, :])


def engram_hash(
    input_ids, query_start_loc, lookback, compress, multipliers, primes, offsets, pad_id: int, out=None
) -> torch.Tensor:
    """Hashes every token of `input_ids`; tokens past qsl[B] (graph padding) get the all-pad bucket.

    Ids outside [0, len(compress)) are blocks on every path, never looked up (see the module docstring).

    Runs once per engram layer and step, so the Triton path reads each shape and stride once and builds
    no tensor besides `out` when none is given.
    """
    if not use_triton(input_ids):
        return engram_hash_ref(
            input_ids, query_start_loc, lookback, compress, multipliers, primes, offsets, pad_id, out
        )
    n = multipliers.shape[0]
    heads = primes.shape[1] if primes.dim() == 2 else 0
    num_tokens = input_ids.shape[0] if out is None else min(input_ids.shape[0], out.shape[0])
    if out is None:
        out = torch.empty(num_tokens, (n - 1) * heads, dtype=torch.int64, device=input_ids.device)
    if num_tokens == 0 or n < 2 or heads == 0:
        return out
    out_row_stride, out_col_stride = out.stride()
    primes_row_stride, primes_col_stride = primes.stride()
    lookback_row_stride, lookback_col_stride = lookback.stride()
    depth = lookback.shape[1]
    assert out_col_stride == 1 and primes_col_stride == 1 and offsets.stride()[0] == 1
    assert depth == 0 or lookback_col_stride == 1
    num_rows = query_start_loc.shape[0] - 1
    block_t = min(128, next_pow2(num_tokens))
    pdl = use_pdl(input_ids)
    _engram_hash_kernel[(cdiv(num_tokens, block_t),)](
        out,
        out_row_stride,
        input_ids,
        query_start_loc,
        lookback,
        lookback_row_stride,
        compress,
        multipliers,
        primes,
        primes_row_stride,
        offsets,
        num_tokens,
        num_rows,
        max(num_rows, 0).bit_length(),  # binary-search steps over the B + 1 row starts
        depth,
        heads,
        compress.shape[0],  # vocab: ids at or past it are blocks
        pad_id,
        N=n,
        BLOCK_T=block_t,
        BLOCK_H=next_pow2(heads),
        USE_PDL=pdl,
        **launch_options(pdl),
    )
    return out
