"""KV cache allocation: one (key, value) pair of paged tensors per layer, shaped by the layer's group."""

from __future__ import annotations

import torch

from raystate.config import EngineConfig
from raystate.errors import InvalidRequest
from raystate.kv_layout import KVCacheGroupSpec, kv_block_bytes, plan_group_blocks


def auto_kv_budget(utilization: float, total_bytes: int, free_bytes: int) -> int:
    """KV cache bytes for a worker that sizes its cache from the device: `utilization` of the device's
    memory, less what the device already holds (this process's weights and buffers, its CUDA context and
    any other process's memory), measured after everything but the KV cache is allocated. What stays
    free above that share is for activations, CUDA graphs and the allocator's slack. vLLM's flag of the
    same name takes the activations' measured peak out of the share instead of leaving it outside."""
    in_use = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - in_use
    if budget <= 0:
        raise InvalidRequest(
            "gpu_memory_utilization",
            f"above {in_use / total_bytes:.3f}: the device already holds {in_use / 2**30:.1f} GiB of its "
            f"{total_bytes / 2**30:.1f} GiB before the KV cache (weights, buffers, other processes); raise "
            "it or size the cache with kv_cache_bytes / num_blocks",
            utilization,
        )
    return budget


# The most blocks a group gets from the device's memory (16M tokens at block size 16). Real models stay
# far below it (an 8B model's 0.9 of an H200 is ~50k blocks of 16 tokens; Gemma-3-4B's, where only the
# 1-in-6 full layers keep a cached token, a few hundred thousand); a toy model would get tens of
# millions, and the scheduler keeps a few list entries per block (7.5 s to build 15.7M blocks for
# `tiny`). num_blocks / kv_cache_bytes go beyond it when asked.
MAX_AUTO_BLOCKS = 1 << 20


def auto_group_blocks(
    config: EngineConfig, groups: tuple[KVCacheGroupSpec, ...], total_bytes: int, free_bytes: int
) -> tuple[int, ...]:
    """Blocks per group from `auto_kv_budget`, split as a kv_cache_bytes budget is
    (`plan_group_blocks`), at most MAX_AUTO_BLOCKS each; an error naming gpu_memory_utilization when
    they would not fit two per group."""
    budget = auto_kv_budget(config.gpu_memory_utilization, total_bytes, free_bytes)
    try:
        counts = plan_group_blocks(
            groups,
            budget,
            config.kv_element_bytes,
            config.cache.enable_prefix_caching,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
        )
    except InvalidRequest:
        need = 2 * sum(kv_block_bytes(g, config.kv_element_bytes) for g in groups)
        raise InvalidRequest(
            "gpu_memory_utilization",
            f"a share that leaves the KV cache two blocks per group ({need} bytes; it leaves {budget})",
            config.gpu_memory_utilization,
        ) from None
    return tuple(min(n, MAX_AUTO_BLOCKS) for n in counts)


def allocate_kv_caches(
    groups: tuple[KVCacheGroupSpec, ...],
    num_layers: int,
    num_blocks: tuple[int, ...],  # per group
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: k and v, each [num_blocks of its group, block_size, H_kv, head_dim]; block 0 is null.

    On CUDA a cache larger than the device's free memory is refused before anything is allocated, with an
    error naming the knobs that size it (an out-of-memory inside Ray's actor start would only say that the
    deployment failed)."""
    if device.type == "cuda":
        need = kv_cache_bytes(groups, num_blocks, dtype)
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            raise InvalidRequest(
                "kv_cache_bytes",
                f"<= {free} ({free / 2**30:.1f} GiB free on {device} after the weights); set "
                "kv_cache_bytes (--kv-cache-gib) or num_blocks, or a smaller max_model_len (unset, the "
                "cache holds min(max_num_seqs, 16) requests of max_model_len tokens)",
                need,
            )
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
    for g, n in zip(groups, num_blocks, strict=True):
        shape = (n, g.block_size, g.num_kv_heads, g.head_dim)
        for layer in g.layer_ids:
            caches[layer] = (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
    missing = [i for i, c in enumerate(caches) if c is None]
    if missing:
        raise ValueError(f"kv cache groups: layers {missing} belong to no group")
    return caches  # type: ignore[return-value]


def kv_cache_bytes(
    groups: tuple[KVCacheGroupSpec, ...], num_blocks: tuple[int, ...], dtype: torch.dtype
) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    return sum(kv_block_bytes(g, elt) * n for g, n in zip(groups, num_blocks, strict=True))
