"""Kernel tests run the public launchers on `device` and compare with the references on CPU copies.

On a machine without CUDA, tests/conftest.py has set TRITON_INTERPRET=1, so "cpu" tensors go through the
Triton kernels in Triton's interpreter. The fixture asserts the Triton branch is taken, so no test can
quietly compare a reference with itself.
"""

import pytest
import torch

from raystate.kernels import use_triton


@pytest.fixture
def device() -> str:
    name = "cuda" if torch.cuda.is_available() else "cpu"
    probe = torch.empty(0, device=name)
    assert use_triton(probe), "the Triton path would not run (TRITON_INTERPRET unset or RAYSTATE_KERNELS set)"
    return name


@pytest.fixture
def on_device(device):
    """Copies a CPU tensor to `device`, always a fresh copy (never an alias, also on "cpu") that keeps the
    tensor's strides, so views such as a wide buffer's first L columns reach the kernel as views."""

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device).copy_(
            tensor
        )

    return copy
