"""Engram lookback gather (SPEC section 1).

For batch row b < num_reqs with state slot s = idx_mapping[b] and chunk start c = num_computed_tokens[s]:
lookback[b, k] = all_token_ids[s, c - 1 - k] for k = 0..D-1 (newest first), -1 where c - 1 - k < 0.
Rows b >= num_reqs are set to -1. The ids come from the request's token history on the device, never from
KV, so they are exact after chunked prefill, prefix hits, preemption and migration.
"""

from __future__ import annotations

import torch

from raystate.kernels._common import use_triton


def gather_lookback_ref(
    lookback: torch.Tensor,  # int32 [R, D], written in place
    idx_mapping: torch.Tensor,  # int32/int64 [>= num_reqs]: batch row -> state slot
    num_computed_tokens: torch.Tensor,  # int32 [S]
    all_token_ids: torch.Tensor,  # int32 [S, L] (row stride may exceed L)
    num_reqs: int,
) -> None:
    lookback.fill_(-1)
    if num_reqs == 0:
        return
    depth = lookback.shape[1]
    slots = idx_mapping[:num_reqs].long()
    starts = num_computed_tokens[slots].long()  # [num_reqs]
    k = torch.arange(depth, device=lookback.device)
    pos = starts[:, None] - 1 - k[None, :]  # [num_reqs, D]
    ids = all_token_ids[slots[:, None], pos.clamp(min=0)]
    lookback[:num_reqs] = torch.where(pos >= 0, ids, torch.full_like(ids, -1)).to(lookback.dtype)


def gather_lookback(
    lookback: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    all_token_ids: torch.Tensor,
    num_reqs: int,
) -> None:
    """One launch, no host sync: fills all R rows of `lookback` in place."""
    if use_triton(lookback):
        _gather_lookback_triton(lookback, idx_mapping, num_computed_tokens, all_token_ids, num_reqs)
    else:
        gather_lookback_ref(lookback, idx_mapping, num_computed_tokens, all_token_ids, num_reqs)


def _gather_lookback_triton(lookback, idx_mapping, num_computed_tokens, all_token_ids, num_reqs) -> None:
    raise NotImplementedError("Triton gather_lookback: being written")
