"""use_triton reads RAYSTATE_KERNELS live (through os.environ's own store), whichever way it is set."""

import os
from unittest import mock

import torch

from raystate.kernels import use_triton
from raystate.kernels._common import interpreting, reference_forced


def test_reference_switch_follows_every_way_of_setting_it(monkeypatch):
    probe = torch.empty(0)
    monkeypatch.delenv("RAYSTATE_KERNELS", raising=False)
    assert not reference_forced()
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    assert reference_forced() and not use_triton(probe)
    monkeypatch.setenv("RAYSTATE_KERNELS", "auto")
    assert not reference_forced()
    assert use_triton(probe) == (probe.is_cuda or interpreting())
    os.environ.update(RAYSTATE_KERNELS="reference")
    assert reference_forced()
    del os.environ["RAYSTATE_KERNELS"]
    assert not reference_forced()
    with mock.patch.dict(os.environ, {"RAYSTATE_KERNELS": "reference"}):
        assert not use_triton(probe, probe)
    assert not reference_forced()


def test_reference_switch_without_cpythons_environ_store(monkeypatch):
    """A plain mapping in place of os.environ (no `_data`) takes the public lookup."""
    monkeypatch.setattr(os, "environ", {"RAYSTATE_KERNELS": "reference"})
    assert reference_forced()
    monkeypatch.setattr(os, "environ", {})
    assert not reference_forced()
