"""Suite-wide set-up: on a machine without CUDA, Triton kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before raystate.kernels is imported (triton.jit reads it when a kernel is
defined), so it is set here, before any test module loads.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _refuse_unknown_kernel_keywords() -> None:
    """Makes Triton's interpreter refuse a keyword argument that is neither a parameter of the kernel nor
    a launch option, as the compiler does.

    Why: the interpreter drops every keyword the kernel lacks (it must let num_warps and the like pass),
    so a launcher that passes a keyword its kernel does not take ran fine on the CPU and failed on every
    GPU launch (ed0e188 passed the split kernel's GUESS_BLOCKS to the one-launch kernel too). Launch
    options are the fields of the CUDA backend's options, which the CPU build of Triton also ships.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import dataclasses

    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # another Triton layout: the GPU run still checks
        return
    launch_options = {f.name for f in dataclasses.fields(CUDAOptions)}
    interpreted_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        unknown = sorted(set(kwargs) - set(self.arg_names) - launch_options)
        if unknown:
            raise TypeError(
                f"{self.fn.__name__} takes no keyword argument {', '.join(unknown)} "
                "(neither a parameter of the kernel nor a launch option)"
            )
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


_refuse_unknown_kernel_keywords()

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
