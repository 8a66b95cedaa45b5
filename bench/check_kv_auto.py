"""The KV cache sized from a GPU's real memory (`gpu_memory_utilization`), checked on the device: for each
share and backend, the KV line the engine prints, the device's memory in use once it has started and
after a batch of requests (every process on the device, as `torch.cuda.mem_get_info` sees it), and that
the requests ran.

    python bench/check_kv_auto.py --model bench --shares 0.9 0.5 --backends inprocess ray ray2

`ray2`: the Ray backend with two shards sharing the GPU (num_gpus_per_shard 0.5), at the default share
(each shard takes half of it) and then at each `--shares` value given to both (which fails above 0.45
each: the second shard finds too little free).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from raystate import LLM, SamplingParams


def in_use_gib() -> tuple[float, float]:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30, total / 2**30


def settle(baseline_gib: float, timeout_s: float = 30.0) -> None:
    """Frees this process's cached blocks and waits until the device is back to what was in use before
    the first run (shutdown returns once the local workers' processes exited; a refused start killed
    its workers the same way), saying so if it is not."""
    gc.collect()
    torch.cuda.empty_cache()
    deadline = time.monotonic() + timeout_s
    while (used := in_use_gib()[0]) > baseline_gib + 1.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if used > baseline_gib + 1.0:
        print(f"  warning: {used:.1f} GiB in use before the next run, {baseline_gib:.1f} at the start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench")
    p.add_argument("--shares", type=float, nargs="+", default=[0.9, 0.5])
    p.add_argument("--backends", nargs="+", default=["inprocess", "ray"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--requests", type=int, default=64)
    args = p.parse_args()
    runs = [(share, backend) for share in args.shares for backend in args.backends]
    if "ray2" in args.backends:
        runs.insert(0, (None, "ray2"))
    baseline, _ = in_use_gib()
    for share, backend in runs:
        settle(baseline)
        t0 = time.perf_counter()
        shared = backend == "ray2"
        try:
            llm = LLM(
                model=args.model,
                device="cuda",
                backend="ray" if shared else backend,
                num_shards=2 if shared else 1,
                ray_options={"num_gpus_per_shard": 0.5} if shared else None,
                gpu_memory_utilization=share,
                max_num_seqs=args.max_num_seqs,
            )
        except Exception as e:  # an oversized share is refused: print the error
            print(f"share {share} {backend}: refused: {e}")
            print(f"  device in use right after the refusal: {in_use_gib()[0]:.1f} GiB")
            continue
        started_s = time.perf_counter() - t0
        used, total = in_use_gib()
        print(f"share {share} {backend}: started in {started_s:.1f} s; {llm.config.kv_summary()}")
        print(f"  device in use after start: {used:.1f} of {total:.1f} GiB ({used / total:.3f})")
        prompts = [[(7 * i + j) % 250 for j in range(100 + 13 * i)] for i in range(args.requests)]
        outs = llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(max_tokens=32, ignore_eos=True),
            use_tqdm=False,
        )
        used, _ = in_use_gib()
        ran = sum(len(o.token_ids) == 32 for o in outs)
        print(f"  after {args.requests} requests: {ran} ran to 32 tokens; in use {used:.1f} GiB")
        llm.shutdown()
        print(f"  device in use right after shutdown: {in_use_gib()[0]:.1f} GiB")
        del llm, outs


if __name__ == "__main__":
    main()
