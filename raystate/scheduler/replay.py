"""DESIGN section 3, steps 1-4, as one pure function: a prefix hit -> where the request starts computing.

Why replay: sliding-window layers are not prefix-cacheable (their KV for a prefix depends on nothing but
the last W tokens, and keeping it for every cached prefix would cost as much as full attention). So a hit
of h tokens restarts the window layers P = W tokens before h: the request computes from h - P, its
window layers rebuild their KV over those P tokens, and its full-attention layers keep the cached KV
(the worker pads their slots there, DESIGN section 4). A hit no longer than P saves nothing and is dropped.
"""

from __future__ import annotations

from typing import NamedTuple


class ReplayPlan(NamedTuple):
    num_computed: int  # tokens the request starts with (its first chunk starts here)
    replay_start: int  # window layers read nothing below it during prefill (0: no replay)
    num_shared_blocks: int  # leading blocks every cacheable group shares from the cache
    hit_tokens: int  # the hit h used (0 when none or dropped): reported as num_cached_tokens


NO_HIT = ReplayPlan(0, 0, 0, 0)


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Whole blocks a hit may cover: never the whole history, so at least one token is computed."""
    return (num_tokens - 1) // block_size


def plan_replay(num_hit_blocks: int, num_tokens: int, block_size: int, replay_tokens: int) -> ReplayPlan:
    """Admission of a request with num_computed == 0 and `num_hit_blocks` leading blocks found in every
    cacheable group's index (DESIGN 3 steps 1-4).

    1. h = whole hit blocks, capped below `num_tokens`.
    2. 0 < h <= P: the hit is dropped (no shared blocks; recomputed from 0).
    3. P > 0 and h > P: replay_start = num_computed = h - P; every hit block is shared.
    4. P == 0: num_computed = h, replay_start = 0; every hit block is shared.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens: must be >= 1, got {num_tokens}")
    blocks = max_hit_blocks(num_tokens, block_size)
    if num_hit_blocks < blocks:
        blocks = num_hit_blocks
    hit = blocks * block_size
    if hit <= 0 or hit <= replay_tokens:
        return NO_HIT
    # Positional: a NamedTuple built from keywords costs a kwargs dict per admission.
    if replay_tokens > 0:
        start = hit - replay_tokens
        return ReplayPlan(start, start, blocks, hit)  # num_computed, replay_start, num_shared_blocks, hit
    return ReplayPlan(hit, 0, blocks, hit)
