"""Projection weights re-stored column-major (raystate.model.weight_layout): the same values, ties kept,
the same forward; loading re-stores only half-precision weights on a GPU."""

import torch
from torch import nn

from raystate.model import dense_forward, load_model, weight_layout
from raystate.model.weight_layout import is_column_major, store_projections_column_major, wants_column_major


def _linears(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _every_dense_weight(weight: torch.Tensor) -> bool:
    """wants_column_major with the device and dtype condition dropped: the CPU test's stand-in."""
    return weight.is_contiguous() and min(weight.shape) > 1


def test_restored_weights_keep_their_values_and_the_forward(monkeypatch):
    model = load_model("tiny", seed=0)
    ids = list(range(3, 90))
    want = dense_forward(model, ids)
    before = {name: (w, w.detach().clone()) for name, w in _linears(model).items()}
    monkeypatch.setattr(weight_layout, "wants_column_major", _every_dense_weight)
    assert store_projections_column_major(model) is model
    linears = _linears(model)
    assert linears.keys() == before.keys() and len(linears) > 4
    for name, weight in linears.items():
        param, values = before[name]
        assert weight is param, f"{name}: the Parameter object is replaced, not re-stored"
        assert is_column_major(weight), f"{name}: strides {weight.stride()}"
        assert torch.equal(weight, values), name
    torch.testing.assert_close(dense_forward(model, ids), want, rtol=1e-5, atol=1e-5)


def test_a_tied_head_stays_the_embedding(monkeypatch):
    from raystate.hf.model_config import model_config_from_hf
    from raystate.model.hf_weights import empty_decoder_lm

    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 50,
        "sliding_window": 8,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }
    model = empty_decoder_lm(model_config_from_hf(raw), "cpu", torch.float32)
    for p in model.parameters():
        nn.init.normal_(p)
    table = model.embed.weight.detach().clone()
    monkeypatch.setattr(weight_layout, "wants_column_major", _every_dense_weight)
    store_projections_column_major(model)
    assert model.lm_head.weight is model.embed.weight and is_column_major(model.embed.weight)
    ids = torch.tensor([0, 7, 49, 7])
    assert torch.equal(model.embed(ids), table[ids])  # the gather reads the re-stored table by its strides


def test_loading_restores_only_half_precision_weights_on_a_gpu(monkeypatch):
    for weight in _linears(load_model("tiny", dtype=torch.bfloat16)).values():
        assert weight.is_contiguous()  # on the CPU: as stored
    assert not wants_column_major(torch.zeros(4, 4, dtype=torch.bfloat16))  # the CPU
    assert not wants_column_major(torch.zeros(4, 4))
    model = load_model("tiny", seed=0)
    monkeypatch.setattr(weight_layout, "wants_column_major", _every_dense_weight)
    previous = weight_layout.set_enabled(False)
    try:
        store_projections_column_major(model)  # turned off: as stored
    finally:
        weight_layout.set_enabled(previous)
    assert all(w.is_contiguous() for w in _linears(model).values())
