"""KV cache allocation: one (key, value) pair of paged tensors per layer, shaped by the layer's group."""

from __future__ import annotations

import torch

from raystate.config import EngineConfig
from raystate.errors import InvalidRequest
from raystate.kv_layout import KVCacheGroupSpec, kv_block_bytes, plan_group_blocks

# The most blocks a group gets from the device's memory (16M tokens at block size 16). Real models stay
# far below it (an 8B model's 0.9 of an H200 is ~50k blocks of 16 tokens; Gemma-3-4B's, where only the
# 1-in-6 full layers keep a cached token, a few hundred thousand); a toy model would get tens of
# millions, and the scheduler keeps a few list entries per block (7.5 s to build 15.7M blocks for
# `tiny`). num_blocks / kv_cache_bytes go beyond it when asked.
MAX_AUTO_BLOCKS = 1 << 20


def auto_kv_budget(utilization: float, total_bytes: int, free_bytes: int, own_bytes: int) -> int:
    """KV cache bytes for a worker that sizes its cache from its device, measured once everything but the
    KV cache is allocated: `utilization` of the device's memory is this worker's; its weights and
    buffers (`own_bytes`, what torch holds for this process) take their part of that share and the KV
    cache the rest, which must be free. What stays above the share is for activations, CUDA graphs, the
    CUDA context and other processes (vLLM's flag of the same name measures the activations' peak
    inside the share instead). Only this process's memory counts, so shards that start together on a
    shared GPU do not see each other's half-loaded weights."""
    budget = int(utilization * total_bytes) - own_bytes
    if budget <= 0:
        raise InvalidRequest(
            "gpu_memory_utilization",
            f"above {own_bytes / total_bytes:.3f}: this worker's weights and buffers hold "
            f"{own_bytes / 2**30:.1f} GiB of the device's {total_bytes / 2**30:.1f} GiB before the KV cache; "
            "raise it, or size the cache with kv_cache_bytes / num_blocks",
            utilization,
        )
    if budget > free_bytes:
        raise InvalidRequest(
            "gpu_memory_utilization",
            f"at most {(own_bytes + free_bytes) / total_bytes:.3f}: the device has {free_bytes / 2**30:.1f} "
            f"GiB free once this worker's weights and buffers are loaded and the share asks "
            f"{budget / 2**30:.1f} GiB for the KV cache (other processes, or shards sharing the GPU, hold "
            "the rest); lower it, or size the cache with kv_cache_bytes / num_blocks",
            utilization,
        )
    return budget


def auto_group_blocks(
    config: EngineConfig,
    groups: tuple[KVCacheGroupSpec, ...],
    total_bytes: int,
    free_bytes: int,
    own_bytes: int,
) -> tuple[int, ...]:
    """Blocks per group from `auto_kv_budget`, split as a kv_cache_bytes budget is
    (`plan_group_blocks`), at most MAX_AUTO_BLOCKS each; an error naming gpu_memory_utilization when
    they would not fit two per group."""
    budget = auto_kv_budget(config.gpu_memory_utilization, total_bytes, free_bytes, own_bytes)
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
