"""Attention metadata and the paged attention layer (full or sliding-window, grouped-query heads).

Metadata is an argument of every call, never global state: the worker builds one `ForwardMetadata` per
step and the model hands each layer its group's `GroupMetadata` (by `KVCacheGroupSpec.name`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raystate.kernels import paged_attention
from raystate.kernels.rotary import rope_write_kv
from raystate.model.layers import apply_rotary


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

    `project_qkv` is split out so the dense oracle (`raystate.model.reference`) runs the very same
    projection and rotation (in plain torch) and differs only in how keys are stored and read.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float,
        sliding_window: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.sliding_window = sliding_window  # 0 = full attention
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def project_qkv(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # int64 [T]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q [T, H, head_dim], k and v [T, H_kv, head_dim]; q and k rotated."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return apply_rotary(q, positions, self.rope_theta), apply_rotary(k, positions, self.rope_theta), v

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # int64 [T]
        attn_metadata: ForwardMetadata,
        group: GroupMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, H_kv, head_dim]
        cos_sin: torch.Tensor,  # fp32 [max_positions, head_dim]: `rotary_table` of this layer's theta
    ) -> torch.Tensor:  # [T, hidden]
        if group.sliding_window != self.sliding_window:
            raise ValueError(
                f"sliding_window: the layer has {self.sliding_window}, "
                f"its group metadata {group.sliding_window}"
            )
        k_cache, v_cache = kv_cache
        q = rope_write_kv(
            self.qkv_proj(hidden),
            positions,
            cos_sin,
            self.num_heads,
            self.num_kv_heads,
            k_cache,
            v_cache,
            group.slot_mapping,
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
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))
