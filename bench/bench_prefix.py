"""Prefix reuse end to end on the `bench` model (~1.1B): recompute, cache everything and SWA bounded
replay side by side in one run.

    python bench/bench_prefix.py [--requests 32] [--prefix 8192] [--new 128] [--gen 64] \
        [--plot bench_prefix.png] [--json bench_prefix.json]
    python bench/bench_prefix.py --smoke --plot /tmp/prefix.png   # tiny model on the CPU, small sizes

Workload: R requests share one prefix; each adds `--new` prompt tokens of its own and generates `--gen`
tokens (greedy, ignore_eos). Modes, each on a fresh in-process engine with the same KV pool:

- recompute: prefix caching off (`enable_prefix_caching=False`);
- cache everything: every layer's KV is cached (`swa_bounded_replay=False`, DESIGN 3.7);
- bounded replay: only the full-attention layers' KV is cached, the last W tokens of a hit are recomputed
  for the sliding-window layers (the default), once per step for all the requests that hit the same
  prefix together (shared replay: the first rebuilds the window, the others borrow it);
- bounded replay, unshared (`share_replay=False`): every request recomputes its own W tokens, as DESIGN 3.3
  reads literally. Shown for comparison; the goals are the default's.

Per mode: one warm request (the prefix and a few tokens of its own) runs to completion, so the caching
modes hold the prefix; then the R requests are added at once and the engine is stepped until all finish.
TTFT is the time from adding the R requests to the step that returns a request's first token. Before the
timed round, the same round runs once on another prefix, untimed, so Triton's JIT compiles and the CUDA
caching allocator's growth are not charged to the first mode.

Also reported: the KV bytes per cached token each caching mode keeps (from the KV cache group specs:
which groups are prefix_cacheable, times the model's per-layer KV bytes) and how many cached prefixes fit
in a pool of `--pool-gib` GiB on that count: the "4x more prefixes" claim of bounded replay for a model
with 1 full-attention layer in 4. On CUDA the copy bandwidth and bf16 matmul rate come first
(bench_decode's functions), to compare machines.

On the CPU (`--device cpu`, implied by `--smoke`) the kernels' PyTorch references run: the script sets
RAYSTATE_KERNELS=reference unless it is set, so a TRITON_INTERPRET=1 in the environment does not slow it
down to the interpreter (seconds per step).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

GOAL_REPLAY_VS_CACHE_ALL = 1.25  # replay TTFT p50 / cache-everything TTFT p50, at most
GOAL_REPLAY_VS_RECOMPUTE = 0.1  # replay TTFT p50 / recompute TTFT p50, below


@dataclass(frozen=True)
class Mode:
    name: str
    enable_prefix_caching: bool
    swa_bounded_replay: bool
    share_replay: bool = True


MODES = (
    Mode("recompute", enable_prefix_caching=False, swa_bounded_replay=True),
    Mode("cache everything", enable_prefix_caching=True, swa_bounded_replay=False),
    Mode("bounded replay", enable_prefix_caching=True, swa_bounded_replay=True),
    Mode("replay, unshared", enable_prefix_caching=True, swa_bounded_replay=True, share_replay=False),
)


@dataclass
class ModeResult:
    mode: str
    ttft_s: list[float]  # per request, in request order
    total_s: float  # adding the R requests to the last one finishing
    steps: int
    hit_tokens: list[int]  # per request: the prefix hit h its admission used (RequestUpdate)
    prefix_hit_tokens: int  # scheduler totals over the timed round
    replayed_tokens: int
    shared_replay_tokens: int
    kv_bytes_per_cached_token: int  # what the cache keeps per prefix token (0: nothing is cached)
    prefixes_in_pool: int  # cached prefixes that fit in --pool-gib GiB at that rate (0: nothing is cached)
    ttft_p50_s: float = field(init=False)
    ttft_p90_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.ttft_p50_s = float(np.percentile(self.ttft_s, 50))
        self.ttft_p90_s = float(np.percentile(self.ttft_s, 90))


def ceilings(device: str) -> dict:
    """The copy bandwidth and bf16 matmul rate of the GPU (bench_decode's measurements); {} on the CPU."""
    if not device.startswith("cuda"):
        return {}
    import torch
    from bench_decode import copy_bandwidth, matmul_rate

    return {
        "gpu": torch.cuda.get_device_name(0),
        "copy_GBps": copy_bandwidth() / 1e9,
        "bf16_matmul_TFLOPs": matmul_rate() / 1e12,
    }


def print_ceilings(c: dict) -> None:
    if c:
        print(
            f"{c['gpu']}: copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
        )
    else:
        print("cpu: no ceilings measured (PyTorch reference kernels)")


def cached_kv_bytes_per_token(model_cfg, block_size: int, mode: Mode, elt_bytes: int) -> int:
    """KV bytes per prefix token that the mode's cache keeps: k and v of every layer in a cacheable group."""
    from raystate.kv_layout import kv_cache_group_specs

    if not mode.enable_prefix_caching:
        return 0
    groups = kv_cache_group_specs(model_cfg, block_size, mode.swa_bounded_replay)
    return sum(
        2 * len(g.layer_ids) * g.num_kv_heads * g.head_dim * elt_bytes for g in groups if g.prefix_cacheable
    )


def prefixes_that_fit(model_cfg, args, mode: Mode, budget_bytes: int, elt_bytes: int) -> int:
    """Cached prefixes of args.prefix tokens that the mode's pools hold when `budget_bytes` of KV are split
    across the groups as the engine splits them (`raystate.kv_layout.plan_group_blocks`)."""
    from raystate.kv_layout import kv_cache_group_specs, plan_group_blocks

    if not mode.enable_prefix_caching:
        return 0
    groups = kv_cache_group_specs(model_cfg, args.block_size, mode.swa_bounded_replay)
    counts = plan_group_blocks(groups, budget_bytes, elt_bytes, True, args.requests, args.max_batched_tokens)
    blocks = args.prefix // args.block_size
    return min((n - 1) // blocks for g, n in zip(groups, counts, strict=True) if g.prefix_cacheable)


def drain(engine) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def run_round(engine, prefix: list[int], tails: list[list[int]], warm_tail: list[int], gen: int, tag: str):
    """Warm request with the prefix, run to completion; then every prefix + tail at once, timed."""
    from raystate import SamplingParams

    engine.add_request(f"{tag}-warm", prefix + warm_tail, SamplingParams(max_tokens=1, ignore_eos=True))
    drain(engine)
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(tails))]
    first: dict[str, float] = {}
    hits: dict[str, int] = {}
    before = engine.scheduler.stats()
    t0 = time.perf_counter()
    for rid, tail in zip(ids, tails, strict=True):
        engine.add_request(rid, prefix + tail, params)
    steps = 0
    while engine.has_unfinished():
        updates = engine.step()
        now = time.perf_counter()  # the step returned its sampled ids to the host: they are final
        steps += 1
        for u in updates:
            if u.new_token_ids and u.req_id not in first:
                first[u.req_id] = now - t0
                hits[u.req_id] = u.num_cached_tokens
    total = time.perf_counter() - t0
    after = engine.scheduler.stats()
    return (
        [first[r] for r in ids],
        total,
        steps,
        [hits[r] for r in ids],
        after.prefix_hit_tokens - before.prefix_hit_tokens,
        after.replayed_tokens - before.replayed_tokens,
        after.shared_replay_tokens - before.shared_replay_tokens,
    )


def run_mode(mode: Mode, args, rounds: list[tuple[list[int], list[list[int]], list[int]]]) -> ModeResult:
    import torch

    from raystate import LLM
    from raystate.engine_args import resolve_model
    from raystate.kv_layout import kv_block_bytes, kv_cache_group_specs

    max_len = args.prefix + args.new + args.gen + 16
    per_req = -(-max_len // args.block_size) + 1
    # One KV byte budget for every mode: every request of a round at once, the warm one and slack, in
    # every layer (what cache everything needs; the engine splits it across the groups per mode).
    elt = 2 if args.device == "cuda" else 4
    groups = kv_cache_group_specs(resolve_model(args.model).config, args.block_size, False)
    budget = ((args.requests + 2) * per_req + 16) * sum(kv_block_bytes(g, elt) for g in groups)
    llm = LLM(
        model=args.model,
        device=args.device,
        backend="inprocess",
        enable_prefix_caching=mode.enable_prefix_caching,
        swa_bounded_replay=mode.swa_bounded_replay,
        share_replay=mode.share_replay,
        block_size=args.block_size,
        kv_cache_bytes=budget,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=max_len,
    )
    engine = llm.engine
    (prefix_a, tails_a, warm_a), (prefix_b, tails_b, warm_b) = rounds
    run_round(engine, prefix_a, tails_a, warm_a, args.gen, "rehearse")
    ttft, total, steps, hits, hit_total, replayed, shared = run_round(
        engine, prefix_b, tails_b, warm_b, args.gen, "timed"
    )
    model_cfg = engine.worker.model.config
    elt = engine.worker.kv_caches[0][0].element_size()
    per_token = cached_kv_bytes_per_token(model_cfg, args.block_size, mode, elt)
    fit = prefixes_that_fit(model_cfg, args, mode, int(args.pool_gib * 2**30), elt)
    pools = engine.scheduler.shards[0].kv.pools
    print(
        f"{mode.name:>16}: KV budget {budget / 2**30:.2f} GiB, "
        f"blocks per group {[p.num_blocks for p in pools]}"
    )
    del engine, llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return ModeResult(mode.name, ttft, total, steps, hits, hit_total, replayed, shared, per_token, fit)


def plot(path: str, results: list[ModeResult], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    names = [r.mode for r in results]
    p50 = [r.ttft_p50_s * 1e3 for r in results]
    p90 = [r.ttft_p90_s * 1e3 for r in results]
    bars = ax1.bar(names, p50, color=["tab:gray", "tab:blue", "tab:green", "tab:olive"][: len(names)])
    ax1.scatter(names, p90, color="black", marker="_", s=400, label="p90", zorder=3)
    ax1.bar_label(bars, fmt="%.1f")
    ax1.margins(y=0.15)
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_title(f"{args.requests} requests, {args.prefix}-token shared prefix, {args.new} new tokens each")
    ax1.legend()
    caching = [r for r in results if r.kv_bytes_per_cached_token][:2]  # the two unshared-alike pools
    bars = ax2.bar(
        [r.mode for r in caching], [r.prefixes_in_pool for r in caching], color=["tab:blue", "tab:green"]
    )
    ax2.bar_label(bars, fmt="%d")
    ax2.margins(y=0.15)
    ax2.set_ylabel(f"cached {args.prefix}-token prefixes in {args.pool_gib:g} GiB")
    ax2.set_title("cached prefixes that fit (the engine's pool split)")
    fig.suptitle(f"bench_prefix: {args.model} on {args.device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def engine_bench_parser(doc: str, smoke_help: str) -> argparse.ArgumentParser:
    """The flags the engine benchmarks (this one, bench_throughput) share: --smoke, --model, --device."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return ap


def main() -> None:
    ap = engine_bench_parser(__doc__, "tiny model on the CPU, small sizes")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=8192, help="shared prefix tokens")
    ap.add_argument("--new", type=int, default=128, help="prompt tokens of each request's own")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--pool-gib", type=float, default=64.0, help="pool size for the prefixes-that-fit figure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="", help="PNG of TTFT and prefixes that fit ('' for none)")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.device = "tiny", "cpu"
        args.requests, args.prefix, args.new, args.gen = 4, 512, 32, 8
        args.max_batched_tokens, args.pool_gib = 256, 1.0
    if args.device == "cpu":
        os.environ.setdefault("RAYSTATE_KERNELS", "reference")
        from raystate.kernels._common import refresh_reference_switch

        refresh_reference_switch()  # the kernels read the switch once, and may be imported already

    c = ceilings(args.device)
    print_ceilings(c)
    rng = np.random.default_rng(args.seed)

    def round_tokens() -> tuple[list[int], list[list[int]], list[int]]:
        prefix = rng.integers(0, 256, args.prefix).tolist()
        tails = [rng.integers(0, 256, args.new).tolist() for _ in range(args.requests)]
        return prefix, tails, rng.integers(0, 256, 8).tolist()

    rounds = [round_tokens(), round_tokens()]  # rehearsal, timed: the same in every mode
    results = []
    for mode in MODES:
        r = run_mode(mode, args, rounds)
        results.append(r)
        print(
            f"{r.mode:>16}: TTFT p50 {r.ttft_p50_s * 1e3:9.2f} ms  p90 {r.ttft_p90_s * 1e3:9.2f} ms  "
            f"total {r.total_s:7.3f} s ({r.steps} steps)  hit {int(np.mean(r.hit_tokens))} tokens/request "
            f"(scheduler: {r.prefix_hit_tokens} hit, {r.replayed_tokens} replayed, "
            f"{r.shared_replay_tokens} borrowed)"
        )
    by = {r.mode: r for r in results}
    every, replay, recompute = by["cache everything"], by["bounded replay"], by["recompute"]
    prefix_tokens = (args.prefix // args.block_size) * args.block_size
    print(
        f"KV kept per cached prefix token, and cached {prefix_tokens}-token prefixes in a fixed pool of "
        f"{args.pool_gib:g} GiB:"
    )
    for r in (every, replay):
        print(
            f"{r.mode:>16}: {r.kv_bytes_per_cached_token} B/token "
            f"({r.kv_bytes_per_cached_token * prefix_tokens / 2**20:.1f} MiB per prefix), "
            f"{r.prefixes_in_pool} prefixes"
        )
    fit_ratio = replay.prefixes_in_pool / max(every.prefixes_in_pool, 1)
    less = every.kv_bytes_per_cached_token / replay.kv_bytes_per_cached_token
    print(
        f"bounded replay keeps {less:.2f}x less KV per cached token: {fit_ratio:.2f}x the cached prefixes "
        f"in the same {args.pool_gib:g} GiB (the window group keeps only its working set)"
    )
    r_all = replay.ttft_p50_s / every.ttft_p50_s
    r_rec = replay.ttft_p50_s / recompute.ttft_p50_s
    ok = ("met", "MISSED")
    print(
        f"TTFT p50 replay / cache everything = {r_all:.3f} (goal <= {GOAL_REPLAY_VS_CACHE_ALL}: "
        f"{ok[r_all > GOAL_REPLAY_VS_CACHE_ALL]})"
    )
    print(
        f"TTFT p50 replay / recompute        = {r_rec:.3f} (goal < {GOAL_REPLAY_VS_RECOMPUTE}: "
        f"{ok[r_rec >= GOAL_REPLAY_VS_RECOMPUTE]})"
    )
    unshared = by.get("replay, unshared")
    if unshared is not None:
        print(
            f"(replay, unshared: TTFT p50 / cache everything = {unshared.ttft_p50_s / every.ttft_p50_s:.3f}, "
            f"/ recompute = {unshared.ttft_p50_s / recompute.ttft_p50_s:.3f}; not a goal)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "ceilings": c,
                    "modes": [asdict(r) for r in results],
                    "replay_vs_cache_everything_ttft_p50": r_all,
                    "replay_vs_recompute_ttft_p50": r_rec,
                    "replay_vs_cache_everything_prefixes_in_pool": fit_ratio,
                },
                f,
                indent=2,
            )
    if args.plot:
        plot(args.plot, results, args)


if __name__ == "__main__":
    main()
