"""Attention metadata and the paged attention layer (full or sliding-window, grouped-query heads).

Metadata is an argument of every call, never global state: the worker builds one `ForwardMetadata` per
step and the model hands each layer its group's `GroupMetadata` (by `KVCacheGroupSpec.name`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raystate.config import RopeConfig
from raystate.kernels import paged_attention
from raystate.kernels.norm import rms_norm_heads_
from raystate.kernels.rotary import rope_write_kv
from raystate.kernels.split_k import PartialSums
from raystate.model.layers import RMSNorm, apply_rotary, project


@dataclass
class GroupMetadata:
    """One KV cache group's view of the step: where its layers read and write KV."""

    block_table: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]; negative: this token's KV is not written (replayed, cached)
    sliding_window: int  # 0 = full attention
    kv_floor: torch.Tensor | None = None  # int32 [B]: the replay starts; sliding groups only


@dataclass
class ForwardMetadata:
    """The batch layout shared by every group: row b's query tokens are the last q_len of seq_lens[b]."""

    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    groups: dict[str, GroupMetadata]  # by KVCacheGroupSpec.name ("full", "sliding")
    max_query_len: int | None = None


class Attention(nn.Module):
    """One q/k/v projection, RoPE at absolute positions fused with the paged KV store, one paged attention
    launch, the output projection.

    The families differ in small ways, all set here: biases on q/k/v (Qwen2) and on the output, RMSNorm
    of q and k before the rotation, per head (Qwen3, Gemma 3) or over the whole projection (OLMo 3), and
    the softmax scale (Gemma 3's query_pre_attn_scalar). `project_qkv` is split out so the dense oracle
    (`raystate.model.reference`) runs the very same projection, norms and rotation (in plain torch) and
    differs only in how keys are stored and read.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RopeConfig | float,
        sliding_window: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: str = "none",
        norm_eps: float = 1e-6,
        norm_weight_offset: float = 0.0,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope = rope if isinstance(rope, RopeConfig) else RopeConfig(theta=rope)
        self.sliding_window = sliding_window  # 0 = full attention
        self.scale = head_dim**-0.5 if scale is None else scale
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm != "none":
            q_dim, k_dim = (
                (head_dim, head_dim) if qk_norm == "head" else (num_heads * head_dim, num_kv_heads * head_dim)
            )
            self.q_norm = RMSNorm(q_dim, norm_eps, norm_weight_offset)
            self.k_norm = RMSNorm(k_dim, norm_eps, norm_weight_offset)

    def _qkv(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, (H + 2 H_kv) * head_dim]
        """The projection, with q and k normalised in place when the family norms them (before any
        rotation): one launch each."""
        qkv = self.qkv_proj(hidden)
        if self.qk_norm == "none":
            return qkv
        hd, heads, kv_heads = self.head_dim, self.num_heads, self.num_kv_heads
        q_w, k_w = self.q_norm.weight, self.k_norm.weight
        eps, offset = self.q_norm.eps, self.q_norm.weight_offset
        if self.qk_norm == "head":
            rms_norm_heads_(qkv, q_w, eps, offset, 0, hd, heads)
            rms_norm_heads_(qkv, k_w, eps, offset, heads * hd, hd, kv_heads)
        else:
            rms_norm_heads_(qkv, q_w, eps, offset, 0, heads * hd, 1)
            rms_norm_heads_(qkv, k_w, eps, offset, heads * hd, kv_heads * hd, 1)
        return qkv

    def project_qkv(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # int64 [T]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q [T, H, head_dim], k and v [T, H_kv, head_dim]; q and k rotated."""
        num_tokens = hidden.shape[0]
        qkv = self._qkv(hidden).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return apply_rotary(q, positions, self.rope), apply_rotary(k, positions, self.rope), v

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # int64 [T]
        attn_metadata: ForwardMetadata,
        group: GroupMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, H_kv, head_dim]
        cos_sin: torch.Tensor,  # fp32 [max_positions, head_dim]: `rotary_table` of this layer's rope
    ) -> torch.Tensor | PartialSums:  # [T, hidden]: the output projection's, for an RMSNorm to read
        if group.sliding_window != self.sliding_window:
            raise ValueError(
                f"sliding_window: the layer has {self.sliding_window}, "
                f"its group metadata {group.sliding_window}"
            )
        k_cache, v_cache = kv_cache
        if self.qk_norm == "head":  # the per-head norms run in the rotation's launch
            qkv = self.qkv_proj(hidden)
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.weight_offset)
        else:
            qkv, qk_norm = self._qkv(hidden), None
        q = rope_write_kv(
            qkv,
            positions,
            cos_sin,
            self.num_heads,
            self.num_kv_heads,
            k_cache,
            v_cache,
            group.slot_mapping,
            qk_norm,
        )  # [T, H, head_dim]
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            group.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            sliding_window=group.sliding_window,
            kv_floor=group.kv_floor,
            max_query_len=attn_metadata.max_query_len,  # picks the tile: decode-shaped when it is 1
        )  # [T, H, head_dim]
        return project(self.o_proj, out.reshape(hidden.shape[0], self.num_heads * self.head_dim))
