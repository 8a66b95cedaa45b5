"""What programmatic dependent launch (raystate.kernels._pdl) saves per kernel in a CUDA graph, H200.

Two chains, each captured in one CUDA graph and timed per node, with the small kernel launched plainly
and as a programmatic dependent, side by side:
- N small Triton kernels in a row (each adds 1 to a 64 x 2560 bf16 tensor: the size of a decode step's
  activations at batch 64 on a 2560-wide model), so every edge is Triton -> Triton;
- N (cuBLAS GEMM [64, 2560] x [2560, 2560], then the small kernel on its output): the GEMM is launched
  plainly by torch, so only the GEMM -> Triton edge can gain.

    python3 bench/bench_pdl.py [--nodes 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from raystate.kernels._pdl import launch_options, pdl_prologue, use_pdl


@triton.jit
def _add_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def add_one(x: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    n = x.numel()
    block = 2048
    _add_one_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, USE_PDL=pdl, **launch_options(pdl))


def graph_us_per_node(fn, nodes: int, replays: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays / nodes)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = [torch.zeros(64, 2560, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    a = torch.randn(64, 2560, dtype=torch.bfloat16, device=dev)
    w = torch.randn(2560, 2560, dtype=torch.bfloat16, device=dev) * 0.02
    h = torch.empty(64, 2560, dtype=torch.bfloat16, device=dev)
    assert use_pdl(a), "needs a Hopper GPU and a Triton with the grid-dependency intrinsics"
    result = {}
    for pdl in (False, True):
        tag = "PDL" if pdl else "plain"

        def triton_chain(pdl=pdl):
            for i in range(args.nodes):
                add_one(x[i % 2], x[(i + 1) % 2], pdl)

        def gemm_chain(pdl=pdl):
            for _ in range(args.nodes // 2):
                torch.mm(a, w, out=h)
                add_one(h, a, pdl)

        result[f"triton->triton, {tag}"] = graph_us_per_node(triton_chain, args.nodes)
        result[f"gemm->triton pair, {tag}"] = graph_us_per_node(gemm_chain, args.nodes // 2)
    # The GEMM alone in the same chain shape, for what the pair adds to it.
    result["gemm alone"] = graph_us_per_node(
        lambda: [torch.mm(a, w, out=h) for _ in range(args.nodes // 2)], args.nodes // 2
    )
    print(f"{torch.cuda.get_device_name(0)}, {args.nodes} nodes a graph; us per node (pair)")
    for name, us in result.items():
        print(f"  {name:<28} {us:7.2f} us")
    print(
        f"  PDL saves {result['triton->triton, plain'] - result['triton->triton, PDL']:.2f} us a Triton -> "
        f"Triton edge, {result['gemm->triton pair, plain'] - result['gemm->triton pair, PDL']:.2f} us a "
        "GEMM -> Triton edge"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
