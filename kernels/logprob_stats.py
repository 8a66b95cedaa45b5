"""What a token's logprob record needs from one row of logits, in one pass over the row: the row's
logsumexp, the token's rank and the k largest logits with their ids.

Torch's row reductions (log_softmax, the compare-and-count for the rank, topk) each work one row per
thread block: at a decode batch of 64 rows and a 262k vocabulary they use 64 of an H200's 132 SMs and
reach 0.07-0.15 of the copy bandwidth (`bench/bench_logprobs.py`: 0.51 ms a step, 7% of a Gemma-3-4B
decode step). Here each program takes one chunk of one row (a grid of rows x chunks) and reads it once:
its max and sum of exp (the logsumexp's parts), how many of its logits exceed the token's, and its k
largest (k rounds of max-and-take, ties to the lower id). Torch then combines the few partials per row.

A logit is compared raw: the rank and the top ids are those of the log-probabilities (logits less one
constant per row), and a logprob is the logit less the row's logsumexp, in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import cdiv, next_pow2, use_triton

CHUNK = 4096  # columns per program


def logprob_stats_ref(
    logits: torch.Tensor,  # [N, V], any float dtype
    token_ids: torch.Tensor,  # int64 [N], each in [0, V)
    k: int,  # 1 <= k <= V
) -> tuple[torch.Tensor, ...]:
    """`logprob_stats` by whole-row torch reductions (the same five tensors)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    tok = x.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    rank = (x > tok.unsqueeze(1)).sum(dim=1) + 1
    top, ids = torch.topk(x, k, dim=1)
    return lse, tok, rank, top, ids


@triton.jit
def _logprob_partials_kernel(
    logits_ptr,  # [N, V]
    token_logit_ptr,  # fp32 [N]
    chunk_max_ptr,  # fp32 [N, C]
    chunk_sum_ptr,  # fp32 [N, C]: sum of exp(logit - chunk max); 0 for a chunk of -inf only
    chunk_count_ptr,  # int32 [N, C]: logits above the token's
    top_ptr,  # fp32 [N, C, K]
    top_ids_ptr,  # int32 [N, C, K]: -1 where the chunk had fewer than K columns
    logits_stride,
    vocab,
    num_chunks,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    cols = chunk * BLOCK + lanes  # [BLOCK]
    valid = cols < vocab
    x = tl.load(logits_ptr + row * logits_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    token_logit = tl.load(token_logit_ptr + row)
    out = row * num_chunks + chunk

    chunk_max = tl.max(x, axis=0)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    tl.store(chunk_max_ptr + out, chunk_max)
    tl.store(chunk_sum_ptr + out, tl.sum(tl.exp(x - shift), axis=0))
    tl.store(chunk_count_ptr + out, tl.sum((x > token_logit).to(tl.int32), axis=0))

    # The K largest, largest first; among equal logits (-inf included) the lowest column first. A taken
    # column (or one past the vocabulary) is out of the running, whatever its value.
    taken = cols >= vocab  # [BLOCK]
    for i in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        at = tl.min(tl.where((~taken) & (x == best), lanes, BLOCK), axis=0)
        found = at < BLOCK
        tl.store(top_ptr + out * K + i, tl.where(found, best, float("-inf")))
        tl.store(top_ids_ptr + out * K + i, tl.where(found, chunk * BLOCK + at, -1))
        taken = taken | (lanes == at)


def logprob_stats(
    logits: torch.Tensor,  # [N, V]
    token_ids: torch.Tensor,  # int64 [N], each in [0, V)
    k: int,  # 1 <= k <= V
) -> tuple[torch.Tensor, ...]:
    """(logsumexp fp32 [N], the token's logit fp32 [N], its rank int64 [N] (1 + the logits above it),
    the k largest logits fp32 [N, k] largest first, their ids int64 [N, k]). Fixed shapes, no host sync."""
    if not use_triton(logits):
        return logprob_stats_ref(logits, token_ids, k)
    n, v = logits.shape
    assert logits.stride(1) == 1 and 1 <= k <= v
    block = min(CHUNK, next_pow2(v))
    c = cdiv(v, block)
    dev = logits.device
    token_logit = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1).float()  # [N]
    chunk_max = torch.empty((n, c), dtype=torch.float32, device=dev)
    chunk_sum = torch.empty((n, c), dtype=torch.float32, device=dev)
    chunk_count = torch.empty((n, c), dtype=torch.int32, device=dev)
    top = torch.empty((n, c, k), dtype=torch.float32, device=dev)
    top_ids = torch.empty((n, c, k), dtype=torch.int32, device=dev)
    if n:
        _logprob_partials_kernel[(n, c)](
            logits,
            token_logit,
            chunk_max,
            chunk_sum,
            chunk_count,
            top,
            top_ids,
            logits.stride(0),
            v,
            c,
            K=k,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    row_max = chunk_max.amax(dim=1, keepdim=True)  # [N, 1]
    shift = torch.where(row_max == float("-inf"), 0.0, row_max)
    scaled = chunk_sum * torch.exp(torch.where(chunk_max == float("-inf"), shift, chunk_max) - shift)
    lse = (torch.log(scaled.sum(dim=1, keepdim=True)) + shift).squeeze(1)
    rank = chunk_count.sum(dim=1, dtype=torch.int64) + 1
    # Candidates are chunk by chunk, each chunk's largest first with ties to the lower id: a stable sort
    # keeps ties to the lower id across chunks too, so a shortfall (-1) never outranks a real column.
    top, order = torch.sort(top.view(n, c * k), dim=1, descending=True, stable=True)
    # A row of NaN (a failed row) takes no column; id 0 keeps every id valid (-1 would read as padding).
    ids = top_ids.view(n, c * k).gather(1, order[:, :k]).long().clamp_(min=0)
    return lse, token_logit, rank, top[:, :k], ids
