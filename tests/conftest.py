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

# Fixtures that start a local Ray (tests/ray) or a Ray Serve app (tests/serve): every test using one,
# directly or through another fixture, is `slow`, so `python3 dev.py test --fast` leaves it out.
# Tests that start Ray in a subprocess carry `@pytest.mark.slow` themselves.
RAY_FIXTURES = ("local_ray", "serve_port")


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` deselection reads the markers
def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in RAY_FIXTURES):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
