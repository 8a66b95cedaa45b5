"""Throughput at saturation on the `bench` model (~1.1B), with the step-time breakdown by phase.

    python bench/bench_throughput.py [--requests 256] [--plot bench_throughput.png] [--json tp.json]
    python bench/bench_throughput.py --smoke --plot /tmp/tp.png   # tiny model on the CPU, ~16 requests

Workload (seeded): R requests, prompt lengths uniform in [--prompt-min, --prompt-max], output lengths
uniform in [--out-min, --out-max] (greedy, ignore_eos); a fraction `--shared` of them starts with one of
`--families` shared prefixes of `--prefix` tokens, so prefix hits (and bounded replay) are part of the mix.
All requests are added at once and the in-process engine is stepped until every one finishes.

The workload runs twice, each on a fresh engine after a short untimed warm-up (other tokens, so no prefix
hit carries over; it lets Triton's JIT compile and the CUDA caching allocator grow outside the timing):

- profile off: the headline output tokens/s and total tokens/s (prompt + output tokens over wall time);
- profile on (`engine.profile = True`): the same figures, and each step's time split into schedule,
  dispatch (message and result encode/decode), prepare, forward, sample and update (`StepTiming`). On CUDA
  profile mode synchronizes the device at the worker's phase boundaries, which costs a little: the
  tokens/s of the two runs side by side show how much.

On CUDA the copy bandwidth and bf16 matmul rate come first (bench_decode's functions). On the CPU
(`--device cpu`, implied by `--smoke`) the kernels' PyTorch references run: the script sets
RAYSTATE_KERNELS=reference unless it is set, so a TRITON_INTERPRET=1 in the environment does not slow it
down to the interpreter.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass

import numpy as np
from bench_prefix import ceilings, engine_bench_parser, print_ceilings

OTHER = "other"  # step time outside the six phases: loop and call overhead


@dataclass(frozen=True)
class Shape:
    """The workload's lengths, fixed by the seed; token contents are drawn per run from `tokens`."""

    prompt_lens: list[int]
    output_lens: list[int]
    family: list[int]  # shared-prefix family per request, -1: none


def make_shape(args, rng: np.random.Generator) -> Shape:
    n = args.requests
    prompt_lens = rng.integers(args.prompt_min, args.prompt_max + 1, n).tolist()
    output_lens = rng.integers(args.out_min, args.out_max + 1, n).tolist()
    shared = rng.random(n) < args.shared
    family = [int(i % args.families) if s else -1 for i, s in enumerate(shared)]
    # A request of a family holds the whole prefix and some tokens of its own.
    prompt_lens = [
        max(p, args.prefix + 16) if f >= 0 else p for p, f in zip(prompt_lens, family, strict=True)
    ]
    return Shape(prompt_lens, output_lens, family)


def tokens(shape: Shape, args, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 256, args.prefix).tolist() for _ in range(args.families)]
    prompts = []
    for plen, fam in zip(shape.prompt_lens, shape.family, strict=True):
        head = prefixes[fam] if fam >= 0 else []
        prompts.append(head + rng.integers(0, 256, plen - len(head)).tolist())
    return prompts


def make_llm(args, shape: Shape):
    from raystate import LLM

    max_len = max(shape.prompt_lens) + max(shape.output_lens) + 16
    bs = args.block_size
    # Room for every request at once (no preemption), the warm-up's cached blocks being evictable.
    num_blocks = sum(-(-(p + o) // bs) + 1 for p, o in zip(shape.prompt_lens, shape.output_lens, strict=True))
    return LLM(
        model=args.model,
        device=args.device,
        backend="inprocess",
        block_size=bs,
        num_blocks=num_blocks + 16,
        max_num_seqs=min(args.max_num_seqs, args.requests),
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=max_len,
    )


def run(
    args, shape: Shape, prompts: list[list[int]], warm: list[list[int]], profile: bool
) -> tuple[dict, list]:
    """One fresh engine: the warm-up, then the workload timed; the figures and the `StepTiming`s (profile
    on; [] off)."""
    import torch

    from raystate import SamplingParams

    llm = make_llm(args, shape)
    engine = llm.engine
    for i, p in enumerate(warm):
        engine.add_request(f"warm-{i}", p, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.profile = profile
    before = engine.scheduler.stats()
    out_tokens = 0
    steps = 0
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, shape.output_lens, strict=True)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True))
    while engine.has_unfinished():
        for u in engine.step():
            out_tokens += len(u.new_token_ids)
        steps += 1
    wall = time.perf_counter() - t0
    after = engine.scheduler.stats()
    assert out_tokens == sum(shape.output_lens), (out_tokens, sum(shape.output_lens))
    prompt_tokens = sum(map(len, prompts))
    result = {
        "profile": profile,
        "wall_s": wall,
        "steps": steps,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (prompt_tokens + out_tokens) / wall,
        "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
        "replayed_tokens": after.replayed_tokens - before.replayed_tokens,
        "preemptions": after.num_preemptions - before.num_preemptions,
    }
    step_times = list(engine.step_times)
    del engine, llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, step_times


def breakdown(step_times) -> dict:
    """Mean ms per step of each phase (and `other`), and each phase's share of the mean step."""
    from raystate.engine import PHASES

    if not step_times:
        return {"steps": 0}
    n = len(step_times)
    ms = {k: 1e3 * sum(getattr(t, k) for t in step_times) / n for k in PHASES}
    step_ms = 1e3 * sum(t.total for t in step_times) / n
    ms[OTHER] = step_ms - sum(ms.values())
    return {
        "steps": n,
        "step_ms": step_ms,
        "ms_per_step": ms,
        "percent": {k: 100 * v / step_ms for k, v in ms.items()},
        "tokens_per_step": sum(t.num_tokens for t in step_times) / n,
    }


def print_breakdown(name: str, b: dict) -> None:
    if not b["steps"]:
        print(f"{name}: no steps")
        return
    print(
        f"{name}: {b['steps']} steps, mean {b['step_ms']:.3f} ms/step, {b['tokens_per_step']:.0f} tokens/step"
    )
    for k, v in b["ms_per_step"].items():
        print(f"    {k:>9} {v:9.3f} ms/step {b['percent'][k]:6.1f} %")


def plot(path: str, parts: dict[str, dict], runs: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [k for k, b in parts.items() if b["steps"]]
    bottom = np.zeros(len(names))
    for phase in parts["all steps"]["ms_per_step"]:
        vals = np.array([parts[k]["ms_per_step"][phase] for k in names])
        ax1.bar(names, vals, bottom=bottom, label=phase)
        bottom += vals
    ax1.set_ylabel("ms per step (profile on)")
    ax1.set_title("step time by phase")
    ax1.legend(fontsize=8)
    labels = ["output tokens/s", "total tokens/s"]
    x = np.arange(len(labels))
    for j, r in enumerate(runs):
        vals = [r["output_tokens_per_s"], r["total_tokens_per_s"]]
        bars = ax2.bar(x + (j - 0.5) * 0.38, vals, 0.38, label=f"profile {'on' if r['profile'] else 'off'}")
        ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.set_xticks(x, labels)
    ax2.set_title("throughput")
    ax2.margins(y=0.15)
    ax2.legend()
    fig.suptitle(f"bench_throughput: {args.model} on {args.device}, {args.requests} requests at once")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    ap = engine_bench_parser(__doc__, "tiny model on the CPU, ~16 short requests")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=4096)
    ap.add_argument("--out-min", type=int, default=32)
    ap.add_argument("--out-max", type=int, default=256)
    ap.add_argument("--shared", type=float, default=0.5, help="fraction of requests with a shared prefix")
    ap.add_argument("--families", type=int, default=8, help="distinct shared prefixes")
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="", help="PNG of the breakdown and tokens/s ('' for none)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.device, args.requests = "tiny", "cpu", 16
        args.prompt_min, args.prompt_max, args.out_min, args.out_max = 32, 192, 8, 24
        args.families, args.prefix, args.max_batched_tokens = 2, 64, 256
    if args.device == "cpu":
        os.environ.setdefault("RAYSTATE_KERNELS", "reference")
        from raystate.kernels._common import refresh_reference_switch

        refresh_reference_switch()  # the kernels read the switch once, and may be imported already

    c = ceilings(args.device)
    print_ceilings(c)
    shape = make_shape(args, np.random.default_rng(args.seed))
    prompts = tokens(shape, args, args.seed + 1)
    warm = tokens(shape, args, args.seed + 2)[: min(16, args.requests)]
    print(
        f"{args.requests} requests: {sum(shape.prompt_lens)} prompt tokens, {sum(shape.output_lens)} output "
        f"tokens, {sum(f >= 0 for f in shape.family)} with one of {args.families} shared "
        f"{args.prefix}-token prefixes"
    )
    runs = []
    step_times: list = []
    for profile in (False, True):
        r, st = run(args, shape, prompts, warm, profile)
        runs.append(r)
        if profile:
            step_times = st
        print(
            f"profile {'on ' if profile else 'off'}: {r['wall_s']:.3f} s, {r['steps']} steps, "
            f"{r['output_tokens_per_s']:.0f} output tokens/s, {r['total_tokens_per_s']:.0f} total tokens/s "
            f"(prefix hits {r['prefix_hit_tokens']} tokens, replayed {r['replayed_tokens']}, "
            f"preemptions {r['preemptions']})"
        )
    off, on = runs
    cost = 1 - on["total_tokens_per_s"] / off["total_tokens_per_s"]
    print(f"profile mode costs {100 * cost:.1f} % of tokens/s (its device syncs; noise on a busy machine)")
    parts = {
        "all steps": breakdown(step_times),
        "decode only": breakdown([t for t in step_times if t.num_rows and t.num_tokens == t.num_rows]),
        "with prefill": breakdown([t for t in step_times if t.num_tokens > t.num_rows]),
    }
    for name, b in parts.items():
        print_breakdown(name, b)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ceilings": c, "runs": runs, "breakdown": parts}, f, indent=2)
    if args.plot:
        plot(args.plot, parts, runs, args)


if __name__ == "__main__":
    main()
