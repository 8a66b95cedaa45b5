"""End-to-end decode step of the `bench` model (~1B) on one GPU, with and without CUDA graphs.

Measures, in one run: the two ceilings (device-to-device copy bandwidth, bf16 matmul rate), then a
decode batch of B requests at C tokens of context through the in-process engine, and reports the decode
step time against its floor: (weight bytes + KV bytes the step must read) / copy bandwidth.

    python3 bench/bench_decode.py [--batch 64] [--context 2048] [--steps 32]
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


def run(graphs: bool, batch: int, context: int, steps: int) -> tuple[list[float], LLM, list[list[int]]]:
    max_len = context + steps + 16
    blocks = batch * (-(-max_len // 16) + 1) + 1
    llm = LLM(
        model="bench",
        device="cuda",
        backend="inprocess",
        cuda_graphs=graphs,
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
    times = []
    while engine.has_unfinished():
        decoding = all(len(v) > 0 for v in tokens.values())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        updates = engine.step()
        torch.cuda.synchronize()
        if decoding:
            times.append(time.perf_counter() - t0)
        for u in updates:
            tokens[u.req_id].extend(u.new_token_ids)
    return times, llm, [tokens[f"r{i}"] for i in range(batch)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    bw = copy_bandwidth()
    flops = matmul_rate()
    name = torch.cuda.get_device_name(0)
    print(f"{name}: copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    results = {}
    for graphs in (True, False):
        times, llm, toks = run(graphs, args.batch, args.context, args.steps)
        weights, kv = decode_floor_bytes(llm, args.batch, args.context)
        floor = (weights + kv) / bw
        med = statistics.median(times[2:])
        results[graphs] = toks
        print(
            f"decode B={args.batch} ctx={args.context} graphs={graphs}: step median {med * 1e3:.3f} ms "
            f"(p90 {np.percentile(times, 90) * 1e3:.3f}), floor {floor * 1e3:.3f} ms "
            f"(weights {weights / 1e9:.2f} GB + KV {kv / 1e9:.2f} GB), {med / floor:.2f}x the floor, "
            f"{args.batch / med:.0f} tokens/s"
        )
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(results[True], results[False], strict=True))
    print(f"graphs vs eager: {same}/{args.batch} requests with identical greedy tokens (bf16)")


if __name__ == "__main__":
    main()
