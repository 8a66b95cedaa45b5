"""Shard choice for a new request: the longest usable prefix hit, weighed against the shard's load.

The one place the rule lives: `route` is what the scheduler calls for every new request and for every
request of a dropped shard; `choose_shard` is its scoring. Rule: each candidate shard s scores

    score(s) = saved_tokens(s) - load_penalty * load(s)

where saved_tokens is the prefill work a hit there saves (the request's `num_computed` after DESIGN 3
steps 1-4 on that shard: a hit no longer than the replay window counts 0, a replayed hit counts h - P)
and load is the number of requests the shard holds (running + waiting). The highest score wins; ties go
to the lower load, then the lower shard index, so the choice is deterministic. With no hits anywhere
this is least-loaded routing; a hit of `load_penalty` tokens outweighs one extra queued request.

Routing happens once, when a request arrives; it then stays on its shard (preemption re-queues it
there, where its prefix is most likely still cached).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raystate.scheduler.request import Request
    from raystate.scheduler.shard_scheduler import ShardScheduler

# Tokens of saved prefill that one extra request on a shard is worth.
DEFAULT_LOAD_PENALTY = 128.0


def route(
    req: Request,
    shards: Sequence[ShardScheduler],
    live: Sequence[int],
    load_penalty: float = DEFAULT_LOAD_PENALTY,
) -> int:
    """The live shard `req` goes to (`shards` indexed by shard number; `live` the ones it may go to)."""
    if len(live) == 1:
        return live[0]
    saved = [shard.kv.plan(req).num_computed if s in live else 0 for s, shard in enumerate(shards)]
    loads = [len(shard.running) + len(shard.waiting) for shard in shards]
    return choose_shard(saved, loads, load_penalty, candidates=live)


def choose_shard(
    saved_tokens: Sequence[int],
    loads: Sequence[int],
    load_penalty: float = DEFAULT_LOAD_PENALTY,
    candidates: Sequence[int] | None = None,
) -> int:
    """The shard index to route to; `candidates` restricts the choice (default: every shard)."""
    if len(saved_tokens) != len(loads):
        raise ValueError(f"loads: one per shard, got {len(loads)} for {len(saved_tokens)} shards")
    shards = range(len(loads)) if candidates is None else candidates
    if not shards:
        raise ValueError("candidates: at least one shard is needed")
    return max(shards, key=lambda s: (saved_tokens[s] - load_penalty * loads[s], -loads[s], -s))
