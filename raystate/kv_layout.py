"""The KV cache's layout and sizing: which layers share a block table, what one block costs, and how many
blocks each group gets per shard.

Its own module because three layers read it and none owns it: the scheduler sizes its block pools and
plans replays from it, the worker allocates the device tensors from it, and the benchmarks size budgets
with it. Standard library only (no torch), so the scheduler can import it; the model config is read, never
imported at run time, so `raystate.config` can build on this module without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raystate.errors import InvalidRequest

if TYPE_CHECKING:
    from raystate.config import CacheConfig, ModelConfig, SchedulerConfig


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """A set of layers sharing one KV layout and one block table (DESIGN words: a group)."""

    name: str
    layer_ids: tuple[int, ...]
    sliding_window: int  # 0 for full attention
    block_size: int
    num_kv_heads: int
    head_dim: int
    prefix_cacheable: bool
    prefix_replay_tokens: int

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window > 0


def kv_cache_group_specs(
    model: ModelConfig, block_size: int, swa_bounded_replay: bool = True
) -> tuple[KVCacheGroupSpec, ...]:
    """Full-attention layers form one group, sliding-window layers another (DESIGN section 3).

    With bounded replay on, the window group is not prefix-cacheable and declares W replay tokens; with
    it off, it is cached like the full group ("cache everything").
    """
    groups = []
    full = tuple(i for i, t in enumerate(model.layer_types) if t == "full")
    sliding = tuple(i for i, t in enumerate(model.layer_types) if t == "sliding")
    common = dict(block_size=block_size, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim)
    if full:
        groups.append(
            KVCacheGroupSpec("full", full, 0, prefix_cacheable=True, prefix_replay_tokens=0, **common)
        )
    if sliding:
        groups.append(
            KVCacheGroupSpec(
                "sliding",
                sliding,
                model.sliding_window,
                prefix_cacheable=not swa_bounded_replay,
                prefix_replay_tokens=model.sliding_window if swa_bounded_replay else 0,
                **common,
            )
        )
    return tuple(groups)


def replay_tokens(groups: tuple[KVCacheGroupSpec, ...]) -> int:
    """P: the one nonzero `prefix_replay_tokens` of the groups (they must agree), 0 when none sets one."""
    values = {g.prefix_replay_tokens for g in groups if g.prefix_replay_tokens}
    if len(values) > 1:
        raise InvalidRequest("prefix_replay_tokens", "the same for every group that sets one", sorted(values))
    return values.pop() if values else 0


def kv_element_bytes(dtype: str, device: str) -> int:
    """Bytes of one KV element: 2 for bf16/fp16 (what "auto" gives on CUDA), 4 for fp32."""
    if dtype in ("bfloat16", "float16") or (dtype == "auto" and device != "cpu"):
        return 2
    return 4


def kv_block_bytes(group: KVCacheGroupSpec, element_bytes: int) -> int:
    """Bytes of one block of a group: keys and values of every layer of the group."""
    return 2 * len(group.layer_ids) * group.block_size * group.num_kv_heads * group.head_dim * element_bytes


def group_num_blocks(
    groups: tuple[KVCacheGroupSpec, ...],
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    max_model_len: int,
    element_bytes: int,
) -> tuple[int, ...]:
    """Blocks per shard of each group, in `groups` order (block 0 of each is the null block).

    `cache.group_blocks` (what start-up sizing resolved) is taken as is; `cache.num_blocks` gives every
    group that many; `cache.kv_cache_bytes` splits a byte budget
    (`plan_group_blocks`); neither: room for min(max_num_seqs, 16) requests of max_model_len tokens in
    every group, so an unsized engine stays small on the CPU.
    """
    if cache.group_blocks is not None:
        return cache.group_blocks
    if cache.num_blocks is not None:
        return (cache.num_blocks,) * len(groups)
    if cache.kv_cache_bytes is not None:
        return plan_group_blocks(
            groups,
            cache.kv_cache_bytes,
            element_bytes,
            cache.enable_prefix_caching,
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
        )
    per_req = -(-max_model_len // cache.block_size)
    return (1 + min(scheduler.max_num_seqs, 16) * per_req,) * len(groups)


def plan_group_blocks(
    groups: tuple[KVCacheGroupSpec, ...],
    budget_bytes: int,
    element_bytes: int,
    enable_prefix_caching: bool,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[int, ...]:
    """Splits a KV byte budget into per-group block counts.

    A window group that is not prefix-cached (sliding attention under bounded replay, or any sliding
    group with caching off) only ever holds each running request's window plus its chunk: at most
    max_num_seqs * (W / block_size + 2) blocks plus the step's tokens in blocks. It gets that and no more;
    every other group gets the same number of blocks from the rest. So under bounded replay the budget
    goes to the full-attention KV that the prefix cache keeps, and the same bytes hold W-window models'
    cached prefixes several times over (4x for `bench`: 6 of its 24 layers are full attention). When the
    window groups' need would leave the others fewer blocks than they get, all groups get an equal share.
    """
    per_block = [kv_block_bytes(g, element_bytes) for g in groups]
    window = [
        i for i, g in enumerate(groups) if g.is_sliding and not (enable_prefix_caching and g.prefix_cacheable)
    ]
    others = [i for i in range(len(groups)) if i not in window]
    equal = budget_bytes // sum(per_block)
    counts = [equal] * len(groups)
    if window and others:
        need = {
            i: 1
            + max_num_seqs * (-(-groups[i].sliding_window // groups[i].block_size) + 2)
            + -(-max_num_batched_tokens // groups[i].block_size)
            for i in window
        }
        rest = budget_bytes - sum(need[i] * per_block[i] for i in window)
        shared = rest // sum(per_block[i] for i in others) if rest > 0 else 0
        if shared > max(need.values()):
            counts = [need.get(i, shared) for i in range(len(groups))]
    if min(counts) < 2:
        raise InvalidRequest(
            "kv_cache_bytes",
            f"at least {2 * sum(per_block)} (two blocks per group, one being the null block)",
            budget_bytes,
        )
    return tuple(counts)


def kv_summary(groups: tuple[KVCacheGroupSpec, ...], num_blocks: tuple[int, ...], element_bytes: int) -> str:
    """The KV cache in words, for the CLI and the logs: each group's layers, blocks and bytes, and what a
    cached prefix keeps. Under bounded replay only the full-attention groups are cached, so a cached
    prefix token keeps their share of the KV that caching every layer would keep: 1/4 for a 3:1 model,
    about 1/6 for Gemma 3's 5:1."""
    num_layers = sum(len(g.layer_ids) for g in groups)
    parts = []
    total = 0
    for g, n in zip(groups, num_blocks, strict=True):
        size = kv_block_bytes(g, element_bytes) * n
        total += size
        kind = f" (window {g.sliding_window})" if g.is_sliding else ""
        cached = (
            "prefix-cached"
            if g.prefix_cacheable
            else f"not cached, replays {g.prefix_replay_tokens} tokens after a hit"
        )
        parts.append(
            f"{g.name}{kind}: {len(g.layer_ids)} layers, {n} blocks, {size / 2**30:.2f} GiB, {cached}"
        )
    cached_layers = sum(len(g.layer_ids) for g in groups if g.prefix_cacheable)
    if cached_layers and cached_layers < num_layers:
        share = (
            f"; a cached prefix keeps {cached_layers}/{num_layers} of the KV caching every layer would keep"
        )
    elif not cached_layers:
        share = "; nothing is prefix-cacheable (every layer slides)"
    else:
        share = ""
    return f"KV cache {total / 2**30:.2f} GiB per shard: " + "; ".join(parts) + share
