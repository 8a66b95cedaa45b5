"""Where paged_attention's host time goes on an eager call (no CUDA graph): cProfile over 300 calls of a
decode launch (batch 1 and 64 at 8k context, split and unsplit) and a prefill launch, top entries by own
time. A GPU tool: `python3 bench/profile_attention_host.py`."""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import Problem, host_us_per_call  # noqa: E402


def main() -> None:
    assert torch.cuda.is_available(), "a GPU tool"
    heads = argparse.Namespace(
        q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype="bf16", max_model_len=0
    )
    for batch, q_len, ctx in ((1, 1, 8192), (64, 1, 8192), (1, 512, 512)):
        problem = Problem(batch, q_len, ctx, 0, heads)
        host_us = host_us_per_call(problem.run, calls=300)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            problem.run()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n== B={batch} q_len={q_len} ctx={ctx}: {host_us:.1f} us of host time a call (unprofiled)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
