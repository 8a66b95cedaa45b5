"""`raystate generate`: one-off prompts through `LLM` in this process (the in-process backend), with every
engine flag `raystate serve` has and the structured-output flags; a bad value is one line naming it."""

from __future__ import annotations

import re

import pytest

from raystate.cli import _engine_args, build_parser, main
from raystate.engine_args import EngineArgs


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)


def test_generate_takes_the_engine_flags_and_holds_outputs_to_a_choice_or_regex(capsys):
    flags = ["generate", "--max-num-seqs", "4", "--no-enable-prefix-caching", "--max-model-len", "256"]
    assert _engine_args(build_parser().parse_args(flags)) == EngineArgs(
        max_num_seqs=4, enable_prefix_caching=False, max_model_len=256
    )
    assert main([*flags, "--prompt", "Pick:", "--choice", "yes", "--choice", "no", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"output: '(yes|no)'", out), out
    assert "max_model_len 256" in out
    assert main(["generate", "--prompt", "At:", "--regex", "[0-9]{2}:[0-9]{2}", "--max-tokens", "8"]) == 0
    assert re.search(r"output: '[0-9]{2}:[0-9]{2}'", capsys.readouterr().out)


def test_a_bad_flag_value_is_one_line_naming_it(capsys):
    assert main(["generate", "--revision", "v2"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "raystate: error: revision: must be unset: model 'tiny' is not a hub id, got 'v2'"
