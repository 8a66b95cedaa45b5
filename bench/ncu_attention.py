"""One batch-64 decode attention launch of Gemma-3-4B's heads, for Nsight Compute (ncu).

Why: a decode attention launch costs ~6 us beyond a plain read of its bytes (BENCHMARKS.md, "What one
decode attention launch costs beyond its bytes"), and timing variants has not placed that time; ncu's
warp-state and memory sections do. Runs a few warm-up launches, then the launch ncu is told to keep:

    ncu --clock-control none --kernel-name regex:_paged_attention --launch-skip 3 --launch-count 1 \
        --set full -o out/attn python3 bench/ncu_attention.py --window 1024
    ncu --import out/attn.ncu-rep --page details > out/attn.txt

`bash bench/gpu_run.sh ncu_attention` runs both windows (1024 and the full 4k) that way.
"""

from __future__ import annotations

import argparse

import torch
from bench_attention import Problem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=1024, help="sliding window (0: full attention)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    heads = argparse.Namespace(q_heads=8, kv_heads=4, head_dim=256, block_size=16, dtype="bf16")
    problem = Problem(args.batch, 1, args.context, args.window, heads)
    for _ in range(4):  # 3 warm-up launches (compile, caches), then the one ncu keeps
        problem.run()
    torch.cuda.synchronize()
    print(f"ran B={args.batch} ctx={args.context} W={args.window}: {problem.policy_plan()}")


if __name__ == "__main__":
    main()
