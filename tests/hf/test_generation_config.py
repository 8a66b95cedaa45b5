"""generation_config.json -> GenerationDefaults: only what the file says."""

from __future__ import annotations

import json

import pytest

from raystate.errors import InvalidRequest
from raystate.hf import GenerationDefaults, load_generation_defaults


def _write(tmp_path, cfg) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))


def test_checkpoint_defaults(checkpoints):
    gen = load_generation_defaults(checkpoints["chatml"])
    assert gen.temperature == 0.6 and gen.top_p == 0.95 and gen.top_k == 20
    assert gen.eos_token_ids == (2, 7) and gen.do_sample is True and gen.max_new_tokens is None
    assert gen.sampling_overrides() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert gen.stop_token_ids(7) == (2, 7) and gen.stop_token_ids(9) == (2, 7, 9)


def test_missing_file_gives_empty_defaults(tmp_path):
    assert load_generation_defaults(tmp_path) == GenerationDefaults()
    assert GenerationDefaults().sampling_overrides() == {}


def test_single_eos_and_max_new_tokens(tmp_path):
    _write(tmp_path, {"eos_token_id": 1, "max_new_tokens": 256, "top_k": 0})
    gen = load_generation_defaults(tmp_path / "generation_config.json")
    assert gen.eos_token_ids == (1,) and gen.max_new_tokens == 256 and gen.top_k == 0
    assert gen.temperature is None


def test_defaults_are_frozen():
    with pytest.raises(AttributeError):
        GenerationDefaults().temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "cfg",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": "20"},
        {"eos_token_id": [1, "x"]},
        {"temperature": True},
        {"max_new_tokens": 0},
        {"do_sample": "yes"},
    ],
)
def test_bad_values_name_the_field(tmp_path, cfg):
    _write(tmp_path, cfg)
    with pytest.raises(InvalidRequest, match="generation_config.json"):
        load_generation_defaults(tmp_path)


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(InvalidRequest, match="generation_config.json"):
        load_generation_defaults(tmp_path)
