"""Helpers shared by the kernels: sizes, the pad slot id and the choice between Triton and reference.

Kernels import torch, triton and numpy only: never ray or another part of raystate.
"""

from __future__ import annotations

import os

import torch

PAD_SLOT_ID = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (decided when triton.jit runs)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Run the Triton kernel on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1; else the reference.

    RAYSTATE_KERNELS=reference forces the PyTorch references everywhere (a debugging switch).
    """
    if os.environ.get("RAYSTATE_KERNELS", "auto") == "reference":
        return False
    if any(t.is_cuda for t in tensors):
        return True
    return interpreting()
