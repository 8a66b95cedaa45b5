"""Seeded init, save_pretrained/load_model round trip, model sizes."""

import pytest
import torch

from raystate.config import ModelConfig
from raystate.errors import InvalidRequest
from raystate.kv_layout import kv_cache_group_specs
from raystate.model import TinyHybrid, dense_forward, load_model, save_pretrained

IDS = [256, *b"Round trip, round TRIP."]


def assert_same_weights(a: TinyHybrid, b: TinyHybrid) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_save_load_round_trip(tiny_model, tmp_path):
    save_pretrained(tiny_model, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.json").is_file() and (
        tmp_path / "ckpt" / "model.safetensors"
    ).is_file()
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == tiny_model.config
    assert_same_weights(loaded, tiny_model)
    for a, b in zip(loaded.layers, tiny_model.layers, strict=True):  # derived hash buffers rebuilt
        if a.engram is not None:
            assert torch.equal(a.engram.primes, b.engram.primes)
            assert torch.equal(a.engram.multipliers, b.engram.multipliers)
    assert torch.equal(dense_forward(loaded, IDS), dense_forward(tiny_model, IDS))


def test_load_directory_with_serving_config(tiny_model, tmp_path):
    save_pretrained(tiny_model, tmp_path)
    shorter = ModelConfig.from_dict({**tiny_model.config.to_dict(), "max_model_len": 256})
    loaded = load_model(tmp_path, config=shorter)
    assert loaded.config.max_model_len == 256
    assert_same_weights(loaded, tiny_model)
    other_shape = ModelConfig.from_dict({**tiny_model.config.to_dict(), "engram_vocab_size": 2000})
    with pytest.raises(InvalidRequest, match="engram_vocab_size"):
        load_model(tmp_path, config=other_shape)


def test_a_plain_folder_named_like_a_config_is_not_a_checkpoint(tiny_model, tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()  # e.g. the repo's bench/ folder next to the "bench" config
    monkeypatch.chdir(tmp_path)
    assert_same_weights(load_model("tiny"), tiny_model)
    save_pretrained(tiny_model, tmp_path / "tiny")
    assert_same_weights(load_model("tiny"), tiny_model)  # now a checkpoint: loaded from the files


def test_same_seed_same_weights_other_seed_different(tiny_model):
    assert_same_weights(load_model("tiny", seed=0), tiny_model)
    assert_same_weights(load_model("tiny"), tiny_model)  # config.seed is 0
    other = load_model("tiny", seed=1)
    for (name, a), b in zip(tiny_model.named_parameters(), other.parameters(), strict=True):
        if name.endswith("norm.weight"):
            assert torch.equal(a, b)  # gains start at one
        else:
            assert not torch.equal(a, b), name


def test_init_does_not_depend_on_thread_count(tiny_model):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = load_model("tiny")
    finally:
        torch.set_num_threads(threads)
    assert_same_weights(one, tiny_model)


def test_bfloat16_holds_rounded_fp32_weights(tiny_model):
    bf16 = load_model("tiny", dtype=torch.bfloat16)
    for (name, a), b in zip(bf16.named_parameters(), tiny_model.parameters(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16)), name
    assert bf16.layers[1].engram.primes.dtype == torch.int64


def test_sizes():
    with torch.device("meta"):
        bench = TinyHybrid(ModelConfig.named("bench"))
    num_bench = sum(p.numel() for p in bench.parameters())
    assert 0.9e9 < num_bench < 1.3e9
    tiny = load_model("tiny")
    tiny_bytes = sum(p.numel() * p.element_size() for p in tiny.parameters())
    assert 1e6 < tiny_bytes < 8e6


def test_model_api(tiny_model):
    cfg = tiny_model.config
    assert tiny_model.token_lookback_depth == cfg.engram_max_ngram - 1
    assert tiny_model.kv_cache_group_specs(16) == kv_cache_group_specs(cfg, 16)
    assert tiny_model.kv_cache_group_specs(4, swa_bounded_replay=False) == kv_cache_group_specs(cfg, 4, False)
    windows = [layer.attn.sliding_window for layer in tiny_model.layers]
    assert windows == [cfg.sliding_window if t == "sliding" else 0 for t in cfg.layer_types]
    assert [i for i, layer in enumerate(tiny_model.layers) if layer.engram is not None] == list(
        cfg.engram_layer_ids
    )
    with pytest.raises(InvalidRequest, match="model"):
        load_model("no-such-model")
