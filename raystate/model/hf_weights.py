"""A Hugging Face checkpoint folder -> a `DecoderLM` on the device, its weights read from safetensors.

The model is built on the meta device in the target dtype and materialised empty on the device, so no
parameter is ever initialised or held twice; `raystate.model.checkpoint.load_checkpoint` then streams each
checkpoint tensor, memory-mapped, into its slot. Our parameters fuse what the checkpoint keeps apart (q, k
and v into qkv_proj, gate and up into gate_up_proj): each checkpoint tensor names the rows it fills.
"""

from __future__ import annotations

import os

import torch

from raystate.config import ModelConfig
from raystate.model.checkpoint import LoadStats, WeightTarget, load_checkpoint
from raystate.model.decoder_lm import DecoderLM

# Checkpoint name of each per-layer norm -> ours.
_LAYER_NORMS = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "pre_mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}


def hf_weight_targets(model: DecoderLM) -> dict[str, WeightTarget]:
    """Checkpoint tensor name -> where it goes in `model` (fused projections at their row offsets)."""
    cfg = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[str, WeightTarget] = {
        "model.embed_tokens.weight": WeightTarget(params["embed.weight"]),
        "model.norm.weight": WeightTarget(params["final_norm.weight"]),
    }
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = WeightTarget(params["lm_head.weight"])
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            fused = params.get(f"{dst}attn.qkv_proj.{kind}")
            if fused is not None:
                for name, offset in (("q_proj", 0), ("k_proj", q_rows), ("v_proj", q_rows + kv_rows)):
                    targets[f"{src}self_attn.{name}.{kind}"] = WeightTarget(fused, offset)
            for ours, theirs in (("attn.o_proj", "self_attn.o_proj"), ("mlp.down_proj", "mlp.down_proj")):
                if f"{dst}{ours}.{kind}" in params:
                    targets[f"{src}{theirs}.{kind}"] = WeightTarget(params[f"{dst}{ours}.{kind}"])
            gate_up = params.get(f"{dst}mlp.gate_up_proj.{kind}")
            if gate_up is not None:
                targets[f"{src}mlp.gate_proj.{kind}"] = WeightTarget(gate_up, 0)
                targets[f"{src}mlp.up_proj.{kind}"] = WeightTarget(gate_up, cfg.intermediate_size)
        for theirs, ours in _LAYER_NORMS.items():
            if f"{dst}{ours}.weight" in params:
                targets[f"{src}{theirs}.weight"] = WeightTarget(params[f"{dst}{ours}.weight"])
        if cfg.qk_norm != "none":
            for n in ("q_norm", "k_norm"):
                targets[f"{src}self_attn.{n}.weight"] = WeightTarget(params[f"{dst}attn.{n}.weight"])
    return targets


def _ignored(name: str) -> bool:
    """Checkpoint tensors we do not need: saved rope buffers, and a tied lm_head saved anyway."""
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"


def empty_decoder_lm(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> DecoderLM:
    """A DecoderLM with uninitialised weights on `device`, in `dtype` (never materialised in fp32 first)."""
    with torch.device("meta"):
        model = DecoderLM(config).to(dtype)
    model = model.to_empty(device=torch.device(device))
    model.tie_weights()
    return model


def load_hf_model(
    folder: str | os.PathLike, config: ModelConfig, device: torch.device | str, dtype: torch.dtype
) -> tuple[DecoderLM, LoadStats]:
    """The checkpoint in `folder` as our DecoderLM (built from `config`, which `raystate.hf.model_config`
    made from the folder's config.json), and what reading it took."""
    model = empty_decoder_lm(config, device, dtype)
    stats = load_checkpoint(os.fspath(folder), hf_weight_targets(model), ignore=_ignored)
    return model.eval(), stats
