"""Relaunching a compiled Triton kernel without Triton's per-call dispatch.

Why: `gather_lookback`, `pad_replayed_slots` and `compute_slot_mappings` move a few KB each, so what they
cost is their launch. Triton's `JITFunction.run` pays, on every call, for decisions that only change when
the arguments' kinds change: it binds the arguments by name, specializes each one (dtype, 16-byte
alignment, int width), formats the options into the cache key, checks the kernel's globals, builds
launch metadata, and its C launcher asks the driver about every tensor pointer. Together that is most of
a small kernel's host cost, and more of it the more arguments the kernel takes.

`FastLaunch` takes that decision once per *signature* (the device, each pointer argument's dtype and
16-byte alignment, whether each int fits in 32 bits, the constexpr values): the first call of a signature
goes through `JITFunction.run` (compiling if needed) and keeps the compiled kernel; later calls hand the
kernel's own launcher the raw pointers, exactly the call `JITFunction.run` makes. Non-pointer,
non-constexpr parameters must be `do_not_specialize` (checked), so their values never pick a variant.

The direct call depends on the layout of Triton's launcher call, which is internal: it is used only with
the Triton versions it was checked on (`VERIFIED_TRITON`; `RAYSTATE_FAST_LAUNCH=1` forces it on for
another, `=0` off), only on CUDA (never under the interpreter) and only while no launch hook is set (a
profiler's); otherwise every call takes `JITFunction.run`, which gives the same result.
"""

from __future__ import annotations

import triton

from raystate.kernels._common import env_choice, interpreting

# major.minor versions whose launcher call this module reproduces (checked on an H200 with 3.6.0).
VERIFIED_TRITON = ("3.6",)
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def fast_launch_enabled() -> bool:
    """Whether FastLaunch may bypass JITFunction.run here (decided at import, see the module docstring)."""
    return _ENABLED


def _decide() -> bool:
    forced = env_choice("RAYSTATE_FAST_LAUNCH", ("0", "1", "auto"), "auto")  # checked even when unused
    if interpreting():
        return False
    if forced != "auto":
        return forced == "1"
    return ".".join(triton.__version__.split(".")[:2]) in VERIFIED_TRITON


_ENABLED = _decide()


def _no_launch_hooks() -> bool:
    """True while no launch enter/exit hook is registered (a profiler such as proton registers them).

    Triton 3.6 keeps them as `HookChain`s on `triton.knobs.runtime` (empty by default); a plain callable
    there counts as set.
    """
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class FastLaunch:
    """`FastLaunch(kernel, pointer_args)(grid, *args)` launches `kernel` on `args` like
    `kernel.run(*args, grid=grid, warmup=False)`, positionally and in the kernel's parameter order.

    `pointer_args` are the positions of the tensor arguments. Launches nothing itself beyond what the
    kernel does; never reads the device, so it is safe under CUDA graph capture (the stream is read per
    call, so a capture stream is honoured).
    """

    __slots__ = ("kernel", "_pointer_args", "_int_args", "_const_args", "_compiled", "_device", "_stream")

    def __init__(self, kernel: triton.runtime.JITFunction, pointer_args: tuple[int, ...]) -> None:
        self.kernel = kernel
        self._pointer_args = tuple(pointer_args)
        # An interpreted kernel (TRITON_INTERPRET=1) has no parameter table; it always takes kernel.run.
        params = kernel.params if _ENABLED else []
        self._const_args = tuple(p.num for p in params if p.is_constexpr)
        self._int_args = tuple(
            p.num for p in params if not p.is_constexpr and p.num not in self._pointer_args
        )
        for i in self._int_args:
            if not params[i].do_not_specialize:
                raise ValueError(
                    f"{kernel.__name__}: parameter {params[i].name!r} is neither a pointer, a constexpr "
                    "nor do_not_specialize, so its value picks a compiled variant: FastLaunch cannot key it"
                )
        # signature -> (launcher, CUfunction handle, packed metadata) of the compiled kernel
        self._compiled: dict[tuple, tuple] = {}
        self._device = self._stream = None  # the active driver's current-device and current-stream getters

    def __call__(self, grid: tuple[int, int, int], *args) -> None:
        if not _ENABLED:
            self.kernel.run(*args, grid=grid, warmup=False)
            return
        if self._device is None:
            active = triton.runtime.driver.active
            self._device, self._stream = active.get_current_device, active.get_current_stream
        device = self._device()
        call_args = list(args)
        key = [device]
        for i in self._pointer_args:
            t = args[i]
            ptr = t.data_ptr()
            call_args[i] = ptr
            key.append(t.dtype)
            key.append(not ptr & 15)
        for i in self._int_args:
            v = args[i]
            key.append(_INT32_MIN <= v <= _INT32_MAX)
        for i in self._const_args:
            key.append(args[i])
        key = tuple(key)
        compiled = self._compiled.get(key)
        if compiled is not None and _no_launch_hooks():
            launcher, function, packed_metadata = compiled
            launcher(
                grid[0],
                grid[1],
                grid[2],
                self._stream(device),
                function,
                packed_metadata,
                None,  # launch metadata: only launch hooks read it
                None,
                None,
                *call_args,
            )
            return
        kernel = self.kernel.run(*args, grid=grid, warmup=False)
        if compiled is None:
            if hasattr(kernel, "result"):  # an async compile's future
                kernel = kernel.result()
            self._compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)
