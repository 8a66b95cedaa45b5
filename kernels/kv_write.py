"""Paged KV store: token t's key/value go to slot slot_mapping[t]; negative slots are skipped.

Skipping PAD_SLOT_ID is what keeps prefix-cached KV bit-for-bit unchanged during SWA bounded replay.
"""

from __future__ import annotations

import torch

from raystate.kernels._common import use_triton


def write_kv_ref(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    slot_mapping: torch.Tensor,  # int64 [>= T]
) -> None:
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots[keep]] = key[keep].to(k_cache.dtype)
    flat_v[slots[keep]] = value[keep].to(v_cache.dtype)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(key):
        _write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def _write_kv_triton(*args) -> None:
    raise NotImplementedError("Triton write_kv: being written")
