"""Compiles the split-KV attention kernels, and what paged_attention's launcher launches, for an
H100/H200 (sm_90) on a machine without a GPU, launching nothing: CI has no GPU, and Triton's interpreter
runs code that the compiler may still reject (it also takes keyword arguments a kernel does not have).
Run by test_compile_sm90.py in a process of its own (TRITON_INTERPRET unset: the kernels must be jitted,
not interpreted). Prints one JSON object: per variant, the shared memory it takes and what its PTX holds.
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch


def fake_sm90_driver():
    """The CUDA driver as far as compiling goes: its target is sm_90; it never loads libcuda."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class CompileOnlyCuda(CudaDriver):
        def __init__(self) -> None:  # CudaDriver's would load libcuda
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        @staticmethod
        def is_active() -> bool:
            return True

    return CompileOnlyCuda()


def main() -> None:
    assert "TRITON_INTERPRET" not in os.environ, "the kernels must be compiled, not interpreted"
    try:
        import triton.runtime

        triton.runtime.driver.set_active(fake_sm90_driver())
    except (ImportError, AttributeError) as exc:  # this Triton has no CUDA backend or another driver API
        print(json.dumps({"skip": f"{type(exc).__name__}: {exc}"}))
        return
    from raystate.kernels import attention

    results = {}
    # (q heads, kv heads, head dim, key step, stages, splits): the bench model, Gemma-3-4B, Qwen3-8B.
    for hq, hkv, d, block_n, stages, splits in [
        (16, 4, 128, 128, 1, 64),
        (16, 4, 128, 128, 2, 32),
        (8, 4, 256, 64, 3, 4),
        (32, 8, 128, 64, 2, 8),
    ]:
        rows = 8
        q = torch.empty(rows, hq, d, dtype=torch.bfloat16)
        cache = torch.empty(64, 16, hkv, d, dtype=torch.bfloat16)
        table = torch.empty(rows, 512, dtype=torch.int32)
        qsl = torch.empty(rows + 1, dtype=torch.int32)
        lens = torch.empty(rows, dtype=torch.int32)
        acc = torch.empty(rows, hq, splits, d, dtype=torch.float32)
        ml = torch.empty(rows, hq, splits, 2, dtype=torch.float32)
        group = hq // hkv
        shape = (d, d, 16, group, True, "tf32", False)

        # As shipped (the row's bounds before the PDL wait), and for one shape with them after it too.
        for early_bounds in (True, False) if splits == 32 else (True,):
            kernel = attention._split_kv_kernel.warmup(
                q, cache, cache, acc, ml, table, qsl, lens, lens, 1.0, 0, 128,
                q.stride(), cache.stride(), cache.stride(), acc.stride(), ml.stride(), table.stride(),
                SHAPE=shape, BLOCK_M=max(16, group), BLOCK_N=block_n, NUM_STAGES=stages, USE_PDL=True,
                EARLY_BOUNDS=early_bounds, num_warps=4, grid=(rows, hkv, splits),
            )  # fmt: skip
            ptx = kernel.asm["ptx"]
            if not early_bounds:  # nothing is read before the wait
                results["bounds after wait"] = {"loads_before_wait": loads_before_wait(ptx)}
                continue
            results[f"split hq{hq} hkv{hkv} d{d} N{block_n} s{stages}"] = {
                "shared": kernel.metadata.shared,
                "cubin_bytes": len(kernel.asm["cubin"]),
                "atomics": sorted(set(re.findall(r"atom\.[\w.]+", ptx))),
                "pdl": sorted(set(re.findall(r"griddepcontrol\.\w+", ptx))),
                "loads_before_wait": loads_before_wait(ptx),
            }
        d_slice = min(d, attention.COMBINE_D_SLICE)
        kernel = attention._split_combine_kernel.warmup(
            acc, ml, q, qsl, rows, splits, acc.stride(), ml.stride(), q.stride(),
            HEAD_DIM=d, D_SLICE=d_slice, CHUNK_S=triton_next_pow2(splits), USE_PDL=True, num_warps=4,
            launch_pdl=True, grid=(rows, hq, d // d_slice),
        )  # fmt: skip
        results[f"combine hq{hq} d{d} S{splits}"] = {
            "shared": kernel.metadata.shared,
            "cubin_bytes": len(kernel.asm["cubin"]),
            "pdl": sorted(set(re.findall(r"griddepcontrol\.\w+", kernel.asm["ptx"]))),
        }
    results.update(one_launch_decode(attention))
    results.update(other_kernels())
    results.update(attention_launcher_paths(attention))
    print(json.dumps(results))


def attention_launcher_paths(attention) -> dict:
    """paged_attention's own launcher (compile_only: what it launches, compiled, nothing run) for decode
    batches that take the one-launch kernel and the split path, and a prefill, with an H100's program
    count. The hand-written warmups above pass the arguments as this script spells them; these pass
    them as the launcher does, so a keyword the kernel does not take fails here, not first on a GPU."""
    from raystate.kernels import attention_launch

    attention_launch.device_shape = lambda device: (232448 - 8192, 132)  # an H100's budget and SMs
    results = {}
    hq, hkv, d, block_size, width = 16, 4, 128, 16, 512  # the bench model's heads; 8192 keys a row at most
    cache = torch.empty(64, block_size, hkv, d, dtype=torch.bfloat16)
    for rows, q_len, window in [(64, 1, 0), (64, 1, 1024), (1, 1, 0), (8, 1, 1024), (2, 64, 0)]:
        tokens = rows * q_len
        query = torch.empty(tokens, hq, d, dtype=torch.bfloat16)
        table = torch.empty(rows, width, dtype=torch.int32)
        qsl = torch.empty(rows + 1, dtype=torch.int32)
        lens = torch.empty(rows, dtype=torch.int32)
        args = (query, cache, cache, table, qsl, lens, d**-0.5, window, lens, torch.empty_like(query))
        plan = attention_launch.plan_launch(
            tokens, rows, hkv, hq // hkv, d * 2, query.device, q_len, window, None, width * block_size
        )
        attention._paged_attention_triton(args, q_len, compile_only=True)
        results[f"launcher B{rows} q{q_len} W{window}"] = {"kv_splits": plan.kv_splits}
    return results


def one_launch_decode(attention) -> dict:
    """The one-launch kernel in its decode layout (a program per row and kv head), as a programmatic
    dependent that reads the row's bounds before its wait: Gemma-3-4B's heads at batch 64."""
    rows, hq, hkv, d = 64, 8, 4, 256
    q = torch.empty(rows, hq, d, dtype=torch.bfloat16)
    cache = torch.empty(64, 16, hkv, d, dtype=torch.bfloat16)
    table = torch.empty(rows, 512, dtype=torch.int32)
    qsl = torch.empty(rows + 1, dtype=torch.int32)
    lens = torch.empty(rows, dtype=torch.int32)
    kernel = attention._paged_attention_kernel.warmup(
        q, cache, cache, q, table, qsl, lens, lens, rows, hkv, 1.0, 1024,
        q.stride(), cache.stride(), cache.stride(), q.stride(), table.stride(),
        SHAPE=(d, d, 16, hq // hkv, True, "tf32", False), TILE=(1, 16, 64, True), USE_PDL=True,
        EARLY_BOUNDS=True, num_warps=4, num_stages=2, launch_pdl=True, grid=(rows, hkv),
    )  # fmt: skip
    ptx = kernel.asm["ptx"]
    return {
        "one-launch decode": {
            "cubin_bytes": len(kernel.asm["cubin"]),
            "pdl": sorted(set(re.findall(r"griddepcontrol\.\w+", ptx))),
            "loads_before_wait": loads_before_wait(ptx),
        }
    }


def other_kernels() -> dict:
    """Small kernels of a decode step, launched as programmatic dependents: what their PTX holds."""
    from raystate.kernels import greedy, norm

    x = torch.empty(64, 2560, dtype=torch.bfloat16)
    w = torch.empty(2560, dtype=torch.bfloat16)
    compiled = {
        "rms_norm": norm._rms_norm_kernel.warmup(
            x, x, x, x, w, w, 2560, 0, 2560, 2560, 1e-6, 1.0, X_SPLITS=0, HAS_RESIDUAL=True, PRE_NORM=True,
            BLOCK=4096, USE_PDL=True, launch_pdl=True, grid=(64,),
        ),
        "rms_norm of split-K partials": norm._rms_norm_kernel.warmup(
            torch.empty(4, 64, 2560), x, x, x, w, w, 2560, 64 * 2560, 2560, 2560, 1e-6, 1.0, X_SPLITS=4,
            HAS_RESIDUAL=True, PRE_NORM=True, BLOCK=4096, USE_PDL=True, launch_pdl=True, grid=(64,),
        ),
        "greedy chunk max": greedy._chunk_max_kernel.warmup(
            x, torch.empty(64, 1), torch.empty(64, 1, dtype=torch.int32), 2560, 2560, 1, BLOCK=4096,
            USE_PDL=True, num_warps=8, launch_pdl=True, grid=(64, 1),
        ),
        "greedy row pick": greedy._row_pick_kernel.warmup(
            torch.empty(64, 1), torch.empty(64, 1, dtype=torch.int32), torch.empty(64, dtype=torch.int64),
            1, -2, BLOCK_C=1, USE_PDL=True, launch_pdl=True, grid=(64,),
        ),
    }  # fmt: skip
    return {
        name: {
            "cubin_bytes": len(k.asm["cubin"]),
            "pdl": sorted(set(re.findall(r"griddepcontrol\.\w+", k.asm["ptx"]))),
        }
        for name, k in compiled.items()
    }


def loads_before_wait(ptx: str) -> int:
    """Global loads the compiled code issues before griddepcontrol.wait (attention.EARLY_BOUNDS: the row's
    bounds; the compiler must not move them past the wait, nor
    the query or KV loads before it)."""
    head, _, _ = ptx.partition("griddepcontrol.wait")
    return len(re.findall(r"\bld\.global", head))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if __name__ == "__main__":
    sys.exit(main())
