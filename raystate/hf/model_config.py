"""A Hugging Face config.json -> our `ModelConfig`: which family, which layers slide, each layer type's
rope, and the family's numerics switches.

Families: Llama, Qwen2, Qwen3, Mistral, Ministral, Gemma 3 text and OLMo 3 (dense decoder-only). Both
config formats are read: the newer one (`rope_parameters`, `dtype`, explicit `layer_types`) and the older
one hub checkpoints still carry (`rope_theta`, `rope_scaling`, `torch_dtype`, Gemma's
`rope_local_base_freq` and `sliding_window_pattern`, Qwen's `use_sliding_window` + `max_window_layers`).
How each family decides which layers slide and which rope a layer type gets follows transformers 5.24.

Refused, with an error naming the field: an architecture we do not implement, and any field that changes
the numerics in a way we do not implement (a rope type, soft-capping, partial rotary, quantization, an
activation). Never silently ignored. Standard library only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from raystate.config import ModelConfig, RopeConfig
from raystate.errors import InvalidRequest

CONFIG_FILE = "config.json"

# architectures[0] -> model_type, for the families we implement.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "ministral",
    "Gemma3ForCausalLM": "gemma3_text",
    "Olmo3ForCausalLM": "olmo3",
}
_SLIDING, _FULL = "sliding_attention", "full_attention"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32"}


class UnsupportedConfig(InvalidRequest):
    """A config.json field we do not implement; the message names it and what we take."""


def _refuse(field: str, limit: str, got: Any) -> None:
    raise UnsupportedConfig(f"config.json: {field}", limit, got)


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    file = Path(folder) / CONFIG_FILE
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidRequest("model", f"a folder holding {CONFIG_FILE}", str(folder)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(str(file), "valid JSON", str(e)) from None


def is_hf_config(cfg: dict[str, Any]) -> bool:
    """A Hugging Face config (it names its architectures or model_type), not one of our own saves."""
    return "architectures" in cfg or "model_type" in cfg


def config_dtype(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's dtype ("dtype", or the older "torch_dtype"), in our spelling; None when absent."""
    value = cfg.get("dtype", cfg.get("torch_dtype"))
    if value is None:
        return None
    value = str(value).removeprefix("torch.")
    if value not in _DTYPES:
        _refuse("dtype", f"one of {sorted(_DTYPES)}", value)
    return _DTYPES[value]


def _family(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch not in ARCHITECTURES:
            _refuse("architectures", f"one of {sorted(ARCHITECTURES)}", arch)
        return ARCHITECTURES[arch]
    model_type = cfg.get("model_type")
    if model_type not in ARCHITECTURES.values():
        _refuse("model_type", f"one of {sorted(set(ARCHITECTURES.values()))}", model_type)
    return model_type


def _layer_kinds(cfg: dict[str, Any], family: str, num_layers: int) -> tuple[list[str], int]:
    """(per layer "sliding" or "full", the window W; 0 when no layer slides)."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            window = None  # transformers drops the window: every layer is full attention
        if layer_types is None:
            first_sliding = _get(cfg, "max_window_layers", 28)
            layer_types = [
                _SLIDING if window is not None and i >= first_sliding else _FULL for i in range(num_layers)
            ]
    elif family == "mistral":
        layer_types = [_SLIDING if window is not None else _FULL] * num_layers
    elif family == "llama":
        window, layer_types = None, [_FULL] * num_layers
    elif family == "ministral" and layer_types is None:
        layer_types = [_SLIDING if window is not None else _FULL] * num_layers
    elif family == "gemma3_text" and layer_types is None:
        pattern = _get(cfg, "sliding_window_pattern", 6)
        layer_types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    elif family == "olmo3" and layer_types is None:
        layer_types = [_SLIDING if (i + 1) % 4 else _FULL for i in range(num_layers)]
    if len(layer_types) != num_layers:
        _refuse("layer_types", f"one entry per layer ({num_layers})", len(layer_types))
    kinds = []
    for t in layer_types:
        if t not in (_SLIDING, _FULL):
            _refuse("layer_types", f"{_SLIDING!r} or {_FULL!r} per layer", t)
        kinds.append("sliding" if t == _SLIDING and window is not None else "full")
    if "sliding" in kinds and (not isinstance(window, int) or window < 1):
        _refuse("sliding_window", "a positive integer", window)
    return kinds, int(window) if "sliding" in kinds else 0


def _rope(params: dict[str, Any], cfg: dict[str, Any], theta: float, where: str) -> RopeConfig:
    """One rope dict (new `rope_parameters` or old `rope_scaling`) -> RopeConfig."""
    params = dict(params or {})
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    theta = float(params.pop("rope_theta", theta))
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        _refuse(f"{where}.partial_rotary_factor", "1.0 (rotary over the whole head)", partial)
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig("linear", theta, factor=float(params["factor"]))
    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    original = int(original if original is not None else cfg.get("max_position_embeddings", 0))
    if rope_type == "llama3":
        return RopeConfig(
            "llama3",
            theta,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    if rope_type == "yarn":
        factor = params.get("factor")
        factor = float(factor) if factor is not None else cfg["max_position_embeddings"] / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return RopeConfig(
            "yarn",
            theta,
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention_factor),
        )
    _refuse(f"{where}.rope_type", "one of default, linear, llama3, yarn", rope_type)
    raise AssertionError  # unreachable


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _ropes(cfg: dict[str, Any], family: str) -> tuple[RopeConfig, RopeConfig]:
    """(full layers' rope, sliding layers' rope)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    nested = isinstance(params, dict) and (_SLIDING in params or _FULL in params)
    if family in ("gemma3_text", "olmo3"):
        # One rope per layer type; older configs: rope_scaling applies to the full layers only, and Gemma's
        # sliding layers take rope_local_base_freq.
        full_theta = _get(cfg, "rope_theta", 1_000_000.0 if family == "gemma3_text" else 500_000.0)
        local_theta = (
            _get(cfg, "rope_local_base_freq", 10_000.0)
            if family == "gemma3_text"
            else _get(cfg, "rope_theta", 500_000.0)
        )
        if nested:
            full, full_where = params.get(_FULL) or {}, f"rope_parameters.{_FULL}"
            sliding = params.get(_SLIDING) or {}
        else:
            full, full_where = dict(scaling or params or {}), "rope_scaling" if scaling else "rope_parameters"
            sliding = {}
        return (
            _rope(full, cfg, full_theta, full_where),
            _rope(sliding, cfg, local_theta, f"rope_parameters.{_SLIDING}"),
        )
    if nested:
        _refuse("rope_parameters", "one rope for every layer in this family", sorted(params))
    theta = _get(cfg, "rope_theta", 10_000.0)
    rope = _rope(scaling or params or {}, cfg, theta, "rope_scaling" if scaling else "rope_parameters")
    return rope, rope


def _check_numerics(cfg: dict[str, Any], family: str) -> None:
    """Fields that would change the forward in ways we do not implement."""
    if cfg.get("quantization_config") is not None:
        _refuse(
            "quantization_config",
            "absent (quantized checkpoints are not supported)",
            cfg["quantization_config"],
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            _refuse(key, "null (soft-capping is not implemented)", cfg[key])
    if cfg.get("use_bidirectional_attention"):
        _refuse("use_bidirectional_attention", "false", cfg["use_bidirectional_attention"])
    if _get(cfg, "pretraining_tp", 1) != 1:
        _refuse("pretraining_tp", "1", cfg["pretraining_tp"])
    act_key = "hidden_activation" if family == "gemma3_text" else "hidden_act"
    act = cfg.get(act_key, cfg.get("hidden_act"))
    want = "gelu_pytorch_tanh" if family == "gemma3_text" else "silu"
    if act is not None and act != want:
        _refuse(act_key, want, act)
    if family == "olmo3" and cfg.get("clip_qkv") is not None:
        _refuse("clip_qkv", "null", cfg["clip_qkv"])


def model_config_from_hf(
    cfg: dict[str, Any], name: str = "hf", max_model_len: int | None = None
) -> ModelConfig:
    """Our ModelConfig of a parsed Hugging Face config.json (errors name the field)."""
    family = _family(cfg)
    _check_numerics(cfg, family)
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        intermediate = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise InvalidRequest(f"config.json: {e.args[0]}", "present", None) from None
    num_kv_heads = int(_get(cfg, "num_key_value_heads", num_heads))
    head_dim = int(_get(cfg, "head_dim", hidden // num_heads))
    kinds, window = _layer_kinds(cfg, family, num_layers)
    rope_full, rope_sliding = _ropes(cfg, family)
    gemma, olmo = family == "gemma3_text", family == "olmo3"
    eos = cfg.get("eos_token_id")
    eos_ids = [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    bos = cfg.get("bos_token_id")
    pad = cfg.get("pad_token_id")
    if max_model_len is None:
        max_model_len = int(_get(cfg, "max_position_embeddings", 4096))
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layer_types=tuple(kinds),
        sliding_window=window or 1,  # unused without a sliding layer
        rope_theta=rope_full.theta,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-5 if olmo else 1e-6)),
        max_model_len=max_model_len,
        engram_layer_ids=(),
        bos_token_id=int(bos) if isinstance(bos, int) else -1,
        eos_token_id=eos_ids[0] if eos_ids else -1,
        pad_token_id=int(pad) if isinstance(pad, int) else -1,
        architecture=family,
        attention_bias=True if family == "qwen2" else bias,
        o_proj_bias=False if family == "qwen2" else bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm="head" if family in ("qwen3", "gemma3_text") else "projection" if olmo else "none",
        norm_layout="sandwich" if gemma else "post" if olmo else "pre",
        norm_weight_offset=1.0 if gemma else 0.0,
        embed_scale=hidden**0.5 if gemma else 1.0,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        hidden_act="gelu_tanh" if gemma else "silu",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        extra_eos_token_ids=tuple(eos_ids[1:]),
    )


def load_model_config(folder: str | Path, max_model_len: int | None = None) -> ModelConfig:
    return model_config_from_hf(read_hf_config(folder), name=Path(folder).name, max_model_len=max_model_len)
