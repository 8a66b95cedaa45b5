"""Tests of the tiny family checkpoints (hf_families) and of the reference greedy generator."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from hf_families import (
    FAMILIES,
    greedy,
    hf_greedy,
    hf_logits,
    load_model,
    make_family_checkpoint,
    prompt_ids,
)

S, F = "sliding_attention", "full_attention"

EXPECTED_LAYER_TYPES = {
    "qwen3": [S, F, S, S, F],
    "qwen2": [F, F, S, S, S],  # derived from use_sliding_window + max_window_layers=2
    "mistral": None,  # no layer_types: every layer sliding
    "ministral": [S, F, S, F],
    "llama": None,  # full attention only
    "gemma3": [S, S, S, S, S, F],  # derived: pattern 6
    "gemma3_legacy": [S, S, S, S, S, F],  # derived from sliding_window_pattern 6
    "olmo3": [S, S, S, F],  # derived: every 4th full
}
WINDOWS = {
    "qwen3": 24,
    "qwen2": 16,
    "mistral": 32,
    "ministral": 24,
    "gemma3": 16,
    "gemma3_legacy": 16,
    "olmo3": 32,
}


def _files(folder):
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_config_fields(family_checkpoint):
    family, folder = family_checkpoint
    config = transformers.AutoConfig.from_pretrained(str(folder))
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert config.vocab_size == len(tok)
    assert config.hidden_size == 64
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.max_position_embeddings == 4096
    assert getattr(config, "layer_types", None) == EXPECTED_LAYER_TYPES[family]
    assert getattr(config, "sliding_window", None) == WINDOWS.get(family)
    raw = json.loads((folder / "config.json").read_text())
    if family == "gemma3_legacy":
        assert "layer_types" not in raw and "rope_parameters" not in raw and raw["torch_dtype"] == "float32"
    else:
        assert raw["dtype"] == "float32"
    if family.startswith("gemma3"):
        assert config.query_pre_attn_scalar == 24 and config.head_dim == 16
        assert config.rope_parameters == {
            S: {"rope_type": "default", "rope_theta": 10_000.0},
            F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        }
    if family == "olmo3":
        assert config.rope_parameters[S]["rope_type"] == "default"
        assert config.rope_parameters[F]["rope_type"] == "yarn"
    if family == "llama":
        assert config.rope_parameters["rope_type"] == "llama3"
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"]


def test_qwen3_is_sharded(family_checkpoints):
    folder = family_checkpoints["qwen3"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (folder / "model.safetensors").exists()


def test_deterministic(family_checkpoints, tmp_path):
    for family in FAMILIES:
        again = make_family_checkpoint(family, tmp_path / family)
        assert _files(again) == _files(family_checkpoints[family]), family


def test_prompt_ids(family_checkpoint):
    _, folder = family_checkpoint
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = prompt_ids(folder, 120, seed=3)
    assert len(ids) == 120 and ids == prompt_ids(folder, 120, seed=3)
    assert ids != prompt_ids(folder, 120, seed=4)
    assert all(0 <= i < len(tok) for i in ids)
    assert not set(ids[1:]) & set(tok.all_special_ids)


def test_greedy_matches_argmax_loop(family_checkpoint):
    """`hf_greedy` (generate with a KV cache, EOS off) equals argmax over full forwards without a cache."""
    _, folder = family_checkpoint
    model = load_model(folder)
    prompt = prompt_ids(folder, 40, seed=1)
    (new,) = greedy(model, [prompt], 8)
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(hf_logits(folder, ids, model=model)[-1].argmax()))
    assert new == ids[len(prompt) :]


def test_greedy_never_stops_at_eos(family_checkpoints):
    """A prompt after which the first greedy token is an EOS still gives max_new_tokens tokens."""
    folder = family_checkpoints["mistral"]
    model = load_model(folder)
    prompt = prompt_ids(folder, 30, seed=0)
    first = int(hf_logits(folder, prompt, model=model)[-1].argmax())
    model.generation_config.eos_token_id = first  # greedy() must switch it off again
    model.config.eos_token_id = first
    (new,) = greedy(model, [prompt], 5)
    assert len(new) == 5 and new[0] == first


@pytest.mark.slow
def test_window_matters_and_output_diverse(family_checkpoint):
    """Greedy output over a prompt of several windows changes when the window is widened to 4096, and is
    not one token repeated."""
    family, folder = family_checkpoint
    prompts = [prompt_ids(folder, 120, seed=s) for s in range(2)]
    outs = hf_greedy(folder, prompts, 24)
    for out in outs:
        assert len(out) == 24 and len(set(out)) >= 4, (family, out)
    if family == "llama":  # no window: check that the llama3 RoPE scaling matters instead
        plain = load_model(folder, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
        assert greedy(plain, prompts, 24) != outs
        return
    wide = greedy(load_model(folder, sliding_window=4096), prompts, 24)
    for out, w in zip(outs, wide, strict=True):
        assert out != w, family


def test_gemma3_legacy_config_same_logits(family_checkpoints):
    ids = prompt_ids(family_checkpoints["gemma3"], 100, seed=2)
    new = hf_logits(family_checkpoints["gemma3"], ids)
    legacy = hf_logits(family_checkpoints["gemma3_legacy"], ids)
    assert torch.equal(new, legacy)


def test_window_semantics(family_checkpoints):
    """In transformers a sliding layer's query i reads keys i-W+1..i (W keys, itself included): through L
    all-sliding layers the last position depends on exactly the last L*(W-1)+1 tokens."""
    folder = family_checkpoints["mistral"]  # every layer sliding
    ids = prompt_ids(folder, 160, seed=5)
    for layers in (1, 4):
        model = load_model(folder, num_hidden_layers=layers)
        window = model.config.sliding_window
        edge = len(ids) - 1 - layers * (window - 1)  # the first position the last one depends on
        base = hf_logits(folder, ids, model=model)[-1]

        def changed(pos, model=model, base=base):
            other = list(ids)
            other[pos] = ids[pos] + 1 if ids[pos] + 1 < model.config.vocab_size else ids[pos] - 1
            return (hf_logits(folder, other, model=model)[-1] - base).abs().max().item()

        assert changed(edge - 1) < 1e-6, layers
        assert changed(edge) > (1e-3 if layers == 1 else 1e-5), layers  # one path through 4 layers: small


def test_yarn_attention_factor(family_checkpoints):
    """Olmo3: YaRN (with its cos/sin scale 0.1 ln(factor) + 1) on the full layers only."""
    model = load_model(family_checkpoints["olmo3"])
    rotary = model.model.rotary_emb
    assert rotary.rope_type == {S: "default", F: "yarn"}
    assert math.isclose(getattr(rotary, f"{F}_attention_scaling"), 0.1 * math.log(4.0) + 1.0, rel_tol=1e-6)
    assert getattr(rotary, f"{S}_attention_scaling") == 1.0


def test_families_listed():
    assert set(FAMILIES) == set(EXPECTED_LAYER_TYPES)
