"""Log-probabilities on the device: one fixed-shape function for every row of a step that asks for them.

`SamplingParams.logprobs` / `prompt_logprobs` (k in 0..20) ask, per token, for its logprob, its rank and
the k most likely (id, logprob). They are taken from the logits the sampler starts from: after the logit
controls (penalties, logit_bias, min_tokens: `raystate.worker.penalties`) and before temperature, top-k,
top-p and min_p, as `log_softmax` in fp32 (the model's distribution as the controls left it, not the
truncated one that was sampled from; vLLM's default "raw" logprobs, with our controls applied first).
Prompt positions have no controls (those depend on the output) and use the raw logits.

`compute_logprobs` takes logits [N, V] and each row's token (the sampled id, or the next prompt token)
and returns one int32 tensor [N, WIDTH]: one logsumexp, one gather, one compare-and-count for the rank
and one topk with k = MAX_LOGPROBS whatever the rows asked (both over column chunks first), so the shapes
depend on N only and the function runs inside a captured CUDA graph. The int32 packing lets the result
travel back to the host in the same device -> host copy as the sampled ids (column ID_COL holds them):

    [rank | token id, top ids (MAX_LOGPROBS) | token logprob, top logprobs (MAX_LOGPROBS), fp32 bits]

A vocabulary smaller than MAX_LOGPROBS pads the top entries with id -1 and logprob -inf.
"""

from __future__ import annotations

import numpy as np
import torch

from raystate.messages import MAX_LOGPROBS, pack_logprobs

K1 = MAX_LOGPROBS + 1  # the token itself and its top alternatives
RANK_COL = 0
ID_COL = 1  # the token's own id (the sampled id on decode rows)
LP_COL = 1 + K1
WIDTH = 1 + 2 * K1


# Row reductions over a large vocabulary run as two stages over column chunks of this width: a torch
# reduction (log_softmax, topk) over [N, V] works one row per block, so 64 rows of 262k ids keep 64 of the
# GPU's 132 SMs busy, each making several passes over 1 MB; chunks give N * V / CHUNK blocks.
CHUNK = 4096


def _row_logsumexp(x: torch.Tensor) -> torch.Tensor:  # fp32 [N, V] -> fp32 [N, 1]
    n, v = x.shape
    main = v - v % CHUNK
    if main < 2 * CHUNK:
        return torch.logsumexp(x, dim=1, keepdim=True)
    parts = [torch.logsumexp(x[:, :main].view(n, main // CHUNK, CHUNK), dim=2)]  # [N, V // CHUNK]
    if main < v:
        parts.append(torch.logsumexp(x[:, main:], dim=1, keepdim=True))
    return torch.logsumexp(torch.cat(parts, dim=1), dim=1, keepdim=True)


def _row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # [N, k] values, int64 ids
    """The k largest of each row, largest first: the k largest of each chunk, then of those."""
    n, v = x.shape
    main = v - v % CHUNK
    if main < 2 * CHUNK:
        return torch.topk(x, k, dim=1)
    vals, ids = torch.topk(x[:, :main].view(n, main // CHUNK, CHUNK), k, dim=2)  # [N, C, k]
    ids = ids + torch.arange(0, main, CHUNK, device=x.device).view(1, -1, 1)
    vals, ids = vals.reshape(n, -1), ids.reshape(n, -1)
    if main < v:
        tail_vals, tail_ids = torch.topk(x[:, main:], min(k, v - main), dim=1)
        vals, ids = torch.cat([vals, tail_vals], dim=1), torch.cat([ids, tail_ids + main], dim=1)
    top, at = torch.topk(vals, k, dim=1)
    return top, ids.gather(1, at)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype), token_ids int [N] (a negative id, e.g. FAILED_ROW, is kept in the
    id column and its logprob read at id 0) -> int32 [N, WIDTH]. No host sync, fixed shapes.

    A logprob is the logit less the row's logsumexp, in fp32: the [N, V] log_softmax is never written,
    and the rank and the top ids are read off the logits themselves (the same order)."""
    n, v = logits.shape
    x = logits.float()  # fp32 [N, V]
    lse = _row_logsumexp(x)  # fp32 [N, 1]
    tok = token_ids.to(torch.int64)
    tok_logit = x.gather(1, tok.clamp(0, v - 1).unsqueeze(1))  # fp32 [N, 1]
    rank = (x > tok_logit).sum(dim=1, keepdim=True) + 1  # int64 [N, 1]
    k = min(MAX_LOGPROBS, v)
    top_logits, top_ids = _row_topk(x, k)  # sorted, largest first
    top_lp = top_logits - lse
    if k < MAX_LOGPROBS:
        top_lp = torch.cat([top_lp, top_lp.new_full((n, MAX_LOGPROBS - k), float("-inf"))], dim=1)
        top_ids = torch.cat([top_ids, top_ids.new_full((n, MAX_LOGPROBS - k), -1)], dim=1)
    ints = torch.cat([rank, tok.unsqueeze(1), top_ids], dim=1).to(torch.int32)  # int32 [N, 1 + K1]
    floats = torch.cat([tok_logit - lse, top_lp], dim=1).view(torch.int32)  # fp32 bits [N, K1]
    return torch.cat([ints, floats], dim=1)


def record(row: np.ndarray, k: int) -> bytes:
    """One host row (int32 [WIDTH]) as the wire record of a request that asked for k alternatives."""
    return records(row[None], k)


def records(rows: np.ndarray, k: int) -> bytes:
    """Host rows (int32 [n, WIDTH]) as wire records (`raystate.messages.pack_logprobs`) with k
    alternatives each (fewer where the vocabulary has fewer)."""
    rows = np.asarray(rows, dtype=np.int32)
    w = 1 + k
    ids = rows[:, ID_COL : ID_COL + w]
    lps = rows[:, LP_COL : LP_COL + w].view(np.float32)
    if k and (ids[:, 1:] < 0).any():  # a vocabulary smaller than k: drop the padding
        w = 1 + int((ids[0, 1:] >= 0).sum())
        ids, lps = ids[:, :w], lps[:, :w]
    return pack_logprobs(ids, lps, rows[:, RANK_COL])
