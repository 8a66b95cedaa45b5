"""Decode projections (M = 64 rows, bf16) under torch's two BLAS back-ends, cuBLAS and cuBLASLt, side by side.

The decode step's GEMMs stream their weights once per step; at M = 64 how near the copy bandwidth they get
depends on the kernel the library's heuristic picks (and whether it adds a split-K reduce launch).
`torch.backends.cuda.preferred_blas_library` picks the library for matmuls issued after it is set, so one
process times both: per projection (in a CUDA graph rotating over >= 160 MB of weight copies, so every
call reads HBM) and the whole model's chain of projections as a decode step runs them (every layer's own
weights, no attention), with the kernels each projection launches (torch.profiler).

    python3 bench/bench_blas.py --shape gemma3-4b qwen3-8b
    python3 bench/bench_blas.py --layouts    # each weight as stored ([N, K]) against transposed ([K, N])
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_decode import copy_bandwidth, graph_time_us

# (hidden, q heads x head dim, kv heads x head dim, intermediate, layers, vocab) of the real configs.
SHAPES = {
    "gemma3-4b": (2560, 8 * 256, 4 * 256, 10240, 34, 262208),
    "qwen3-8b": (4096, 32 * 128, 8 * 128, 12288, 36, 151936),
}
LIBRARIES = ("cublas", "cublaslt")
ROWS = 64


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of one layer's four projections and the head."""
    hidden, q, kv, inter, _, vocab = SHAPES[shape]
    return {
        "qkv": (hidden, q + 2 * kv),
        "o": (q, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
        "lm_head": (hidden, vocab),
    }


def kernels_of(fn) -> list[str]:
    """Names of the CUDA kernels one call of fn launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def weight_copies(k: int, n: int) -> list[torch.Tensor]:
    """Random bf16 [N, K] weights, at least two and >= 160 MB in all: a CUDA graph that cycles through
    them reads every call's weight from HBM, not from L2."""
    count = max(2, (160 << 20) // (k * n * 2))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]


def time_projection(k: int, n: int, hbm: float) -> dict:
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    bytes_ = k * n * 2
    copies = weight_copies(k, n)
    count = len(copies)
    out = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
    us = graph_time_us(lambda i: torch.nn.functional.linear(x, copies[i % count], out=out), 2 * count)
    names = kernels_of(lambda: torch.nn.functional.linear(x, copies[0], out=out))
    floor_us = bytes_ / hbm * 1e6
    return {"us": us, "of_hbm": floor_us / us, "floor_us": floor_us, "kernels": names}


def layer_weights(shape: str) -> list[dict[str, torch.Tensor]]:
    """Every layer's own four projection weights (name -> [N, K]), random."""
    proj = projections(shape)
    return [
        {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for name, (k, n) in proj.items()
         if name != "lm_head"}
        for _ in range(SHAPES[shape][4])
    ]  # fmt: skip


def time_chain(shape: str, hbm: float) -> dict:
    """Every layer's four projections in order, with their own weights (the decode step's GEMMs)."""
    proj = projections(shape)
    weights = layer_weights(shape)
    x = torch.randn(ROWS, proj["qkv"][0], device="cuda", dtype=torch.bfloat16)
    q_width = proj["o"][0]
    inter = proj["down"][0]

    def step(_i: int) -> None:
        h = x
        for w in weights:
            qkv = torch.nn.functional.linear(h, w["qkv"])
            h = torch.nn.functional.linear(qkv[:, :q_width], w["o"])
            gu = torch.nn.functional.linear(h, w["gate_up"])
            h = torch.nn.functional.linear(gu[:, :inter], w["down"])

    bytes_ = sum(t.numel() * 2 for w in weights for t in w.values())
    us = graph_time_us(step, 1, replays=10)
    floor_us = bytes_ / hbm * 1e6
    return {"us": us, "of_hbm": floor_us / us, "floor_us": floor_us, "GB": bytes_ / 1e9}


def time_layouts(k: int, n: int, hbm: float) -> dict:
    """One projection with its weight as the model stores it ([N, K], nn.Linear's: x @ W.T) and stored
    transposed ([K, N] contiguous: x @ Wt), under the library torch picks now. The two layouts are the
    same product; cuBLAS's heuristic sees a different problem (TN against NN) and may pick another kernel."""
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    weights = weight_copies(k, n)
    count = len(weights)
    transposed = [w.t().contiguous() for w in weights]  # [K, N]
    out = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
    a, b = torch.nn.functional.linear(x, weights[0]).float(), torch.mm(x, transposed[0]).float()
    assert (a - b).norm() <= 1e-2 * a.norm(), "the two layouts give different products"
    floor_us = k * n * 2 / hbm * 1e6
    row = {"floor_us": floor_us}
    calls = {
        "[N, K]": lambda i: torch.nn.functional.linear(x, weights[i % count], out=out),
        "[K, N]": lambda i: torch.mm(x, transposed[i % count], out=out),
    }
    for name, fn in calls.items():
        us = graph_time_us(fn, 2 * count)
        row[name] = {"us": us, "of_hbm": floor_us / us, "kernels": kernels_of(lambda f=fn: f(0))}
    return row


def layouts(shapes: list[str], hbm: float) -> dict:
    """time_layouts for every projection of each shape; prints one line a projection."""
    result = {}
    for shape in shapes:
        print(
            f"\n== {shape}: M = {ROWS}, bf16, weight [N, K] (as stored) against [K, N] (us; share of copy bw)"
        )
        rows = {}
        for name, (k, n) in projections(shape).items():
            row = rows[name] = time_layouts(k, n, hbm)
            a, b = row["[N, K]"], row["[K, N]"]
            print(
                f"{name:<8} floor {row['floor_us']:8.2f} us  [N, K] {a['us']:8.2f} us ({a['of_hbm']:.2f})  "
                f"[K, N] {b['us']:8.2f} us ({b['of_hbm']:.2f})  x{b['us'] / a['us']:.3f}  "
                f"{' | '.join(k[:48] for k in a['kernels'])}  ->  {' | '.join(k[:48] for k in b['kernels'])}",
                flush=True,
            )
        result[shape] = rows
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--layouts",
        action="store_true",
        help="only each weight as stored ([N, K]) against transposed ([K, N])",
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {hbm / 1e9:.0f} GB/s; torch {torch.__version__}")
    if args.layouts:
        result = {"copy_GBps": hbm / 1e9, "layouts": layouts(args.shape, hbm)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    result: dict = {"copy_GBps": hbm / 1e9, "shapes": {}}
    for shape in args.shape:
        rows: dict = {}
        for lib in LIBRARIES:
            torch.backends.cuda.preferred_blas_library(lib)
            for name, (k, n) in projections(shape).items():
                rows.setdefault(name, {})[lib] = time_projection(k, n, hbm)
            rows.setdefault("layer chain", {})[lib] = time_chain(shape, hbm)
        torch.backends.cuda.preferred_blas_library("cublas")
        torch.cuda.empty_cache()
        result["shapes"][shape] = rows
        print(f"\n== {shape}: M = {ROWS}, bf16 (us; share of copy bandwidth; kernels per call)")
        for name, by_lib in rows.items():
            floor = by_lib["cublas"]["floor_us"]
            cells = []
            for lib in LIBRARIES:
                r = by_lib[lib]
                launches = f", {len(r['kernels'])} kernel(s)" if "kernels" in r else ""
                cells.append(f"{lib}: {r['us']:9.2f} us ({r['of_hbm']:.2f}{launches})")
            ratio = by_lib["cublaslt"]["us"] / by_lib["cublas"]["us"]
            print(f"{name:<12} floor {floor:9.2f} us  " + "  ".join(cells) + f"  lt/cublas {ratio:.3f}")
        for name, by_lib in rows.items():
            for lib in LIBRARIES:
                if "kernels" in by_lib[lib]:
                    print(f"    {name:<8} {lib:<9} {' | '.join(k[:70] for k in by_lib[lib]['kernels'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
