"""Rotary embedding of q and k straight from the fused qkv projection, and the paged KV store, in one launch.

Per token: rotate each query head (written to a contiguous q), rotate each key head and store it with the
value at the token's slot in the paged caches (negative slot: no store, which keeps prefix-cached KV
bit-for-bit unchanged during SWA bounded replay). The cos/sin of each position come from a table built
once by the model with the same fp32 formula as `raystate.model.layers.apply_rotary`, so kernel and
reference rotate by bitwise the same angles.
Replaces about twenty torch launches per layer (split, angles, cos, sin, two rotations, cat, casts, store).
Families with a per-head RMSNorm of q and k before the rotation (Qwen3, Gemma 3) run it here too, rounded
to the projection's dtype before rotating as the separate norm's output would be: two launches fewer a
layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raystate.kernels._common import next_pow2, use_triton
from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl
from raystate.kernels.norm import rms_norm_heads_ref


def _rotate_ref(
    x: torch.Tensor,  # [T, H, D]
    cos: torch.Tensor,  # fp32 [T, D/2]
    sin: torch.Tensor,  # fp32 [T, D/2]
) -> torch.Tensor:
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def write_kv_ref(
    key: torch.Tensor,  # [T, H_kv, D]
    value: torch.Tensor,  # [T, H_kv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    slot_mapping: torch.Tensor,  # int64 [>= T]
) -> None:
    """The paged KV store: token t's key and value go to slot slot_mapping[t]; negative slots are skipped."""
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots[keep]] = key[keep].to(k_cache.dtype)
    flat_v[slots[keep]] = value[keep].to(v_cache.dtype)


def rope_write_kv_ref(
    qkv: torch.Tensor,  # [T, (H + 2 H_kv) * D]: q heads, then k heads, then v heads
    positions: torch.Tensor,  # int64 [T]
    cos_sin: torch.Tensor,  # fp32 [max_pos, D]: cos in the first half, sin in the second
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [>= T]
    # (q gain [D], k gain [D], eps, weight offset): each q and k head RMSNormed before the rotation
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> torch.Tensor:  # q [T, H, D], rotated
    num_tokens = qkv.shape[0]
    head_dim = cos_sin.shape[1]
    half = head_dim // 2
    if qk_norm is not None:
        q_w, k_w, eps, offset = qk_norm
        qkv = rms_norm_heads_ref(qkv.clone(), q_w, eps, offset, 0, head_dim, num_heads)
        qkv = rms_norm_heads_ref(qkv, k_w, eps, offset, num_heads * head_dim, head_dim, num_kv_heads)
    q, k, v = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1
    )
    table = cos_sin[positions]  # fp32 [T, D]
    cos, sin = table[:, :half], table[:, half:]
    k = _rotate_ref(k, cos, sin)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return _rotate_ref(q, cos, sin)


@triton.jit
def _rotate_heads(
    src,
    dst,
    cos,
    sin,
    heads,
    dims,
    half,
    num_heads,
    src_head_stride,
    dst_head_stride,
    norm,
    NORM: tl.constexpr,
):
    """Rotates heads [H_BLOCK] x half-dims [HALF_BLOCK] from src to dst (both at the token's base); with
    NORM, RMSNorms each head first, norm = (gain_ptr [2 * half], eps, weight_offset)."""
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    lo = heads[:, None] * src_head_stride + dims[None, :]
    x1 = tl.load(src + lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + lo + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        gain_ptr, eps, weight_offset = norm
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)  # [H]
        d_valid = dims < half
        g1 = tl.load(gain_ptr + dims, mask=d_valid, other=0.0).to(tl.float32) + weight_offset
        g2 = tl.load(gain_ptr + half + dims, mask=d_valid, other=0.0).to(tl.float32) + weight_offset
        # Rounded to the projection's dtype, as the unfused norm stores it, then rotated in fp32.
        x1 = (x1 * inv_rms[:, None] * g1[None, :]).to(src.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv_rms[:, None] * g2[None, :]).to(src.dtype.element_ty).to(tl.float32)
    out_lo = heads[:, None] * dst_head_stride + dims[None, :]
    c = cos[None, :]
    s = sin[None, :]
    tl.store(dst + out_lo, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + out_lo + half, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr,  # [T, (H + 2 H_kv) * D]
    positions_ptr,  # int64 [T]
    cos_sin_ptr,  # fp32 [max_pos, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, H_kv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # int64 [>= T]
    q_gain_ptr,  # [D]: q's per-head RMSNorm gain (unused without QK_NORM)
    k_gain_ptr,  # [D]
    norm_eps,
    norm_weight_offset,
    qkv_stride,
    k_cache_stride_block,
    k_cache_stride_slot,
    k_cache_stride_h,
    v_cache_stride_block,
    v_cache_stride_slot,
    v_cache_stride_h,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    QK_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched as a programmatic dependent (raystate.kernels._pdl)
):
    # Two programs per token: queries (part 0), keys and values (part 1), each half the work of one
    # program doing both, so the launch (a few us at decode sizes) finishes sooner.
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    half = head_dim // 2
    dims = tl.arange(0, BLOCK_HALF)
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + pos * head_dim + dims, mask=dims < half, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * head_dim + half + dims, mask=dims < half, other=0.0)
    src = qkv_ptr + token * qkv_stride
    if part == 0:
        # Queries: rotated into q[token].
        q_heads = tl.arange(0, BLOCK_H)
        _rotate_heads(
            src,
            q_ptr + token * num_heads * head_dim,
            cos,
            sin,
            q_heads,
            dims,
            half,
            num_heads,
            head_dim,
            head_dim,
            (q_gain_ptr, norm_eps, norm_weight_offset),
            QK_NORM,
        )
    else:
        # Keys (rotated) and values (copied) to the token's cache slot, unless the slot is negative.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        kv_heads = tl.arange(0, BLOCK_KV)
        # A negative slot turns the head count to 0, so every store is masked off (a vector mask, which
        # the interpreter accepts, rather than a scalar branch).
        live_kv_heads = tl.where(slot >= 0, num_kv_heads, 0)
        blk = tl.maximum(slot, 0) // block_size
        off = tl.maximum(slot, 0) % block_size
        full = tl.arange(0, 2 * BLOCK_HALF)
        v_mask = (kv_heads < live_kv_heads)[:, None] & (full < head_dim)[None, :]
        # V is loaded before the keys are stored: a load after a store would wait for it.
        v = tl.load(
            src + (num_heads + num_kv_heads) * head_dim + kv_heads[:, None] * head_dim + full[None, :],
            mask=v_mask,
            other=0.0,
        )
        k_dst = k_cache_ptr + blk * k_cache_stride_block + off * k_cache_stride_slot
        _rotate_heads(
            src + num_heads * head_dim,
            k_dst,
            cos,
            sin,
            kv_heads,
            dims,
            half,
            live_kv_heads,
            head_dim,
            k_cache_stride_h,
            (k_gain_ptr, norm_eps, norm_weight_offset),
            QK_NORM,
        )
        v_dst = v_cache_ptr + blk * v_cache_stride_block + off * v_cache_stride_slot
        tl.store(
            v_dst + kv_heads[:, None] * v_cache_stride_h + full[None, :],
            v.to(v_cache_ptr.dtype.element_ty),
            mask=v_mask,
        )


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, float] | None = None,
) -> torch.Tensor:
    """Rotated q [T, H, D]; rotated k and v stored at their slots in the caches. One launch, no sync.
    With qk_norm = (q gain [D], k gain [D], eps, weight offset), each q and k head is RMSNormed first."""
    if not use_triton(qkv):
        return rope_write_kv_ref(
            qkv, positions, cos_sin, num_heads, num_kv_heads, k_cache, v_cache, slot_mapping, qk_norm
        )
    num_tokens = qkv.shape[0]
    head_dim = cos_sin.shape[1]
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    assert qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert head_dim % 2 == 0 and cos_sin.is_contiguous()
    pdl = use_pdl(qkv)
    _rope_write_kv_kernel[(num_tokens, 2)](
        qkv,
        positions,
        cos_sin,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        qk_norm[0] if qk_norm is not None else qkv,
        qk_norm[1] if qk_norm is not None else qkv,
        qk_norm[2] if qk_norm is not None else 0.0,
        qk_norm[3] if qk_norm is not None else 0.0,
        qkv.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        QK_NORM=qk_norm is not None,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_KV=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(head_dim // 2),
        USE_PDL=pdl,
        **launch_options(pdl),
    )
    return q
