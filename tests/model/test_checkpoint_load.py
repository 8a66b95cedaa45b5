"""`load_checkpoint` against small safetensors checkpoints written in the test (CPU only).

Covers single-file and sharded (hand-written index) checkpoints, fused targets, dtype conversion both
ways, every error case (each message must name the tensor or file at fault, and nothing may be copied
when the checkpoint does not fit), and a real sharded transformers Llama checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from raystate.errors import InvalidRequest
from raystate.model.checkpoint import (
    CheckpointMismatch,
    LoadStats,
    WeightTarget,
    checkpoint_files,
    load_checkpoint,
)

ATTN = "model.layers.0.self_attn"


def _tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A tiny HF-named layer: q [8, 4], k and v [4, 4] (GQA), a norm and an embedding."""
    gen = torch.Generator().manual_seed(0)
    shapes = {
        f"{ATTN}.q_proj.weight": (8, 4),
        f"{ATTN}.k_proj.weight": (4, 4),
        f"{ATTN}.v_proj.weight": (4, 4),
        "model.norm.weight": (4,),
        "model.embed_tokens.weight": (10, 4),
    }
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}


def _save_single(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    return folder


def _save_sharded(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 2) -> Path:
    """HF's layout: model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _fused_targets(dtype: torch.dtype = torch.float32) -> tuple[dict[str, WeightTarget], dict]:
    """Targets of `_tensors` with q/k/v stacked into one qkv param; also the params by our name."""
    params = {
        "qkv": torch.full((16, 4), float("nan"), dtype=dtype),
        "norm": torch.full((4,), float("nan"), dtype=dtype),
        "embed": torch.full((10, 4), float("nan"), dtype=dtype),
    }
    targets = {
        f"{ATTN}.q_proj.weight": WeightTarget(params["qkv"], 0, "layers.0.attn.qkv_proj.weight"),
        f"{ATTN}.k_proj.weight": WeightTarget(params["qkv"], 8, "layers.0.attn.qkv_proj.weight"),
        f"{ATTN}.v_proj.weight": WeightTarget(params["qkv"], 12, "layers.0.attn.qkv_proj.weight"),
        "model.norm.weight": WeightTarget(params["norm"]),
        "model.embed_tokens.weight": WeightTarget(params["embed"]),
    }
    return targets, params


def _assert_loaded(params: dict, tensors: dict[str, torch.Tensor]) -> None:
    dtype = params["qkv"].dtype
    qkv = torch.cat([tensors[f"{ATTN}.{p}_proj.weight"] for p in "qkv"]).to(dtype)
    torch.testing.assert_close(params["qkv"], qkv, rtol=0, atol=0)
    torch.testing.assert_close(params["norm"], tensors["model.norm.weight"].to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(
        params["embed"], tensors["model.embed_tokens.weight"].to(dtype), rtol=0, atol=0
    )


def _untouched(params: dict) -> bool:
    return all(bool(p.isnan().all()) for p in params.values())


# ----------------------------------------------------------------------------------------------------------
# Loading


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_fused_targets_load_exactly(tmp_path, layout):
    tensors = _tensors()
    save = _save_single if layout == "single" else _save_sharded
    folder = save(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets()
    stats = load_checkpoint(folder, targets)
    _assert_loaded(params, tensors)
    assert isinstance(stats, LoadStats)
    assert stats.tensors == len(tensors)
    assert stats.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
    assert stats.seconds > 0 and stats.missing_optional == ()


@pytest.mark.parametrize(
    ("ckpt_dtype", "param_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_dtype_is_converted(tmp_path, ckpt_dtype, param_dtype):
    tensors = _tensors(ckpt_dtype)
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets(param_dtype)
    stats = load_checkpoint(folder, targets)
    assert all(p.dtype == param_dtype for p in params.values())
    _assert_loaded(params, tensors)
    # Bytes are counted in the checkpoint's own dtype.
    assert stats.bytes_read == sum(t.numel() for t in tensors.values()) * ckpt_dtype.itemsize


def test_sharded_files_come_from_the_index(tmp_path):
    folder = _save_sharded(tmp_path / "ckpt", _tensors(), shards=3)
    (folder / "unrelated.safetensors").write_bytes(b"")  # not in the index: never opened
    names = [p.name for p in checkpoint_files(folder)]
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_any_safetensors_files_without_index_or_model_file(tmp_path):
    tensors = _tensors()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:2]}, folder / "a.safetensors")
    save_file({n: tensors[n] for n in names[2:]}, folder / "b.safetensors")
    assert [p.name for p in checkpoint_files(folder)] == ["a.safetensors", "b.safetensors"]
    targets, params = _fused_targets()
    load_checkpoint(folder, targets)
    _assert_loaded(params, tensors)


def test_scalar_tensor(tmp_path):
    folder = _save_single(tmp_path / "ckpt", {"scale": torch.tensor(2.5)})
    param = torch.zeros(())
    load_checkpoint(folder, {"scale": WeightTarget(param)})
    assert param.item() == 2.5


# ----------------------------------------------------------------------------------------------------------
# Names: missing, unexpected, ignored, optional


def test_missing_tensors_are_all_named(tmp_path):
    tensors = _tensors()
    del tensors[f"{ATTN}.k_proj.weight"], tensors["model.norm.weight"]
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets()
    with pytest.raises(CheckpointMismatch, match="missing tensor") as err:
        load_checkpoint(folder, targets)
    assert f"'{ATTN}.k_proj.weight'" in str(err.value) and "'model.norm.weight'" in str(err.value)
    assert _untouched(params)


def test_unexpected_tensor_is_named(tmp_path):
    tensors = _tensors() | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets()
    with pytest.raises(CheckpointMismatch, match="unexpected tensor") as err:
        load_checkpoint(folder, targets)
    assert "rotary_emb.inv_freq" in str(err.value)
    assert _untouched(params)


def test_ignore_callback_skips_unused_tensors(tmp_path):
    tensors = _tensors() | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets()
    stats = load_checkpoint(folder, targets, ignore=lambda name: name.endswith("rotary_emb.inv_freq"))
    _assert_loaded(params, tensors)
    assert stats.tensors == len(tensors) - 1


def test_many_problems_are_truncated(tmp_path):
    tensors = {f"extra.{i}": torch.zeros(1) for i in range(25)}
    folder = _save_single(tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointMismatch, match=r"25 unexpected tensor\(s\).*\(15 more\)"):
        load_checkpoint(folder, {})


def test_optional_tensor_may_be_absent(tmp_path):
    folder = _save_single(tmp_path / "ckpt", _tensors())
    targets, params = _fused_targets()
    lm_head = torch.full((10, 4), float("nan"))
    targets["lm_head.weight"] = WeightTarget(lm_head, param_name="lm_head.weight")
    stats = load_checkpoint(folder, targets, optional=frozenset({"lm_head.weight"}))
    assert stats.missing_optional == ("lm_head.weight",)
    assert lm_head.isnan().all()  # left for the caller (tie it to the embedding)
    _assert_loaded(params, _tensors())


def test_optional_tensor_present_is_loaded(tmp_path):
    tensors = _tensors() | {"lm_head.weight": torch.arange(40.0).view(10, 4)}
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, _ = _fused_targets()
    lm_head = torch.zeros(10, 4)
    targets["lm_head.weight"] = WeightTarget(lm_head)
    stats = load_checkpoint(folder, targets, optional=frozenset({"lm_head.weight"}))
    assert stats.missing_optional == ()
    assert torch.equal(lm_head, tensors["lm_head.weight"])


# ----------------------------------------------------------------------------------------------------------
# Shapes and row coverage


def test_bad_shape_names_tensor_and_both_shapes(tmp_path):
    tensors = _tensors()
    tensors["model.norm.weight"] = torch.ones(5)
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets()
    with pytest.raises(CheckpointMismatch, match="shape mismatch") as err:
        load_checkpoint(folder, targets)
    msg = str(err.value)
    assert "'model.norm.weight'" in msg and "(4,)" in msg and "(5,)" in msg
    assert _untouched(params)


def test_fused_piece_too_wide_is_a_shape_error(tmp_path):
    tensors = _tensors()
    tensors[f"{ATTN}.v_proj.weight"] = torch.ones(4, 6)
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets()
    with pytest.raises(CheckpointMismatch, match="v_proj.weight") as err:
        load_checkpoint(folder, targets)
    assert "(4, 6)" in str(err.value) and "(16, 4)" in str(err.value)
    assert _untouched(params)


def test_overlapping_targets(tmp_path):
    folder = _save_single(tmp_path / "ckpt", _tensors())
    targets, params = _fused_targets()
    targets[f"{ATTN}.v_proj.weight"] = WeightTarget(params["qkv"], 10, "layers.0.attn.qkv_proj.weight")
    with pytest.raises(CheckpointMismatch, match="overlaps") as err:
        load_checkpoint(folder, targets)
    msg = str(err.value)
    assert "'layers.0.attn.qkv_proj.weight'" in msg and "v_proj" in msg and "k_proj" in msg
    assert _untouched(params)


def test_overlap_is_found_through_fresh_views(tmp_path):
    """Two targets naming the same memory through different tensor objects still collide."""
    folder = _save_single(tmp_path / "ckpt", {"a": torch.ones(2, 4), "b": torch.ones(2, 4)})
    param = torch.zeros(2, 4)
    with pytest.raises(CheckpointMismatch, match="overlaps"):
        load_checkpoint(folder, {"a": WeightTarget(param.view(2, 4)), "b": WeightTarget(param.view(2, 4))})


def test_unwritten_rows(tmp_path):
    tensors = _tensors()
    folder = _save_single(tmp_path / "ckpt", tensors)
    targets, params = _fused_targets()
    bigger = torch.full((18, 4), float("nan"))
    for p in "qkv":
        old = targets[f"{ATTN}.{p}_proj.weight"]
        targets[f"{ATTN}.{p}_proj.weight"] = WeightTarget(bigger, old.row_offset, old.param_name)
    with pytest.raises(CheckpointMismatch, match=r"rows \[16, 18\) not written") as err:
        load_checkpoint(folder, targets)
    assert "'layers.0.attn.qkv_proj.weight'" in str(err.value)
    assert bigger.isnan().all() and _untouched({k: v for k, v in params.items() if k != "qkv"})


def test_unwritten_rows_without_param_name_name_the_tensors(tmp_path):
    folder = _save_single(tmp_path / "ckpt", {"a": torch.ones(2, 4)})
    param = torch.zeros(5, 4)
    with pytest.raises(CheckpointMismatch, match=r"filled by 'a'.*rows \[0, 1\), \[3, 5\) not written"):
        load_checkpoint(folder, {"a": WeightTarget(param, 1)})


def test_plain_weight_with_fewer_rows_is_a_shape_error(tmp_path):
    folder = _save_single(tmp_path / "ckpt", {"a": torch.ones(2, 4)})
    with pytest.raises(CheckpointMismatch, match=r"'a': expected shape \(3, 4\), checkpoint has \(2, 4\)"):
        load_checkpoint(folder, {"a": WeightTarget(torch.zeros(3, 4))})


# ----------------------------------------------------------------------------------------------------------
# Files


def test_missing_shard_file_is_named(tmp_path):
    folder = _save_sharded(tmp_path / "ckpt", _tensors())
    (folder / "model-00002-of-00002.safetensors").unlink()
    targets, params = _fused_targets()
    with pytest.raises(InvalidRequest, match="model-00002-of-00002.safetensors"):
        load_checkpoint(folder, targets)
    assert _untouched(params)


def test_index_naming_the_wrong_file(tmp_path):
    folder = _save_sharded(tmp_path / "ckpt", _tensors())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    # Sorted names go to shards alternately: norm is in shard 1, k_proj in shard 2.
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"][f"{ATTN}.k_proj.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatch, match="files that do not hold them") as err:
        load_checkpoint(folder, _fused_targets()[0])
    assert "model.norm.weight" in str(err.value) and "k_proj.weight" in str(err.value)


def test_no_safetensors_file(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(InvalidRequest, match="empty"):
        checkpoint_files(folder)
    with pytest.raises(InvalidRequest, match="safetensors"):
        load_checkpoint(folder, {})


def test_not_a_folder(tmp_path):
    with pytest.raises(InvalidRequest, match="nowhere"):
        load_checkpoint(tmp_path / "nowhere", {})


def test_meta_params_are_refused(tmp_path):
    folder = _save_single(tmp_path / "ckpt", {"a": torch.ones(2)})
    with pytest.raises(InvalidRequest, match="meta"):
        load_checkpoint(folder, {"a": WeightTarget(torch.empty(2, device="meta"))})


# ----------------------------------------------------------------------------------------------------------
# A real transformers checkpoint


def test_sharded_transformers_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(tmp_path)) > 1
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    # Mirror the state dict, fusing each layer's q/k/v (and gate/up) the way our model does.
    targets: dict[str, WeightTarget] = {}
    fused: dict[str, tuple[torch.Tensor, list[str]]] = {}
    for layer in range(config.num_hidden_layers):
        for ours, parts in {
            "self_attn.qkv_proj.weight": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "mlp.gate_up_proj.weight": ["mlp.gate_proj", "mlp.up_proj"],
        }.items():
            names = [f"model.layers.{layer}.{p}.weight" for p in parts]
            rows = sum(state[n].shape[0] for n in names)
            param = torch.empty(rows, config.hidden_size)  # float32 [rows, hidden]
            offset = 0
            for n in names:
                targets[n] = WeightTarget(param, offset, f"layers.{layer}.{ours}")
                offset += state[n].shape[0]
            fused[f"layers.{layer}.{ours}"] = (param, names)
    tied = config.tie_word_embeddings
    for name, value in state.items():
        if name not in targets and not (tied and name == "lm_head.weight"):
            targets[name] = WeightTarget(torch.empty_like(value))

    stats = load_checkpoint(tmp_path, targets, optional=frozenset({"lm_head.weight"}))

    for name, target in targets.items():
        if name in stats.missing_optional:
            continue
        rows = target.param.narrow(0, target.row_offset, state[name].shape[0])
        assert torch.equal(rows, state[name]), name
    for param, names in fused.values():
        assert torch.equal(param, torch.cat([state[n] for n in names]))
    assert stats.tensors == len(targets) - len(stats.missing_optional)
    on_disk = sum(p.stat().st_size for p in checkpoint_files(tmp_path))
    assert 0 < stats.bytes_read <= on_disk


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_path_through_pinned_buffers_is_exact(tmp_path, monkeypatch):
    """The GPU path (memory-mapped file -> two pinned buffers -> device, dtype converted there), with a
    chunk smaller than a tensor so large tensors go through in pieces; fused targets, two files."""
    from raystate.model import checkpoint

    monkeypatch.setattr(checkpoint._PinnedStager, "CHUNK", 4096)
    gen = torch.Generator().manual_seed(0)
    a = {"q": torch.randn(40, 64, generator=gen), "k": torch.randn(24, 64, generator=gen).to(torch.bfloat16)}
    b = {"big": torch.randn(300, 64, generator=gen), "n": torch.randn(64, generator=gen)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors")
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    index = {
        "weight_map": {
            **dict.fromkeys(a, "model-00001-of-00002.safetensors"),
            **dict.fromkeys(b, "model-00002-of-00002.safetensors"),
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    fused = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
    big = torch.empty(300, 64, dtype=torch.float32, device="cuda")
    norm = torch.empty(64, dtype=torch.bfloat16, device="cuda")
    targets = {
        "q": WeightTarget(fused, 0),
        "k": WeightTarget(fused, 40),
        "big": WeightTarget(big),
        "n": WeightTarget(norm),
    }
    stats = load_checkpoint(tmp_path, targets)
    assert stats.tensors == 4
    assert torch.equal(fused.cpu(), torch.cat((a["q"].to(torch.bfloat16), a["k"])))
    assert torch.equal(big.cpu(), b["big"]) and torch.equal(norm.cpu(), b["n"].to(torch.bfloat16))
