"""Paged KV store: token t's key/value go to slot slot_mapping[t]; negative slots are skipped.

Skipping PAD_SLOT_ID is what keeps prefix-cached KV bit-for-bit unchanged during SWA bounded replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import cdiv, next_pow2, use_triton


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


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, H_kv, D]
    value_ptr,  # [T, H_kv, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    slot_mapping_ptr,  # int64 [>= T]
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    k_cache_stride_block,
    k_cache_stride_slot,
    k_cache_stride_h,
    v_cache_stride_block,
    v_cache_stride_slot,
    v_cache_stride_h,
    num_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Program (t, i) stores heads [i * BLOCK_H, (i + 1) * BLOCK_H) of token t; the last dim is contiguous.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot (PAD_SLOT_ID) writes nothing; the slot is folded into the mask as a vector.
    keep = (tl.zeros([BLOCK_H], dtype=tl.int64) + slot) >= 0  # [BLOCK_H]
    mask = (keep & (heads < num_heads))[:, None] & (dims < head_dim)[None, :]  # [BLOCK_H, BLOCK_D]
    cache_block = slot // block_size
    cache_offset = slot % block_size

    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + cache_block * k_cache_stride_block + cache_offset * k_cache_stride_slot
    k_dst = k_dst + heads[:, None] * k_cache_stride_h + dims[None, :]
    tl.store(k_dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)

    value = tl.load(
        value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :], mask=mask
    )
    v_dst = v_cache_ptr + cache_block * v_cache_stride_block + cache_offset * v_cache_stride_slot
    v_dst = v_dst + heads[:, None] * v_cache_stride_h + dims[None, :]
    tl.store(v_dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(key):
        _write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def _write_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dim must be contiguous"
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 4096 // block_d))
    _write_kv_kernel[(num_tokens, cdiv(num_heads, block_h))](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        head_dim,
        k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
