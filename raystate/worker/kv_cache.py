"""KV cache allocation: one (key, value) pair of paged tensors per layer, shaped by the layer's group."""

from __future__ import annotations

import torch

from raystate.errors import InvalidRequest
from raystate.kv_layout import KVCacheGroupSpec, kv_block_bytes


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
