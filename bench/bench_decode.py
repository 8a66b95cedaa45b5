"""End-to-end decode step of the `bench` model (~1B) on one GPU: CUDA graphs with and without async
scheduling, and eager.

Measures, in one run: the two ceilings (device-to-device copy bandwidth, bf16 matmul rate), then a
decode batch of B requests at C tokens of context through the in-process engine, and reports the decode
step time against its floor: (weight bytes + KV bytes the step must read) / copy bandwidth.

    python3 bench/bench_decode.py [--batch 64] [--context 2048] [--steps 32] [--plot decode.png]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import triton.testing

from raystate import LLM, SamplingParams


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def decode_floor_bytes(llm: LLM, batch: int, context: int) -> tuple[int, int]:
    model = llm.engine.worker.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    elt = next(model.parameters()).element_size()
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * elt  # k and v of one layer
    kv = 0
    for t in cfg.layer_types:
        kv += per_token * (min(context, cfg.sliding_window) if t == "sliding" else context)
    return weights, kv * batch


def run(
    graphs: bool, async_scheduling: bool, batch: int, context: int, steps: int
) -> tuple[list[float], LLM, list[list[int]]]:
    max_len = context + steps + 16
    blocks = batch * (-(-max_len // 16) + 1) + 1
    llm = LLM(
        model="bench",
        device="cuda",
        backend="inprocess",
        cuda_graphs=graphs,
        async_scheduling=async_scheduling,
        max_num_seqs=batch,
        max_model_len=max_len,
        num_blocks=blocks,
        max_num_batched_tokens=8192,
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, context).tolist() for _ in range(batch)]
    engine = llm.engine
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}
    # Step time = the interval between successive step() calls once every request decodes, with no
    # device sync in the loop (a sync would stop async scheduling's overlap): in steady state the loop
    # runs at the pace of the slower of host and device, which is the rate a server would see.
    times = []
    last = None
    while engine.has_unfinished():
        decoding = all(len(v) > 0 for v in tokens.values())
        updates = engine.step()
        now = time.perf_counter()
        if decoding and last is not None:
            times.append(now - last)
        last = now if decoding else None
        for u in updates:
            tokens[u.req_id].extend(u.new_token_ids)
    torch.cuda.synchronize()
    return times, llm, [tokens[f"r{i}"] for i in range(batch)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--plot", default="", help="PNG of step time per configuration against the floor")
    args = ap.parse_args()
    bw = copy_bandwidth()
    flops = matmul_rate()
    name = torch.cuda.get_device_name(0)
    print(f"{name}: copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    results = {}
    medians: dict[tuple[bool, bool], float] = {}
    floor = 0.0
    for graphs, async_scheduling in ((True, True), (True, False), (False, False)):
        times, llm, toks = run(graphs, async_scheduling, args.batch, args.context, args.steps)
        weights, kv = decode_floor_bytes(llm, args.batch, args.context)
        floor = (weights + kv) / bw
        med = statistics.median(times[2:])
        results[(graphs, async_scheduling)] = toks
        medians[(graphs, async_scheduling)] = med
        print(
            f"decode B={args.batch} ctx={args.context} graphs={graphs} async={async_scheduling}: "
            f"step median {med * 1e3:.3f} ms "
            f"(p90 {np.percentile(times, 90) * 1e3:.3f}), floor {floor * 1e3:.3f} ms "
            f"(weights {weights / 1e9:.2f} GB + KV {kv / 1e9:.2f} GB), {med / floor:.2f}x the floor, "
            f"{args.batch / med:.0f} tokens/s"
        )
        del llm
        torch.cuda.empty_cache()
    base = results[(False, False)]
    for key in ((True, True), (True, False)):
        same = sum(a == b for a, b in zip(results[key], base, strict=True))
        print(f"graphs={key[0]} async={key[1]} vs eager: {same}/{args.batch} requests with identical tokens")
    if args.plot:
        plot(args.plot, medians, floor, args, name)


def plot(path: str, medians: dict[tuple[bool, bool], float], floor: float, args, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {(True, True): "graphs + async", (True, False): "graphs", (False, False): "eager"}
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [labels[k] for k in medians]
    ms = [v * 1e3 for v in medians.values()]
    bars = ax.bar(names, ms, color=["tab:green", "tab:blue", "tab:gray"])
    ax.bar_label(bars, labels=[f"{v:.2f} ms ({v / (floor * 1e3):.1f}x)" for v in ms])
    ax.axhline(floor * 1e3, color="black", linestyle="--", label=f"floor {floor * 1e3:.2f} ms")
    ax.axhline(1.5 * floor * 1e3, color="tab:red", linestyle=":", label="goal: 1.5x the floor")
    ax.set_yscale("log")
    ax.set_ylabel("decode step (ms, log)")
    ax.set_title(f"bench model, batch {args.batch}, {args.context} context, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
