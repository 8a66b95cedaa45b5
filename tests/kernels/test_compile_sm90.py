"""The split-KV attention kernels (and, launched as programmatic dependents, the norm and greedy kernels)
compile for sm_90 (H100 / H200) with the Triton installed here, checked on
a machine without a GPU: the interpreter, which runs every other kernel test on the CPU, accepts code
that the compiler may still reject. compile_sm90.py compiles them in a process without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_split_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    script = Path(__file__).with_name("compile_sm90.py")
    proc = subprocess.run(
        [sys.executable, "-P", str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in results:
        pytest.skip(f"no sm_90 compiler in this Triton: {results['skip']}")
    split = {name: r for name, r in results.items() if name.startswith("split")}
    combine = {name: r for name, r in results.items() if name.startswith("combine")}
    assert len(split) == len(combine) == 4
    for name, r in split.items():
        # No atomics (each split writes its own partials); shared memory within an H200 program's
        # budget as attention_launch.device_limits reports it (232448 bytes less 8 KiB).
        assert not r["atomics"] and r["cubin_bytes"] > 0, name
        assert 0 < r["shared"] <= 232448 - 8192, name
    # Launched as programmatic dependents, every kernel waits for the one before it and then lets the
    # next one launch (raystate.kernels._pdl): both intrinsics in each.
    both = ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
    for name, r in {**split, **combine}.items():
        assert r["pdl"] == both and r["cubin_bytes"] > 0, name
    # What the decode kernels read before the wait, counted in the PTX (the compiler keeps the order):
    # with attention.EARLY_BOUNDS, as shipped, the row's bounds, three or four int32 loads
    # (query_start_loc twice, seq_lens, kv_floor), and nothing else (the query and the KV, which the
    # previous kernel may write, after it); without, nothing.
    one_launch = results["one-launch decode"]
    assert one_launch["pdl"] == both, one_launch
    for name, r in {**split, "one-launch decode": one_launch}.items():
        assert 3 <= r["loads_before_wait"] <= 4, (name, r["loads_before_wait"])
    assert results["bounds after wait"]["loads_before_wait"] == 0
    # paged_attention's launcher compiles what it launches: the one-launch kernel for batch 64 and the
    # prefill, the split path for the small decode batches (a keyword the kernel lacks would fail here).
    launcher = {name: r["kv_splits"] for name, r in results.items() if name.startswith("launcher")}
    assert sorted(launcher) == [
        "launcher B1 q1 W0",
        "launcher B2 q64 W0",
        "launcher B64 q1 W0",
        "launcher B64 q1 W1024",
        "launcher B8 q1 W1024",
    ]
    unsplit = sorted(name for name, splits in launcher.items() if splits == 1)
    assert unsplit == ["launcher B2 q64 W0", "launcher B64 q1 W0", "launcher B64 q1 W1024"]
    others = {
        name: r
        for name, r in results.items()
        if not name.startswith(("split", "combine", "launcher", "one-launch", "bounds after"))
    }
    assert sorted(others) == [
        "greedy chunk max",
        "greedy row pick",
        "rms_norm",
        "rms_norm of split-K partials",
    ]
    for name, r in others.items():
        assert r["pdl"] == both and r["cubin_bytes"] > 0, name
