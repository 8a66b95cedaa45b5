"""Helpers shared by the kernels: sizes, the pad slot id and the choice between Triton and reference.

Kernels import torch, triton and numpy only: never ray or another part of raystate.
"""

from __future__ import annotations

import os

import torch

PAD_SLOT_ID = -1

# Triton decides interpreter or compiler when `triton.jit` wraps a kernel, i.e. when the kernel modules
# are imported right after this one; reading TRITON_INTERPRET once here keeps our choice in step with it.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# RAYSTATE_KERNELS is read on every launch (tests flip it with monkeypatch.setenv between launches), so it
# must stay live, but `os.environ.get` costs about a microsecond when the variable is unset (it encodes
# the key and raises KeyError inside Mapping.get): as much as a small kernel's whole launch. os.environ
# keeps its encoded contents in `_data`, updated by every `os.environ[...] = ...` and `del`, which is how
# monkeypatch and os.environ.update change it; a dict lookup there is ~50 ns. Where that CPython detail
# is missing, the public path is taken.
_KERNELS_VAR = "RAYSTATE_KERNELS"
try:
    _KERNELS_KEY = os.environ.encodekey(_KERNELS_VAR)  # type: ignore[attr-defined]
    _REFERENCE_VALUE = os.environ.encodevalue("reference")  # type: ignore[attr-defined]
except AttributeError:  # not CPython's os._Environ
    _KERNELS_KEY = _REFERENCE_VALUE = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (decided when triton.jit runs)."""
    return _INTERPRETING


def reference_forced() -> bool:
    """True while RAYSTATE_KERNELS=reference is set in os.environ (read live, cheaply)."""
    try:
        return os.environ._data.get(_KERNELS_KEY) == _REFERENCE_VALUE  # type: ignore[attr-defined]
    except AttributeError:  # os.environ replaced by a plain mapping, or not CPython
        return os.environ.get(_KERNELS_VAR) == "reference"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Run the Triton kernel on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; else the reference.

    RAYSTATE_KERNELS=reference forces the PyTorch references everywhere (a debugging switch). Called on
    every launch, so it does no more than one dict lookup and an `is_cuda` per tensor.
    """
    if reference_forced():
        return False
    for t in tensors:
        if t.is_cuda:
            return True
    return _INTERPRETING
