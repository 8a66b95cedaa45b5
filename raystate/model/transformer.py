"""TinyHybrid: the reference hybrid model (sliding-window + full attention layers, engram memory).

The layer pattern comes from `config.layer_types`; each layer reads and writes the KV of its group
("sliding" or "full", the names of `raystate.kv_layout.kv_cache_group_specs`). Engram layers add their
n-gram memory to the residual stream before their attention. The forward pass is paged and chunked: it
sees only this step's tokens, with everything about earlier tokens in the KV caches and the lookback ids.
"""

from __future__ import annotations

import torch
from torch import nn

from raystate.config import ModelConfig
from raystate.kv_layout import KVCacheGroupSpec, kv_cache_group_specs
from raystate.model.attention import Attention, ForwardMetadata
from raystate.model.engram import Engram
from raystate.model.layers import RMSNorm, SwiGLU, TokenEmbedding, head_logits, logits_fp32, rotary_table


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = config.layer_types[layer_id]
        self.group_name = "sliding" if self.layer_type == "sliding" else "full"
        window = config.sliding_window if self.layer_type == "sliding" else 0
        self.engram = Engram(config, layer_id) if layer_id in config.engram_layer_ids else None
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.rope_theta,
            window,
        )
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output (the whole stream at layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before that output; None at layer 0
        input_ids: torch.Tensor,  # int [T]
        positions: torch.Tensor,  # int64 [T]
        lookback_token_ids: torch.Tensor,  # int32 [>= B, D]
        attn_metadata: ForwardMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: torch.Tensor,  # fp32 [max_positions, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the MLP's output, the stream before it), each [T, hidden]
        """The residual stream is hidden + residual: each add is deferred into the next norm, which does
        both in one launch. An engram layer needs the stream itself, so it adds first."""
        if self.engram is not None:
            stream = hidden if residual is None else hidden + residual
            hidden = self.engram(stream, input_ids, attn_metadata.query_start_loc, lookback_token_ids)
            residual = None
        if residual is None:
            residual = hidden
            normed = self.input_norm(hidden)
        else:
            normed, residual = self.input_norm.add_and_norm(hidden, residual)
        group = attn_metadata.groups[self.group_name]
        attn_out = self.attn(normed, positions, attn_metadata, group, kv_cache, cos_sin)
        normed, residual = self.post_attn_norm.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual

    def attn_input(self, stream: torch.Tensor) -> torch.Tensor:
        """What the attention projects (the dense oracle's path)."""
        return self.input_norm(stream)

    def after_attn(self, stream: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The stream after the attention block and the MLP block, plainly (the dense oracle's path)."""
        stream = stream + attn_out
        return stream + self.mlp(self.post_attn_norm(stream))


class TinyHybrid(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # fp32 cos/sin by position, built on first use on the model's device. Not a buffer: `.to(bf16)`
        # would round it.
        self._cos_sin: torch.Tensor | None = None

    def cos_sin(self, device: torch.device) -> torch.Tensor:  # fp32 [max_model_len, head_dim]
        table = self._cos_sin
        if table is None or table.device != device:
            cfg = self.config
            table = self._cos_sin = rotary_table(cfg.head_dim, cfg.rope_theta, cfg.max_model_len, device)
        return table

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # int [T] -> [T, hidden]
        return self.embed(input_ids)

    @property
    def token_lookback_depth(self) -> int:
        """D: how many ids before each chunk start the caller must put in `lookback_token_ids`."""
        return self.config.token_lookback_depth

    def kv_cache_group_specs(
        self, block_size: int, swa_bounded_replay: bool = True
    ) -> tuple[KVCacheGroupSpec, ...]:
        return kv_cache_group_specs(self.config, block_size, swa_bounded_replay)

    def reset_hash_buffers(self) -> None:
        """Rebuilds the engram hash constants (non-persistent buffers) on the current device."""
        for layer in self.layers:
            if layer.engram is not None:
                layer.engram.reset_hash_buffers()

    def forward(
        self,
        input_ids: torch.Tensor,  # int [T]
        positions: torch.Tensor,  # int64 [T]
        lookback_token_ids: torch.Tensor,  # int32 [>= B, D]
        attn_metadata: ForwardMetadata,
        kv_caches: list[
            tuple[torch.Tensor, torch.Tensor]
        ],  # per layer, each [num_blocks, block_size, H_kv, hd]
    ) -> torch.Tensor:  # [T, hidden], final norm applied
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches: one (k, v) pair per layer ({len(self.layers)}), got {len(kv_caches)}"
            )
        hidden = self.embed(input_ids)
        residual = None
        cos_sin = self.cos_sin(hidden.device)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(
                hidden, residual, input_ids, positions, lookback_token_ids, attn_metadata, kv_cache, cos_sin
            )
        return self.final_norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return logits_fp32(self.lm_head, hidden, out)  # [N, hidden] -> fp32 [N, vocab]

    def compute_head(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return head_logits(self.lm_head, hidden, out)  # [N, hidden] -> [N, vocab] in the weights' dtype
