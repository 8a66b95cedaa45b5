"""Helpers shared by the kernels: sizes, the pad slot id and the choice between Triton and reference.

Kernels import torch, triton and numpy only: never ray or another part of raystate.
"""

from __future__ import annotations

import os

import torch

PAD_SLOT_ID = -1


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable `name` (unset or empty: `default`), which must be one of `choices`.

    Why: our switches are read once, at import, and a misspelt value (`RAYSTATE_PDL=off`) would otherwise
    keep the default without a word; it fails instead, naming the variable, the value and what it takes.
    """
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)} (unset: {default})")
    return value


# Triton decides interpreter or compiler when `triton.jit` wraps a kernel, i.e. when the kernel modules
# are imported right after this one; reading TRITON_INTERPRET once here keeps our choice in step with it.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# RAYSTATE_KERNELS=reference forces the PyTorch references everywhere (a debugging switch). Launchers ask
# on every launch, and os.environ.get costs about a microsecond (0.6 us set, 1.3 us unset), as much as a
# small kernel's whole launch; so the switch is read once, here, when the kernels are imported. A process
# that sets the variable later calls refresh_reference_switch() (the benches do), and a test sets
# `_reference_forced` itself (monkeypatch.setattr, which also puts it back).
_KERNELS_VAR = "RAYSTATE_KERNELS"
_reference_forced = False  # set below, by refresh_reference_switch()


def refresh_reference_switch() -> bool:
    """Reads RAYSTATE_KERNELS from os.environ again; returns whether it forces the references."""
    global _reference_forced
    _reference_forced = env_choice(_KERNELS_VAR, ("auto", "reference"), "auto") == "reference"
    return _reference_forced


refresh_reference_switch()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (decided when triton.jit runs)."""
    return _INTERPRETING


def reference_forced() -> bool:
    """True when RAYSTATE_KERNELS=reference was set at import (or at the last refresh_reference_switch)."""
    return _reference_forced


def use_triton(*tensors: torch.Tensor) -> bool:
    """Run the Triton kernel on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; else the reference.

    RAYSTATE_KERNELS=reference forces the PyTorch references everywhere (a debugging switch). Called on
    every launch, so it does no more than read the cached switch and an `is_cuda` per tensor.
    """
    if reference_forced():
        return False
    for t in tensors:
        if t.is_cuda:
            return True
    return _INTERPRETING
