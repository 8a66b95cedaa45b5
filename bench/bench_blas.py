"""Decode projections (M = 64 rows, bf16) under torch's two BLAS back-ends, cuBLAS and cuBLASLt, side by side.

The decode step's GEMMs stream their weights once per step; at M = 64 how near the copy bandwidth they get
depends on the kernel the library's heuristic picks (and whether it adds a split-K reduce launch).
`torch.backends.cuda.preferred_blas_library` picks the library for matmuls issued after it is set, so one
process times both: per projection (in a CUDA graph rotating over >= 160 MB of weight copies, so every
call reads HBM) and the whole model's chain of projections as a decode step runs them (every layer's own
weights, no attention), with the kernels each projection launches (torch.profiler).

    python3 bench/bench_blas.py --shape gemma3-4b qwen3-8b
    python3 bench/bench_blas.py --layouts    # each weight as stored ([N, K]) against transposed ([K, N])
    python3 bench/bench_blas.py --layouts --rows 1 8 64 2048   # the same at other row counts (prefill too)
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_decode import copy_bandwidth, graph_time_us, matmul_rate

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


def time_layouts(k: int, n: int, hbm: float, flops: float, rows: int = ROWS) -> dict:
    """One projection with its weight as the model stores it ([N, K], nn.Linear's: x @ W.T) and stored
    transposed ([K, N] contiguous: x @ Wt), under the library torch picks now. The two layouts are the
    same product; cuBLAS's heuristic sees a different problem (TN against NN) and may pick another kernel.
    `floor_us` is the weight's bytes over the copy bandwidth, or its FLOPs at the bf16 matmul rate where
    `rows` makes that longer (a prefill-sized M)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weights = weight_copies(k, n)
    count = len(weights)
    transposed = [w.t().contiguous() for w in weights]  # [K, N]
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    a, b = torch.nn.functional.linear(x, weights[0]).float(), torch.mm(x, transposed[0]).float()
    assert (a - b).norm() <= 1e-2 * a.norm(), "the two layouts give different products"
    floor_us = max(k * n * 2 / hbm, 2 * rows * k * n / flops) * 1e6
    row = {"floor_us": floor_us}
    calls = {
        "[N, K]": lambda i: torch.nn.functional.linear(x, weights[i % count], out=out),
        "[K, N]": lambda i: torch.mm(x, transposed[i % count], out=out),
    }
    for name, fn in calls.items():
        us = graph_time_us(fn, 2 * count)
        row[name] = {"us": us, "of_hbm": floor_us / us, "kernels": kernels_of(lambda f=fn: f(0))}
    return row


def layouts(shapes: list[str], hbm: float, flops: float, row_counts: list[int]) -> dict:
    """time_layouts for every projection of each shape at each row count; prints one line a projection,
    then each shape's sum over one decode step's projections (every layer's four and the head)."""
    result = {}
    for shape in shapes:
        layers = SHAPES[shape][4]
        for m in row_counts:
            print(f"\n== {shape}: M = {m}, bf16, weight [N, K] (as stored) against [K, N] (us; of the floor)")
            rows = {}
            for name, (k, n) in projections(shape).items():
                row = rows[name] = time_layouts(k, n, hbm, flops, m)
                a, b = row["[N, K]"], row["[K, N]"]
                print(
                    f"{name:<8} floor {row['floor_us']:8.2f} us  "
                    f"[N, K] {a['us']:8.2f} us ({a['of_hbm']:.2f})  "
                    f"[K, N] {b['us']:8.2f} us ({b['of_hbm']:.2f})  x{b['us'] / a['us']:.3f}  "
                    f"{' | '.join(k[:48] for k in a['kernels'])}  ->  "
                    f"{' | '.join(k[:48] for k in b['kernels'])}",
                    flush=True,
                )
            step = {
                lay: sum(r[lay]["us"] * (1 if name == "lm_head" else layers) for name, r in rows.items())
                for lay in ("[N, K]", "[K, N]")
            }
            print(
                f"a step's projections ({layers} layers + head): [N, K] {step['[N, K]']:.1f} us, "
                f"[K, N] {step['[K, N]']:.1f} us, x{step['[K, N]'] / step['[N, K]']:.3f}"
            )
            result[f"{shape} M={m}"] = rows
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
    parser.add_argument("--rows", type=int, nargs="+", default=[ROWS], help="M of the --layouts products")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {hbm / 1e9:.0f} GB/s; torch {torch.__version__}")
    if args.layouts:
        flops = matmul_rate()
        print(f"bf16 matmul {flops / 1e12:.0f} TFLOP/s")
        result = {"copy_GBps": hbm / 1e9, "layouts": layouts(args.shape, hbm, flops, args.rows)}
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
