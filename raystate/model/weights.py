"""Seeded initialisation, saving and loading of `TinyHybrid` weights.

A named config ("tiny", "bench") has no checkpoint: its weights are drawn from a seed, so every worker,
test and benchmark that names the same config and seed gets the same model without shipping files. The
model is built on the meta device and materialised directly on the target device, and the draws run
there too, so the ~1B-parameter "bench" model initialises in seconds on a GPU. Draws on the CPU do not
depend on the thread count; CPU and CUDA draws differ (different generators).

A directory holds `config.json` (`ModelConfig.to_dict`) and `model.safetensors` (the state dict; engram
hash constants are derived from the config and not saved).
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import load_file, save_file

from raystate.config import ModelConfig
from raystate.errors import InvalidRequest
from raystate.model.transformer import TinyHybrid
from raystate.model.weight_layout import store_projections_column_major

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Config fields that may differ between a checkpoint and the config it is served with.
_SERVING_FIELDS = ("name", "max_model_len", "seed")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise InvalidRequest("dtype", f"a torch.dtype or one of {sorted(_DTYPES)}", dtype)
    return _DTYPES[dtype]


def empty_model(config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """A TinyHybrid with uninitialised weights on `device` (engram hash buffers are built)."""
    with torch.device("meta"):
        model = TinyHybrid(config)
    model = model.to_empty(device=torch.device(device)).to(dtype)
    model.reset_hash_buffers()
    return model


def _init_std(name: str, param: torch.Tensor, config: ModelConfig) -> float | None:
    """Standard deviation of a parameter's normal draw; None for norm gains (set to one).

    Projections get 1/sqrt(fan_in); those that write into the residual stream are scaled down further by
    sqrt(2 * num_layers) so the stream's scale stays O(1) through the depth.
    """
    if name.endswith("norm.weight"):
        return None
    if name == "embed.weight" or name.endswith("engram.table"):
        return 1.0
    std = 1.0 / math.sqrt(param.shape[1])
    if name.endswith(("o_proj.weight", "down_proj.weight", "value_proj.weight")):
        std /= math.sqrt(2 * config.num_layers)
    return std


@torch.no_grad()
def init_weights(model: TinyHybrid, seed: int) -> TinyHybrid:
    """Fills every parameter from one generator seeded with `seed`, on the parameters' device.

    Parameters are drawn in fp32 in registration order and then cast, so a bf16 model holds the rounded
    fp32 weights of the same seed.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        std = _init_std(name, param, model.config)
        if std is None:
            param.fill_(1.0)
            continue
        draw = torch.empty(param.shape, dtype=torch.float32, device=device)
        draw.normal_(0.0, std, generator=gen)
        param.copy_(draw)
    return model


def save_pretrained(model: TinyHybrid, directory: str | os.PathLike) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(model.config.to_dict(), f, indent=2)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})


def _check_serving_config(saved: ModelConfig, given: ModelConfig, directory: str) -> None:
    a = {k: v for k, v in saved.to_dict().items() if k not in _SERVING_FIELDS}
    b = {k: v for k, v in given.to_dict().items() if k not in _SERVING_FIELDS}
    diff = sorted(k for k in a if a[k] != b[k])
    if diff:
        raise InvalidRequest("config", f"the shape saved in {directory} (fields {diff} differ)", given)


def is_model_dir(path: str | os.PathLike) -> bool:
    """A save_pretrained directory: one holding config.json. A plain folder that happens to share a named
    config's name (a repo's bench/ folder, say) is not one."""
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def load_model(
    name_or_dir: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int | None = None,
    config: ModelConfig | None = None,
) -> torch.nn.Module:
    """A save_pretrained directory -> its config and weights; a named config -> weights drawn from `seed`;
    a Hugging Face checkpoint folder (or `config` of a Hugging Face family) -> `DecoderLM` with its weights.

    `config` overrides the config a name or directory gives (e.g. a shorter max_model_len); for a
    directory it must keep the saved shape. `seed` defaults to the config's seed.
    """
    dtype = _resolve_dtype(dtype)
    path = os.fspath(name_or_dir)
    hf_config = config if config is not None and config.architecture != "raystate_hybrid" else None
    if hf_config is None and is_model_dir(path):
        from raystate.hf.model_config import is_hf_config, model_config_from_hf

        with open(os.path.join(path, CONFIG_FILE)) as f:
            raw = json.load(f)
        if is_hf_config(raw):
            hf_config = model_config_from_hf(raw, name=os.path.basename(os.path.normpath(path)))
    if hf_config is not None:  # a Hugging Face checkpoint: DecoderLM, its safetensors
        from raystate.model.hf_weights import load_hf_model

        return store_projections_column_major(load_hf_model(path, hf_config, device, dtype)[0])
    if is_model_dir(path):
        with open(os.path.join(path, CONFIG_FILE)) as f:
            saved = ModelConfig.from_dict(json.load(f))
        if config is not None:
            _check_serving_config(saved, config, path)
        model = empty_model(config or saved, device, dtype)
        state = load_file(os.path.join(path, WEIGHTS_FILE), device=str(torch.device(device)))
        model.load_state_dict(state, strict=True)
    else:
        cfg = config if config is not None else ModelConfig.named(path)
        model = empty_model(cfg, device, torch.float32)
        init_weights(model, cfg.seed if seed is None else seed)
        model = model.to(dtype)
    return store_projections_column_major(model.eval())
