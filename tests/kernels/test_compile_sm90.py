"""The split-KV attention kernels compile for sm_90 (H100 / H200) with the Triton installed here, checked on
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
    fused = {name: r for name, r in results.items() if "fused=True" in name}
    two_launch = {name: r for name, r in results.items() if "fused=False" in name}
    assert len(fused) == len(two_launch) == 3 and sum(name.startswith("reduce") for name in results) == 3
    for name, r in fused.items():
        # The arrival count releases the partials and acquires the others'; they are read from L2.
        assert "atom.global.gpu.acq_rel.add.u32" in r["atomics"] and r["l2_loads"], name
        # The combine tail takes no shared memory beyond the key loop's (the launch policy's budget).
        assert r["shared"] == two_launch[name.replace("fused=True", "fused=False")]["shared"], name
    assert all(not r["atomics"] for r in two_launch.values())
