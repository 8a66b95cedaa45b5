"""Log-probabilities on the device: one fixed-shape function for every row of a step that asks for them.

`SamplingParams.logprobs` / `prompt_logprobs` (k in 0..20) ask, per token, for its logprob, its rank and
the k most likely (id, logprob). They are taken from the logits the sampler starts from: after the logit
controls (penalties, logit_bias, min_tokens: `raystate.worker.penalties`) and before temperature, top-k,
top-p and min_p, as `log_softmax` in fp32 (the model's distribution as the controls left it, not the
truncated one that was sampled from; vLLM's default "raw" logprobs, with our controls applied first).
Prompt positions have no controls (those depend on the output) and use the raw logits.

`compute_logprobs` takes logits [N, V] and each row's token (the sampled id, or the next prompt token)
and returns one int32 tensor [N, WIDTH]: one logsumexp, one gather, one compare-and-count for the rank
and one topk with k = MAX_LOGPROBS whatever the rows asked (all in one pass: `logprob_stats`), so the
shapes depend on N only and the function runs inside a captured CUDA graph. The int32 packing lets the result
travel back to the host in the same device -> host copy as the sampled ids (column ID_COL holds them):

    [rank | token id, top ids (MAX_LOGPROBS) | token logprob, top logprobs (MAX_LOGPROBS), fp32 bits]

A vocabulary smaller than MAX_LOGPROBS pads the top entries with id -1 and logprob -inf.
"""

from __future__ import annotations

import numpy as np
import torch

from raystate.kernels.logprob_stats import logprob_stats
from raystate.messages import MAX_LOGPROBS, pack_logprobs

K1 = MAX_LOGPROBS + 1  # the token itself and its top alternatives
RANK_COL = 0
ID_COL = 1  # the token's own id (the sampled id on decode rows)
LP_COL = 1 + K1
WIDTH = 1 + 2 * K1


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype), token_ids int [N] (a negative id, e.g. FAILED_ROW, is kept in the
    id column and its logprob read at id 0) -> int32 [N, WIDTH]. No host sync, fixed shapes.

    One pass over the logits (`raystate.kernels.logprob_stats`): a logprob is the logit less the row's
    logsumexp, in fp32, and the rank and the top ids are read off the logits themselves (the same order);
    the [N, V] log_softmax is never written."""
    n, v = logits.shape
    tok = token_ids.to(torch.int64)
    k = min(MAX_LOGPROBS, v)
    lse, tok_logit, rank, top_logits, top_ids = logprob_stats(logits, tok.clamp(0, v - 1), k)
    lse = lse.unsqueeze(1)  # fp32 [N, 1]
    top_lp = top_logits - lse  # sorted, largest first
    if k < MAX_LOGPROBS:
        top_lp = torch.cat([top_lp, top_lp.new_full((n, MAX_LOGPROBS - k), float("-inf"))], dim=1)
        top_ids = torch.cat([top_ids, top_ids.new_full((n, MAX_LOGPROBS - k), -1)], dim=1)
    ints = torch.cat([rank.unsqueeze(1), tok.unsqueeze(1), top_ids], dim=1).to(torch.int32)  # [N, 1 + K1]
    floats = torch.cat([tok_logit.unsqueeze(1) - lse, top_lp], dim=1).view(torch.int32)  # fp32 bits [N, K1]
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
