"""Decode projections split over K into fp32 partials (one batched cuBLAS GEMM), against torch's own linear.

At M = 64 a projection with few output tiles (Gemma-3-4B's o and down: N = 2560) leaves most SMs idle or
makes cuBLAS add a split-K reduce launch of its own. Issuing the projection as S batched GEMMs over K
slices (`torch.bmm(..., out_dtype=torch.float32)` on strided views, no copy) gives S x the tiles, and the
S fp32 partials can be summed by the kernel that reads the projection next (a norm, the activation, the
rotation) instead of by another launch. This times, per projection, torch's linear (what the model runs
now, its reduce launch included) against the batched split at several S, each in a CUDA graph rotating
over >= 160 MB of weight copies so every call reads HBM; then the whole 34-layer chain of projections with
o and down split both ways.

    python3 bench/bench_split_gemm.py --shape gemma3-4b
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_blas import ROWS, SHAPES, kernels_of, layer_weights, projections, weight_copies
from bench_decode import copy_bandwidth, graph_time_us

from raystate.kernels.split_k import split_k_linear

SPLITS = (1, 2, 3, 4, 5, 6, 8)


def time_split(k: int, n: int, hbm: float, rows: int) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bytes_ = k * n * 2
    copies = weight_copies(k, n)
    count = len(copies)
    floor_us = bytes_ / hbm * 1e6
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    us = graph_time_us(lambda i: torch.nn.functional.linear(x, copies[i % count], out=out), 2 * count)
    names = kernels_of(lambda: torch.nn.functional.linear(x, copies[0], out=out))
    row = {"floor_us": floor_us, "linear": {"us": us, "kernels": names}}
    ref = x.float() @ copies[0].float().T
    for s in SPLITS:
        if k % s:
            continue
        err = (split_k_linear(x, copies[0], s).parts.sum(0) - ref).abs().max().item()
        us = graph_time_us(lambda i, s=s: split_k_linear(x, copies[i % count], s), 2 * count)
        names = kernels_of(lambda s=s: split_k_linear(x, copies[0], s))
        row[f"split{s}"] = {"us": us, "kernels": names, "max_err": err}
    return row


def time_chain(shape: str, weights: list[dict[str, torch.Tensor]], o_split: int, down_split: int) -> float:
    """The layers' projections as the step runs them; o and down as S-way partials when their S > 1."""
    proj = projections(shape)
    hidden, q_width, inter = proj["qkv"][0], proj["o"][0], proj["down"][0]
    x = torch.randn(ROWS, hidden, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(ROWS, q_width, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(ROWS, inter, device="cuda", dtype=torch.bfloat16)

    def project(inp: torch.Tensor, weight: torch.Tensor, splits: int) -> None:
        if splits > 1:
            split_k_linear(inp, weight, splits)
        else:
            torch.nn.functional.linear(inp, weight)

    def step(_i: int) -> None:
        for w in weights:
            project(x, w["qkv"], 1)
            project(attn, w["o"], o_split)
            project(x, w["gate_up"], 1)
            project(act, w["down"], down_split)

    return graph_time_us(step, 1, replays=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["gemma3-4b"])
    chains = ["1,1", "2,1", "3,1", "4,1", "1,2", "1,3", "1,4", "2,2", "3,3", "4,4"]
    parser.add_argument(
        "--chains", nargs="*", default=chains, help="o_split,down_split pairs (1 = torch's linear)"
    )
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 8], help="M of the per-projection times")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {hbm / 1e9:.0f} GB/s; torch {torch.__version__}")
    result: dict = {"copy_GBps": hbm / 1e9, "shapes": {}}
    for shape in args.shape:
        result["shapes"][shape] = {}
        for m in args.rows:
            table = {
                name: time_split(k, n, hbm, m)
                for name, (k, n) in projections(shape).items()
                if name != "lm_head"
            }
            result["shapes"][shape][f"M={m}"] = table
            print(f"\n== {shape}: M = {m}, bf16 weights; us per call (share of copy bandwidth)")
            for name, row in table.items():
                cells = [f"floor {row['floor_us']:6.2f}"]
                for key, r in row.items():
                    if key != "floor_us":
                        cells.append(f"{key} {r['us']:6.2f} ({row['floor_us'] / r['us']:.2f})")
                print(f"{name:<8} " + "  ".join(cells))
            for name, row in table.items():
                for key, r in row.items():
                    if key != "floor_us":
                        err = f" err {r['max_err']:.1e}" if "max_err" in r else ""
                        print(f"    {name:<8} {key:<7}{err} {' | '.join(k[:60] for k in r['kernels'])}")
        chains = {}
        weights = layer_weights(shape)
        for pair in args.chains:
            o_split, down_split = (int(v) for v in pair.split(","))
            if projections(shape)["o"][0] % o_split or projections(shape)["down"][0] % down_split:
                continue
            chains[pair] = time_chain(shape, weights, o_split, down_split)
            print(
                f"chain M = {ROWS}, o split {o_split} down split {down_split}: {chains[pair]:8.1f} us a step"
            )
        result["shapes"][shape]["chains_us"] = chains
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
