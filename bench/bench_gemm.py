"""Decode GEMMs of the `bench` model: cuBLAS (torch.nn.functional.linear) against a skinny Triton GEMM.

A decode step at batch 64 multiplies 64 rows by every weight matrix once, so each GEMM should take its
weight bytes over the copy bandwidth. Per shape (the four projections of a decoder layer) this times
cuBLAS and a grid of tiles of the candidate kernel below inside CUDA graphs, rotating over enough weight
copies that every call reads its weights from HBM (not from the 50 MB L2), and prints each as a share of
the copy bandwidth measured in the same run. Every tile's output is checked against cuBLAS first.

The candidate (`skinny_linear`): one program owns BLOCK_N output columns and a 1 / SPLIT_K share of K,
keeping the whole (padded) M = 64 in one tile, so every weight byte is read once; SPLIT_K > 1 adds fp32
partial sums with atomics into a zeroed buffer, rounded to bf16 by a second launch. On the H200 no tile
beat cuBLAS on any of the four shapes (BENCHMARKS.md), so the model keeps cuBLAS and the kernel lives
here, as the measured alternative, not in raystate.kernels.

    python3 bench/bench_gemm.py [--rows 64] [--json gemm.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from bench_decode import copy_bandwidth, graph_time_us

from raystate.config import ModelConfig
from raystate.kernels import next_pow2


@dataclass(frozen=True)
class SkinnyTile:
    """One launch configuration of `skinny_linear` (what this benchmark sweeps)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def tag(self) -> str:
        return f"N{self.block_n} K{self.block_k} split{self.split_k} w{self.num_warps} s{self.num_stages}"


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K], unit column stride
    out_ptr,  # [M, N] (fp32 accumulator when SPLIT_K > 1), unit column stride
    num_rows,  # M
    stride_xm,
    stride_wn,
    stride_om,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < num_rows
    n_valid = offs_n < N
    k_share: tl.constexpr = K // SPLIT_K  # the launcher checks K % (SPLIT_K * BLOCK_K) == 0
    k_start = pid_k * k_share
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_share, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_valid[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=n_valid[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    o_mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")


def skinny_linear_supported(x: torch.Tensor, weight: torch.Tensor, tile: SkinnyTile) -> bool:
    """Whether `skinny_linear` takes these operands with this tile (else the caller uses F.linear)."""
    m, k = x.shape
    return (
        1 <= m <= 64
        and weight.shape[1] == k
        and k % (tile.split_k * tile.block_k) == 0
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, tile: SkinnyTile = SkinnyTile()) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype; one launch (two with split_k > 1: the fp32
    partial sums are rounded to the output dtype afterwards). No host sync."""
    if not skinny_linear_supported(x, weight, tile):
        raise ValueError(f"skinny_linear: unsupported operands {tuple(x.shape)} x {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    split = tile.split_k
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device) if split > 1 else x.new_empty((m, n))
    grid = (triton.cdiv(n, tile.block_n), split)
    _skinny_linear_kernel[grid](
        x,
        weight,
        out,
        m,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        N=n,
        K=k,
        BLOCK_M=max(16, next_pow2(m)),
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        SPLIT_K=split,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out.to(x.dtype) if split > 1 else out


TILES = [
    SkinnyTile(block_n=n, block_k=k, split_k=s, num_warps=w, num_stages=st)
    for n, k, s, w, st in [
        (16, 256, 1, 4, 4),
        (32, 128, 1, 4, 4),
        (32, 256, 1, 4, 3),
        (64, 128, 1, 4, 4),
        (64, 128, 1, 4, 6),
        (64, 256, 1, 8, 3),
        (128, 128, 1, 8, 3),
        (64, 128, 2, 4, 4),
        (64, 128, 4, 4, 4),
        (128, 128, 4, 8, 3),
        (32, 128, 4, 4, 4),
    ]
]


def decode_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of each projection: x [M, K] @ W[N, K]^T."""
    h, kv = model.hidden_size, model.num_kv_heads * model.head_dim
    q = model.num_heads * model.head_dim
    return {
        "qkv": (h, q + 2 * kv),
        "o": (q, h),
        "gate_up": (h, 2 * model.intermediate_size),
        "down": (model.intermediate_size, h),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; M = {args.rows}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (k, n) in decode_shapes(ModelConfig.named(args.model)).items():
        weight_bytes = n * k * 2
        copies = max(2, -(-(160 << 20) // weight_bytes))  # > 3x the L2 in weights
        ws = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(args.rows, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0])
        floor_us = weight_bytes / bw * 1e6
        calls = 4 * copies
        result = {"shape": name, "K": k, "N": n, "weight_MB": weight_bytes / 1e6, "floor_us": floor_us}
        us = graph_time_us(lambda i, x=x, ws=ws: torch.nn.functional.linear(x, ws[i % len(ws)]), calls)
        result["cublas_us"] = us
        print(f"{name:>8} K={k:5d} N={n:5d} {weight_bytes / 1e6:6.1f} MB floor {floor_us:6.2f} us")
        print(f"{'cuBLAS':>34}: {us:7.2f} us  {floor_us / us:5.2f} of copy bandwidth")
        best = None
        for tile in TILES:
            if not skinny_linear_supported(x, ws[0], tile):
                continue
            try:
                out = skinny_linear(x, ws[0], tile)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1e-2, f"relative error {err:.3g}"
                t = graph_time_us(
                    lambda i, tile=tile, x=x, ws=ws: skinny_linear(x, ws[i % len(ws)], tile), calls
                )
            except Exception as exc:  # a tile that does not compile or fit: report, go on
                print(f"{tile.tag():>34}: failed ({str(exc).splitlines()[0][:80]})")
                continue
            result[tile.tag()] = t
            print(f"{tile.tag():>34}: {t:7.2f} us  {floor_us / t:5.2f} of copy bandwidth (err {err:.1e})")
            if best is None or t < best[1]:
                best = (tile.tag(), t)
        if best:
            result["best"] = best
            print(f"{'best':>34}: {best[0]} {best[1]:.2f} us = {us / best[1]:.2f}x cuBLAS")
        rows.append(result)
    total_cublas = sum(r["cublas_us"] for r in rows)
    total_best = sum(min(r["cublas_us"], r["best"][1] if "best" in r else 1e9) for r in rows)
    total_floor = sum(r["floor_us"] for r in rows)
    print(f"per layer: floor {total_floor:.1f} us, cuBLAS {total_cublas:.1f} us, best {total_best:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_Bps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
