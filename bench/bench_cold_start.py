"""Cold start: from `LLM(...)` to its first token, broken down by phase, with a cold and a warm Triton cache.

Each measurement runs in a fresh process (imports, CUDA context and Triton's in-memory caches all start
empty); the cold one gets an empty TRITON_CACHE_DIR, the warm ones reuse it, as a deployment whose image
ships the cache directory (or mounts a volume for it) would.

Phases (seconds): import (torch, raystate), ray (starting a local Ray; Ray backend only), the worker's
own phases (`Worker.startup_s`: weights, buffers, kv_cache, cuda_graphs, the last including the Triton
compiles or cache loads of the decode kernels), engine (everything else up to a ready LLM), first_token
(a 16-token prompt to its first generated token: the prefill kernels compile here when the cache is cold).

    python3 bench/bench_cold_start.py [--model bench] [--json out.json]
    python3 bench/bench_cold_start.py --device cpu --model tiny   # a CPU smoke run (no CUDA graphs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(model: str, backend: str, device: str) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401

    from raystate import LLM, SamplingParams

    t_import = time.perf_counter()
    ray_s = 0.0
    if backend == "ray":
        from raystate.cluster import ensure_ray

        ensure_ray(None)
        ray_s = time.perf_counter() - t_import
    t1 = time.perf_counter()
    llm = LLM(model=model, device=device, backend=backend, max_model_len=4096, num_blocks=4096)
    t2 = time.perf_counter()
    worker = llm.engine.worker.startup_s if backend == "inprocess" else {}
    out = llm.generate(
        prompt_token_ids=[list(range(16))], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False
    )
    t3 = time.perf_counter()
    assert len(out[0].token_ids) == 1
    llm.shutdown()
    phases = {"import": t_import - t0, "ray": ray_s, **worker}
    phases["engine"] = (t2 - t1) - sum(worker.values())
    phases["first_token"] = t3 - t2
    return {"backend": backend, "phases": phases, "total": t3 - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench")
    ap.add_argument("--json", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.model, args.child, args.device)), flush=True)
        return
    cache = tempfile.mkdtemp(prefix="triton-cache-")
    runs = []
    for label, backend in (("cold cache", "inprocess"), ("warm cache", "inprocess"), ("warm cache", "ray")):
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        proc = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--device", args.device, "--child", backend],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"{label} {backend}: failed")
        result = json.loads(lines[-1][len("RESULT ") :])
        result["cache"] = label
        runs.append(result)
        phases = ", ".join(f"{k} {v:.2f}" for k, v in result["phases"].items() if v)
        print(f"{backend:>9}, {label}: {result['total']:.1f} s to the first token ({phases})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
