"""Engram n-gram hash over a mixed batch (SPEC sections 1 and 2).

For token t at chunk offset j of row b, the compressed id at distance s (s = 0..N-1) is
  v_s = compress[input_ids[t - s]]          if s <= j   (inside the chunk)
  v_s = compress[lookback[b, s - j - 1]]    otherwise   (before the chunk start; newest first)
A lookback entry of -1 is a position below 0: a block. From the first blocked distance on, every v_s is
pad_id. Rolling mix: h_0 = v_0 * m_0, h_s = h_{s-1} XOR (v_s * m_s); for order s + 1 (s = 1..N-1) and
head k, column (s-1)*H + k holds h_s mod primes[s-1, k] + offsets[(s-1)*H + k]. All arithmetic is int64
and cannot overflow: v < V' and m < 2 * ((2**63 - 1) // V' // 2) + 1.
"""

from __future__ import annotations

import torch

from raystate.kernels._common import use_triton


def engram_hash_scalar(
    ids: list[int], lookback: list[int], compress: list[int], multipliers: list[int], primes: list[list[int]],
    offsets: list[int], pad_id: int,
) -> list[list[int]]:
    """Plain-Python hash of one chunk `ids` whose preceding ids (newest first) are `lookback`.

    The test oracle: it follows the SPEC text literally, one token at a time.
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
            if tok < 0:
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
    lookback: torch.Tensor,  # int32 [>= B, D], D >= N - 1; -1 = before position 0
    compress: torch.Tensor,  # int64 [vocab]: token id -> compressed id
    multipliers: torch.Tensor,  # int64 [N]
    primes: torch.Tensor,  # int64 [N - 1, H]
    offsets: torch.Tensor,  # int64 [(N - 1) * H]
    pad_id: int,
    out: torch.Tensor | None = None,  # int64 [>= T, (N - 1) * H]
) -> torch.Tensor:
    n = multipliers.shape[0]
    heads = primes.shape[1]
    num_rows = query_start_loc.shape[0] - 1
    qsl = query_start_loc.long()
    num_tokens = int(qsl[-1]) if num_rows >= 0 else 0
    if out is None:
        out = torch.empty(num_tokens, (n - 1) * heads, dtype=torch.int64, device=input_ids.device)
    if num_tokens == 0:
        return out
    dev = input_ids.device
    row = torch.repeat_interleave(torch.arange(num_rows, device=dev), qsl.diff())  # [T]
    t = torch.arange(num_tokens, device=dev)
    j = t - qsl[row]  # chunk offset [T]
    s = torch.arange(n, device=dev)
    inside = s[None, :] <= j[:, None]  # [T, N]
    in_tok = input_ids.long()[(t[:, None] - s[None, :]).clamp(min=0)]
    lb_col = (s[None, :] - j[:, None] - 1).clamp(min=0, max=lookback.shape[1] - 1)
    lb_tok = lookback.long()[row[:, None], lb_col]
    tok = torch.where(inside, in_tok, lb_tok)  # [T, N]
    blocked = torch.cumsum((tok < 0).int(), dim=1) > 0
    v = torch.where(blocked, torch.full_like(tok, pad_id), compress.long()[tok.clamp(min=0)])
    prod = v * multipliers.long()[None, :]
    h = prod[:, 0]
    cols = []
    for order in range(1, n):
        h = torch.bitwise_xor(h, prod[:, order])
        cols.append(torch.remainder(h[:, None], primes[order - 1].long()[None, :]))
    out[:num_tokens] = torch.cat(cols, dim=1) + offsets.long()[None, :]
    return out


def engram_hash(
    input_ids, query_start_loc, lookback, compress, multipliers, primes, offsets, pad_id: int, out=None
) -> torch.Tensor:
    if use_triton(input_ids):
        return _engram_hash_triton(
            input_ids, query_start_loc, lookback, compress, multipliers, primes, offsets, pad_id, out
        )
    return engram_hash_ref(input_ids, query_start_loc, lookback, compress, multipliers, primes, offsets, pad_id, out)


def _engram_hash_triton(*args):
    raise NotImplementedError("Triton engram_hash: being written")
