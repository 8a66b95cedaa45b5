"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

Why: in a stream (and in the CUDA graph a decode step replays) each kernel starts only after the one
before it has finished, and the GPU takes about a microsecond between the two (BENCHMARKS.md: an empty
kernel costs 1.07 us a graph node). A decode step of a 34-layer model runs ~350 kernels, so those gaps
are ~7% of it. A kernel launched as a programmatic dependent may be scheduled before its predecessor has
finished: its launch overlaps the predecessor's tail, and it waits in `griddepcontrol.wait` until the
predecessor has finished and its writes are visible.

The one rule every kernel launched this way follows (`pdl_prologue`): wait for the previous kernel, then
let the next one launch, before touching memory that a kernel of the step may write. Waiting first means
the kernel sees memory exactly as after a plain launch, and transitively so: a kernel lets its dependent
launch only once its own predecessor has finished, so when a dependent's wait returns, every kernel before
it has finished too; and before its wait, only the kernel launched just before it may still run. Most
kernels wait as their first statement; the attention kernels first read their rows' bounds
(attention.EARLY_BOUNDS), step inputs that only the host and the step's metadata write, before the first
layer, never a dependent kernel. Kernels launched plainly (cuBLAS, torch) are unaffected; a dependent
that follows one of them waits for it to finish as a plain launch would, and gains only the launch
overlap.

`RAYSTATE_PDL=0` (read at import) launches everything plainly; `set_enabled` does the same at run time
(benchmarks compare the two in one process). Off the GPU, under Triton's interpreter, on a GPU before
Hopper or a Triton without the intrinsics, kernels are launched plainly and `USE_PDL` is False.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from raystate.kernels._common import env_choice, interpreting

_enabled = env_choice("RAYSTATE_PDL", ("0", "1"), "1") == "1"


def set_enabled(enabled: bool) -> bool:
    """Turns programmatic dependent launches on or off for later launches; returns the previous setting.
    A CUDA graph keeps the launches it captured."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


@functools.lru_cache(maxsize=16)
def _device_supports(device_index: int) -> bool:
    cuda = getattr(tl.extra, "cuda", None)
    has_intrinsics = hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
    return has_intrinsics and torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel on `t`'s device is launched as a programmatic dependent (its USE_PDL)."""
    return _enabled and t.is_cuda and not interpreting() and _device_supports(t.device.index or 0)


def launch_options(pdl: bool) -> dict:
    """The launch keyword that makes a Triton launch a programmatic dependent (none when `pdl` is False,
    so a Triton without the option never sees it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """In a kernel launched with `launch_options(True)`, before it reads what a kernel of the step may
    write (as a rule its first statement): wait until the previous kernel has finished and its writes are
    visible, then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
