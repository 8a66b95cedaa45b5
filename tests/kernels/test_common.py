"""use_triton reads RAYSTATE_KERNELS once (at import, or on an explicit refresh), never per launch."""

import os
import subprocess
import sys

import pytest
import torch

from raystate.kernels import use_triton
from raystate.kernels._common import env_choice, interpreting, reference_forced, refresh_reference_switch


def test_the_switch_is_read_at_import():
    code = "from raystate.kernels._common import reference_forced; print(reference_forced())"
    for value, forced in (("reference", "True"), ("auto", "False"), (None, "False")):
        env = {k: v for k, v in os.environ.items() if k != "RAYSTATE_KERNELS"}
        if value is not None:
            env["RAYSTATE_KERNELS"] = value
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == forced, value


def test_a_later_write_counts_only_after_a_refresh(monkeypatch):
    probe = torch.empty(0)
    monkeypatch.delenv("RAYSTATE_KERNELS", raising=False)
    try:
        assert not refresh_reference_switch() and not reference_forced()
        assert use_triton(probe) == (probe.is_cuda or interpreting())
        monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
        assert not reference_forced()  # no os.environ read per launch
        assert refresh_reference_switch() and reference_forced() and not use_triton(probe, probe)
        monkeypatch.setenv("RAYSTATE_KERNELS", "auto")
        assert not refresh_reference_switch() and use_triton(probe) == (probe.is_cuda or interpreting())
    finally:
        monkeypatch.undo()
        refresh_reference_switch()


def test_tests_set_the_switch_through_monkeypatch(monkeypatch):
    """What the suite's fixtures do (with the variable set too, for the processes they start)."""
    probe = torch.empty(0)
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    assert reference_forced() and not use_triton(probe)


def test_env_choice_takes_a_listed_value_or_the_default(monkeypatch):
    monkeypatch.delenv("RAYSTATE_TEST_SWITCH", raising=False)
    assert env_choice("RAYSTATE_TEST_SWITCH", ("0", "1"), "1") == "1"
    monkeypatch.setenv("RAYSTATE_TEST_SWITCH", "")
    assert env_choice("RAYSTATE_TEST_SWITCH", ("0", "1"), "1") == "1"
    monkeypatch.setenv("RAYSTATE_TEST_SWITCH", "0")
    assert env_choice("RAYSTATE_TEST_SWITCH", ("0", "1"), "1") == "0"
    monkeypatch.setenv("RAYSTATE_TEST_SWITCH", "off")
    with pytest.raises(ValueError, match=r"RAYSTATE_TEST_SWITCH='off': expected one of 0, 1 \(unset: 1\)"):
        env_choice("RAYSTATE_TEST_SWITCH", ("0", "1"), "1")


@pytest.mark.parametrize(
    "name, module",
    [
        ("RAYSTATE_KERNELS", "raystate.kernels"),
        ("RAYSTATE_PDL", "raystate.kernels._pdl"),
        ("RAYSTATE_SPLIT_K", "raystate.kernels.split_k"),
        ("RAYSTATE_FAST_LAUNCH", "raystate.kernels._launch"),
        ("RAYSTATE_WEIGHT_LAYOUT", "raystate.model.weight_layout"),
    ],
)
def test_a_misspelt_switch_fails_at_import_naming_it(name, module):
    """Each switch read at import refuses a value it does not take instead of keeping its default."""
    env = {**os.environ, name: "of"}
    out = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert f"{name}='of': expected one of" in out.stderr
