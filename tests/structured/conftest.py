"""Structured output tests run the in-process engine on the CPU with the kernels' PyTorch references."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
