"""n choices of one prompt as n engine requests.

The engine schedules requests of one choice each. A front end (LLM, the OpenAI server) turns a request
for n > 1 choices into n requests with the same prompt: the first computes the prompt, each later one
names it in `fork_of` and is forked from it when its last prompt chunk is scheduled, sharing the prompt's
KV blocks up to the block holding the last prompt token (`raystate.scheduler.kv_manager.KVManager.fork`).
The n requests must be submitted together (one `add` batch) for the fork to find the first one still
computing its prompt; otherwise the later ones fall back to the prefix cache.

Each child's seed, when the request has one, is the request's seed plus the child's index (modulo 2^63),
so the n choices differ and each one is reproducible on its own.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from raystate.errors import InvalidRequest
from raystate.messages import MAX_INT64, MAX_N, SamplingParams


class ChildRequest(NamedTuple):
    """One choice's engine request: its id, prompt, sampling (n = 1) and the sibling it forks from."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    fork_of: str | None
    index: int  # the choice's index in the response


def child_id(request_id: str, index: int, n: int) -> str:
    """The engine request id of choice `index` of a request of `n` choices (the id itself when n = 1)."""
    return request_id if n == 1 else f"{request_id}-{index}"


def child_requests(
    request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
) -> list[ChildRequest]:
    """The n engine requests of one request (n = sampling.n; one request, unchanged, when n = 1)."""
    n = sampling.n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequest("n", f"an integer in [1, {MAX_N}]", n)
    if n == 1:
        return [ChildRequest(request_id, prompt_token_ids, sampling, None, 0)]
    first = child_id(request_id, 0, n)
    out = []
    for i in range(n):
        seed = None if sampling.seed is None else (sampling.seed + i) & MAX_INT64
        child = msgspec.structs.replace(sampling, n=1, seed=seed)
        out.append(ChildRequest(child_id(request_id, i, n), prompt_token_ids, child, first if i else None, i))
    return out
