"""Decode GEMMs of the `bench` model: cuBLAS against the fused Triton kernel of bench/decode_linear.py.

A decode step at batch 64 multiplies 64 rows by every weight matrix once, so each projection should take
its weight bytes over the copy bandwidth. This times, inside CUDA graphs and rotating over enough weight
copies that every call reads its weights from HBM (not from the 50 MB L2), each as a share of the copy
bandwidth measured in the same run:

1. per projection, the plain GEMM: cuBLAS (torch.nn.functional.linear) and decode_linear's default tile
   with PDL and weight prefetch, without the prefetch, without PDL, then a sweep of other tiles;
2. the projections of 24 decoder layers in sequence, as a decode step runs them minus attention:
   cuBLAS with the fused-add RMSNorm and SwiGLU-gate kernels (the model's path), against four fused
   decode_linear launches per layer (norm, residual add and gate inside), with and without PDL and
   prefetch. Both are checked against the same ops in plain torch first.

On the H200 cuBLAS wins both (BENCHMARKS.md), so the model keeps it.

    python3 bench/bench_gemm.py [--rows 64] [--skip-sweep] [--json gemm.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_decode import copy_bandwidth, graph_time_us
from decode_linear import LinearTile, decode_linear, decode_linear_ref, default_tile, set_launch

from raystate.config import ModelConfig
from raystate.kernels.activation import silu_and_mul
from raystate.kernels.norm import rms_norm

SWEEP = [
    LinearTile(block_n=bn, split_k=s, num_stages=st, num_warps=w)
    for bn, s, st, w in [
        (32, 2, 3, 4),
        (64, 1, 3, 4),
        (64, 2, 3, 4),
        (64, 4, 3, 4),
        (64, 4, 4, 4),
        (64, 8, 3, 4),
        (128, 2, 3, 8),
        (128, 4, 3, 8),
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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def time_variant(fn, calls: int, pdl: bool, prefetch: bool = True) -> float:
    set_launch(pdl, prefetch)
    try:
        return graph_time_us(fn, calls)
    finally:
        set_launch()


def per_projection(model: ModelConfig, rows: int, bw: float, gen: torch.Generator) -> list[dict]:
    out = []
    for name, (k, n) in decode_shapes(model).items():
        weight_bytes = n * k * 2
        copies = max(2, -(-(160 << 20) // weight_bytes))  # > 3x the L2 in weights
        ws = [
            torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k**0.5
            for _ in range(copies)
        ]
        x = torch.randn(rows, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0])
        floor_us = weight_bytes / bw * 1e6
        calls = 4 * copies
        row = {"shape": name, "K": k, "N": n, "weight_MB": weight_bytes / 1e6, "floor_us": floor_us}
        print(f"{name:>8} K={k:5d} N={n:5d} {weight_bytes / 1e6:6.1f} MB floor {floor_us:6.2f} us")
        cublas = graph_time_us(lambda i, x=x, ws=ws: torch.nn.functional.linear(x, ws[i % len(ws)]), calls)
        row["cublas_us"] = cublas
        print(f"{'cuBLAS':>40}: {cublas:7.2f} us  {floor_us / cublas:5.2f} of copy bandwidth")
        default = default_tile(n, k, False, x.device)
        variants = [
            (f"default {default.tag()}, PDL + prefetch", default, True, True),
            ("default, PDL, no prefetch", default, True, False),
            ("default, no PDL", default, False, False),
        ] + [(t.tag() + ", PDL + prefetch", t, True, True) for t in SWEEP if t != default]
        for label, tile, pdl, prefetch in variants:
            try:
                err = rel_err(decode_linear(x, ws[0], tile=tile), ref)
                assert err < 1e-2, f"relative error {err:.3g}"
                us = time_variant(
                    lambda i, x=x, ws=ws, tile=tile: decode_linear(x, ws[i % len(ws)], tile=tile),
                    calls,
                    pdl,
                    prefetch,
                )
            except Exception as exc:  # a tile that does not compile or fit: report, go on
                print(f"{label:>40}: failed ({str(exc).splitlines()[0][:80]})")
                continue
            row[label] = us
            print(
                f"{label:>40}: {us:7.2f} us  {floor_us / us:5.2f} of copy bandwidth  "
                f"{cublas / us:4.2f}x cuBLAS"
            )
        out.append(row)
    return out


class Layers:
    """The projection weights of `num_layers` decoder layers (distinct tensors: 2.2 GB for `bench`)."""

    def __init__(self, model: ModelConfig, num_layers: int, gen: torch.Generator) -> None:
        shapes = decode_shapes(model)

        def w(name: str) -> torch.Tensor:
            k, n = shapes[name]
            return torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k**0.5

        def g(dim: int) -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(dim, generator=gen, device="cuda", dtype=torch.bfloat16)

        self.layers = [
            {
                "qkv": w("qkv"),
                "o": w("o"),
                "gate_up": w("gate_up"),
                "down": w("down"),
                "g1": g(model.hidden_size),
                "g2": g(model.hidden_size),
            }
            for _ in range(num_layers)
        ]
        self.q_width = model.num_heads * model.head_dim
        self.eps = model.rms_norm_eps
        self.bytes = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def unfused(self, hidden: torch.Tensor) -> torch.Tensor:
        """cuBLAS projections, fused-add RMSNorm and SwiGLU-gate kernels, the add deferred into each norm
        (the model's path). The attention output is stood in for by the first q_width columns."""
        residual = None
        for p in self.layers:
            if residual is None:
                normed, residual = rms_norm(hidden, p["g1"], self.eps)[0], hidden
            else:
                normed, residual = rms_norm(hidden, p["g1"], self.eps, residual)
            qkv = torch.nn.functional.linear(normed, p["qkv"])
            o = torch.nn.functional.linear(qkv[:, : self.q_width], p["o"])
            normed, residual = rms_norm(o, p["g2"], self.eps, residual)
            act = silu_and_mul(torch.nn.functional.linear(normed, p["gate_up"]))
            hidden = torch.nn.functional.linear(act, p["down"])
        return hidden + residual

    def fused(self, stream: torch.Tensor) -> torch.Tensor:
        """Four decode_linear launches per layer: qkv(norm(s)), s += o(.), gate(norm(s)), s += down(.)."""
        for p in self.layers:
            qkv = decode_linear(stream, p["qkv"], norm_weight=p["g1"], eps=self.eps)
            stream = decode_linear(qkv[:, : self.q_width], p["o"], residual=stream)
            act = decode_linear(stream, p["gate_up"], norm_weight=p["g2"], eps=self.eps, silu_mul=True)
            stream = decode_linear(act, p["down"], residual=stream)
        return stream

    def reference(self, stream: torch.Tensor) -> torch.Tensor:
        """The fused path's ops unfused in torch (decode_linear_ref), for the correctness check."""
        for p in self.layers:
            qkv = decode_linear_ref(stream, p["qkv"], norm_weight=p["g1"], eps=self.eps)
            stream = decode_linear_ref(qkv[:, : self.q_width], p["o"], residual=stream)
            act = decode_linear_ref(stream, p["gate_up"], norm_weight=p["g2"], eps=self.eps, silu_mul=True)
            stream = decode_linear_ref(act, p["down"], residual=stream)
        return stream


def layer_chain(model: ModelConfig, rows: int, bw: float, gen: torch.Generator) -> dict:
    layers = Layers(model, model.num_layers, gen)
    x = torch.randn(rows, model.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
    ref = layers.reference(x)
    errs = {"fused": rel_err(layers.fused(x), ref), "unfused": rel_err(layers.unfused(x), ref)}
    floor_us = layers.bytes / bw * 1e6
    print(
        f"{model.num_layers} layers' projections, M = {rows}: {layers.bytes / 1e9:.2f} GB, "
        f"floor {floor_us:.1f} us "
        f"(relative error vs torch: fused {errs['fused']:.1e}, unfused {errs['unfused']:.1e})"
    )
    # 24 layers of random weights amplify rounding: the fused path rounds the normalised x at a different
    # point than the unfused one, so its distance to the torch ops is larger, not a wrong result.
    assert max(errs.values()) < 6e-2, errs
    result = {"floor_us": floor_us, "errors": errs}
    for label, fn, pdl, prefetch in [
        ("unfused: cuBLAS + RMSNorm + gate kernels", layers.unfused, False, False),
        ("fused decode_linear, PDL + prefetch", layers.fused, True, True),
        ("fused decode_linear, PDL, no prefetch", layers.fused, True, False),
        ("fused decode_linear, no PDL", layers.fused, False, False),
    ]:
        us = time_variant(lambda i, fn=fn: fn(x), 1, pdl, prefetch)
        result[label] = us
        print(
            f"{label:>42}: {us:8.1f} us  {floor_us / us:5.2f} of copy bandwidth  "
            f"{us / floor_us:4.2f}x the floor"
        )
    base = result["unfused: cuBLAS + RMSNorm + gate kernels"]
    best = result["fused decode_linear, PDL + prefetch"]
    print(f"fused with PDL + prefetch vs unfused: {base / best:.2f}x")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--skip-sweep", action="store_true", help="only the default tiles and the layer chain")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    if args.skip_sweep:
        SWEEP.clear()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; M = {args.rows}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = ModelConfig.named(args.model)
    rows = per_projection(model, args.rows, bw, gen)
    torch.cuda.empty_cache()
    chain = layer_chain(model, args.rows, bw, gen)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "copy_Bps": bw, "rows": rows, "layers": chain},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
