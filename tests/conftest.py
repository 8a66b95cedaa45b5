"""Suite-wide set-up: on a machine without CUDA, Triton kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before raystate.kernels is imported (triton.jit reads it when a kernel is
defined), so it is set here, before any test module loads.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
