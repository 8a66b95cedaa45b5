"""DecoderLM: our paged forward of the dense decoder-only Hugging Face families (Llama, Qwen2, Qwen3,
Mistral, Ministral, Gemma 3 text, OLMo 3), built from a `ModelConfig` that `raystate.hf.model_config` made
from the checkpoint's config.json.

The same worker, KV groups, kernels and bounded replay as `TinyHybrid`, without engram (lookback depth 0).
What differs between the families is a handful of switches, all in the config: where the norms sit
(`norm_layout`), Gemma's (1 + w) gains and scaled embeddings, q/k norms, biases, the MLP gate, the
softmax scale, tied embeddings, and one rope per layer type (Gemma 3 and OLMo 3 rotate sliding and full
layers differently). Parameter names follow ours (fused qkv_proj and gate_up_proj);
`raystate.model.hf_weights` maps the checkpoint's names onto them.
"""

from __future__ import annotations

import torch
from torch import nn

from raystate.config import ModelConfig
from raystate.kernels.activation import act_and_mul
from raystate.kernels.split_k import PartialSums
from raystate.kv_layout import KVCacheGroupSpec, kv_cache_group_specs
from raystate.model.attention import Attention, ForwardMetadata
from raystate.model.layers import RMSNorm, TokenEmbedding, head_logits, logits_fp32, project, rotary_table


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one projection; act is SiLU or GELU-tanh."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))

    def forward_into_norm(self, x: torch.Tensor) -> torch.Tensor | PartialSums:  # [T, hidden]
        """forward(x) for a caller that hands the result straight to an RMSNorm: the down projection may
        come as split-K partial sums (`project`)."""
        return project(self.down_proj, act_and_mul(self.gate_up_proj(x), self.act))


class DecoderLMLayer(nn.Module):
    """One layer; its norms as the family places them.

    - "pre" (Llama, Qwen, Mistral): x + attn(norm(x)), then + mlp(norm(.)).
    - "sandwich" (Gemma 3): x + norm(attn(norm(x))), then + norm(mlp(norm(.))).
    - "post" (OLMo 3): x + norm(attn(x)), then + norm(mlp(.)).
    The paged forward carries the stream as (sublayer output, stream before it) so that the add folds into
    the next norm's launch where one follows; `attn_input` and `after_attn` are the same layer written
    plainly. In the sandwich layout the norm of a sublayer's output rides in that launch too: the MLP's
    output leaves the layer un-normed, and its norm (`output_norm`) runs in the next layer's input norm
    (or the final norm), so a layer launches two norms, not four.
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        cfg = config
        self.layer_id = layer_id
        self.layer_type = cfg.layer_types[layer_id]
        self.group_name = "sliding" if self.layer_type == "sliding" else "full"
        self.layout = cfg.norm_layout
        eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
        self.attn = Attention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rope_for(self.layer_type),
            cfg.sliding_window if self.layer_type == "sliding" else 0,
            qkv_bias=cfg.attention_bias,
            o_bias=cfg.o_proj_bias,
            qk_norm=cfg.qk_norm,
            norm_eps=eps,
            norm_weight_offset=offset,
            scale=cfg.attention_scale,
        )
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        if self.layout in ("pre", "sandwich"):
            self.input_norm = RMSNorm(cfg.hidden_size, eps, offset)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps, offset)  # "pre": the norm before the MLP
        if self.layout == "sandwich":
            self.pre_mlp_norm = RMSNorm(cfg.hidden_size, eps, offset)
        if self.layout in ("sandwich", "post"):
            self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps, offset)
        # The norm the next launch applies to this layer's returned output before adding it to the stream.
        self.output_norm = self.post_mlp_norm if self.layout == "sandwich" else None

    def forward(
        self,
        hidden: torch.Tensor | PartialSums,  # [T, hidden]: the last sublayer's output (the stream at layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before that output; None at layer 0
        positions: torch.Tensor,  # int64 [T]
        attn_metadata: ForwardMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: torch.Tensor,  # fp32 [max_positions, head_dim]: this layer type's rope table
        hidden_norm: RMSNorm | None = None,  # the previous layer's `output_norm`, not yet applied to hidden
    ) -> tuple[torch.Tensor | PartialSums, torch.Tensor]:  # (the MLP block's output, the stream before it)
        group = attn_metadata.groups[self.group_name]
        if self.layout == "post":
            stream = hidden if residual is None else hidden + residual
            attn_out = self.attn(stream, positions, attn_metadata, group, kv_cache, cos_sin)
            stream = stream + self.post_attn_norm(attn_out)
            return self.post_mlp_norm(self.mlp.forward_into_norm(stream)), stream
        if residual is None:
            residual = hidden
            normed = self.input_norm(hidden)
        else:
            normed, residual = self.input_norm.add_and_norm(hidden, residual, hidden_norm)
        attn_out = self.attn(normed, positions, attn_metadata, group, kv_cache, cos_sin)
        if self.layout == "pre":
            normed, residual = self.post_attn_norm.add_and_norm(attn_out, residual)
            return self.mlp.forward_into_norm(normed), residual
        normed, residual = self.pre_mlp_norm.add_and_norm(attn_out, residual, self.post_attn_norm)
        return self.mlp.forward_into_norm(normed), residual  # un-normed: `output_norm` runs next

    def attn_input(self, stream: torch.Tensor) -> torch.Tensor:
        """What the attention projects: the normed stream, or the stream itself ("post")."""
        return stream if self.layout == "post" else self.input_norm(stream)

    def after_attn(self, stream: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The stream after the attention block and the MLP block, plainly (the dense oracle's path)."""
        if self.layout == "pre":
            stream = stream + attn_out
            return stream + self.mlp(self.post_attn_norm(stream))
        stream = stream + self.post_attn_norm(attn_out)
        mlp_in = self.pre_mlp_norm(stream) if self.layout == "sandwich" else stream
        return stream + self.post_mlp_norm(self.mlp(mlp_in))


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = TokenEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLMLayer(config, i) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # fp32 cos/sin tables by layer type, built on first use on the model's device. Not buffers:
        # `.to(bf16)` would round them.
        self._cos_sin: dict[str, torch.Tensor] = {}
        self._layer_kinds = tuple(dict.fromkeys(config.layer_types))  # "sliding" / "full", each once

    def tie_weights(self) -> None:
        """lm_head shares the embedding (tied families). Called again after `to_empty`/`to`, which give
        each module its own new tensor."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def cos_sin(
        self, layer_type: str, device: torch.device
    ) -> torch.Tensor:  # fp32 [max_model_len, head_dim]
        table = self._cos_sin.get(layer_type)
        if table is None or table.device != device:
            cfg = self.config
            table = rotary_table(cfg.head_dim, cfg.rope_for(layer_type), cfg.max_model_len, device)
            self._cos_sin[layer_type] = table
        return table

    @property
    def token_lookback_depth(self) -> int:
        return 0  # no engram: no lookback

    def kv_cache_group_specs(
        self, block_size: int, swa_bounded_replay: bool = True
    ) -> tuple[KVCacheGroupSpec, ...]:
        return kv_cache_group_specs(self.config, block_size, swa_bounded_replay)

    def reset_hash_buffers(self) -> None:
        """No engram: nothing to rebuild (the worker calls this on every model)."""

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # int [T] -> [T, hidden]
        """Gemma scales embeddings by sqrt(hidden) rounded to the weights' dtype, as the original does."""
        hidden = self.embed(input_ids)
        scale = self.config.embed_scale
        if scale != 1.0:
            hidden = hidden * torch.tensor(scale, dtype=hidden.dtype)
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,  # int [T]
        positions: torch.Tensor,  # int64 [T]
        lookback_token_ids: torch.Tensor,  # int32 [>= B, D]: unread (no engram)
        attn_metadata: ForwardMetadata,
        kv_caches: list[
            tuple[torch.Tensor, torch.Tensor]
        ],  # per layer, each [num_blocks, block_size, H_kv, hd]
    ) -> torch.Tensor:  # [T, hidden], final norm applied
        if len(kv_caches) != len(self.layers):
            raise ValueError(
                f"kv_caches: one (k, v) pair per layer ({len(self.layers)}), got {len(kv_caches)}"
            )
        hidden = self.embed_tokens(input_ids)
        residual = None
        pending_norm = None  # the last layer's output_norm, not yet applied to hidden
        tables = {t: self.cos_sin(t, hidden.device) for t in self._layer_kinds}
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(
                hidden, residual, positions, attn_metadata, kv_cache, tables[layer.layer_type], pending_norm
            )
            pending_norm = layer.output_norm
        return self.final_norm.add_and_norm(hidden, residual, pending_norm)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return logits_fp32(self.lm_head, hidden, out)  # [N, hidden] -> fp32 [N, vocab]

    def compute_head(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return head_logits(self.lm_head, hidden, out)  # [N, hidden] -> [N, vocab] in the weights' dtype
