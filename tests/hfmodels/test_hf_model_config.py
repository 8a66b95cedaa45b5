"""config.json -> ModelConfig: each family's layer kinds and ropes, both config formats, and refusals that
name the field. Ropes are checked against transformers' own rope init, bit for bit."""

from __future__ import annotations

import pytest
import torch

from raystate.config import RopeConfig
from raystate.errors import InvalidRequest
from raystate.hf.model_config import UnsupportedConfig, config_dtype, model_config_from_hf
from raystate.model.rope import rope_inv_freq, rotary_table

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=1024,
)


def _cfg(arch: str, **kw) -> dict:
    return {"architectures": [arch], **BASE, **kw}


def test_qwen_sliding_from_use_sliding_window_and_max_window_layers():
    cfg = model_config_from_hf(
        _cfg("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    )
    assert cfg.layer_types == ("full", "full", "sliding", "sliding", "sliding", "sliding")
    assert cfg.sliding_window == 16 and cfg.attention_bias and not cfg.o_proj_bias and cfg.qk_norm == "none"
    # use_sliding_window false: transformers drops the window, whatever layer_types say.
    off = model_config_from_hf(
        _cfg(
            "Qwen3ForCausalLM",
            use_sliding_window=False,
            sliding_window=16,
            layer_types=["sliding_attention"] * 6,
        )
    )
    assert off.layer_types == ("full",) * 6 and off.qk_norm == "head"


def test_mistral_slides_everywhere_ministral_per_layer_llama_nowhere():
    assert set(model_config_from_hf(_cfg("MistralForCausalLM", sliding_window=32)).layer_types) == {"sliding"}
    assert set(model_config_from_hf(_cfg("MistralForCausalLM", sliding_window=None)).layer_types) == {"full"}
    mixed = ["sliding_attention", "full_attention"] * 3
    assert (
        model_config_from_hf(_cfg("MinistralForCausalLM", sliding_window=32, layer_types=mixed)).layer_types
        == ("sliding", "full") * 3
    )
    assert set(model_config_from_hf(_cfg("LlamaForCausalLM", sliding_window=32)).layer_types) == {"full"}


def test_gemma3_old_and_new_formats_agree():
    new = _cfg(
        "Gemma3ForCausalLM",
        sliding_window=16,
        query_pre_attn_scalar=24,
        dtype="bfloat16",
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    old = _cfg(
        "Gemma3ForCausalLM",
        sliding_window=16,
        query_pre_attn_scalar=24,
        torch_dtype="bfloat16",
        sliding_window_pattern=6,
        rope_theta=1e6,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    a, b = model_config_from_hf(new), model_config_from_hf(old)
    assert a == b
    assert a.layer_types == ("sliding",) * 5 + ("full",)
    assert a.rope_full == RopeConfig("linear", 1e6, factor=8.0) and a.rope_sliding == RopeConfig(
        theta=10000.0
    )
    assert a.norm_layout == "sandwich" and a.norm_weight_offset == 1.0 and a.tie_word_embeddings
    assert a.embed_scale == 64**0.5 and a.attention_scale == 24**-0.5 and a.hidden_act == "gelu_tanh"
    assert config_dtype(new) == config_dtype(old) == "bfloat16"


def test_olmo3_yarn_on_full_layers_only():
    cfg = model_config_from_hf(
        _cfg(
            "Olmo3ForCausalLM",
            sliding_window=16,
            rope_theta=5e5,
            num_hidden_layers=8,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        )
    )
    assert cfg.layer_types == ("sliding", "sliding", "sliding", "full") * 2
    assert cfg.rope_full.rope_type == "yarn" and cfg.rope_sliding == RopeConfig(theta=5e5)
    assert cfg.norm_layout == "post" and cfg.qk_norm == "projection" and cfg.rms_norm_eps == 1e-5


@pytest.mark.parametrize(
    "field, value",
    [
        ("architectures", ["Gemma3ForConditionalGeneration"]),
        ("final_logit_softcapping", 30.0),
        ("attn_logit_softcapping", 50.0),
        ("quantization_config", {"quant_method": "awq"}),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
        ("partial_rotary_factor", 0.5),
        ("hidden_act", "gelu"),
        ("pretraining_tp", 2),
        ("layer_types", ["chunked_attention"] * 6),
    ],
)
def test_unimplemented_fields_are_refused_by_name(field, value):
    cfg = (
        _cfg("LlamaForCausalLM") if field != "layer_types" else _cfg("MinistralForCausalLM", sliding_window=8)
    )
    cfg[field] = value
    with pytest.raises(UnsupportedConfig) as e:
        model_config_from_hf(cfg)
    assert field.split(".")[0] in str(e.value)


def test_missing_size_field_is_named():
    cfg = _cfg("LlamaForCausalLM")
    del cfg["hidden_size"]
    with pytest.raises(InvalidRequest, match="hidden_size"):
        model_config_from_hf(cfg)


def _hf_rope(config, layer_type=None):
    """transformers' own (inv_freq, attention_factor) for a config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    if params["rope_type"] == "default":
        base, dim = params["rope_theta"], config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu", layer_type=layer_type)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 8.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 16,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ],
)
def test_rope_matches_transformers_bit_for_bit(scaling):
    import transformers

    kw = dict(BASE, rope_theta=500000.0)
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    hf = transformers.LlamaConfig(**kw)
    ours = model_config_from_hf(_cfg("LlamaForCausalLM", **kw))
    want_freq, want_factor = _hf_rope(hf)
    got = rope_inv_freq(ours.rope_full, ours.head_dim)
    assert torch.equal(got, want_freq.float())
    assert ours.rope_full.attention_factor == pytest.approx(want_factor, rel=0, abs=0)
    # The table the kernels read: cos and sin of position * inv_freq, times the attention factor.
    table = rotary_table(ours.head_dim, ours.rope_full, 300, torch.device("cpu"))
    angles = torch.arange(300).float()[:, None] * want_freq[None, :].float()
    assert torch.equal(table, torch.cat((angles.cos() * want_factor, angles.sin() * want_factor), dim=-1))


def test_gemma3_per_layer_type_ropes_match_transformers():
    import transformers

    hf = transformers.Gemma3TextConfig(
        **BASE,
        sliding_window=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    ours = model_config_from_hf(hf.to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    for layer_type, rope in (("sliding_attention", ours.rope_sliding), ("full_attention", ours.rope_full)):
        want, _ = _hf_rope(hf, layer_type)
        assert torch.equal(rope_inv_freq(rope, ours.head_dim), want.float())


def test_kv_summary_says_what_a_cached_gemma3_prefix_keeps():
    """Bounded replay caches the full layers only: 1 of every 6 layers' KV for Gemma 3's 5:1."""
    from raystate.config import CacheConfig, EngineConfig

    model = model_config_from_hf(_cfg("Gemma3ForCausalLM", sliding_window=16, num_hidden_layers=12))
    summary = EngineConfig(model=model, cache=CacheConfig(num_blocks=10)).kv_summary()
    assert "a cached prefix keeps 2/12 of the KV" in summary and "replays 16 tokens after a hit" in summary
    everything = EngineConfig(model=model, cache=CacheConfig(num_blocks=10, swa_bounded_replay=False))
    assert "keeps" not in everything.kv_summary()
