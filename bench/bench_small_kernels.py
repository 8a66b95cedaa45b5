"""The small kernels of a Gemma-3-4B decode layer at batch 64, alone and after the cuBLAS GEMM they follow.

Gemma-3-4B's decode step (batch 64, 4k) spends ~0.34 ms a step in 69 RMSNorm and 34 rotation + KV-store
launches of ~3-4 us each (BENCHMARKS.md), each moving well under a megabyte: their time is latency (the
launch and a chain of memory round trips), not bytes. This times each inside a CUDA graph of 34 calls,
the way a decode step runs them:

- alone: 34 calls back to back;
- in the chain: 34 x (projection, kernel), each projection a different weight (every call reads HBM,
  as the model's layers do), minus the same 34 projections alone: what the kernel adds to the chain.

Run it on two trees to compare kernels (bench/ab_before_after.sh part `small_kernels`):

    python3 bench/bench_small_kernels.py
"""

from __future__ import annotations

import torch
from bench_decode import graph_time_us

from raystate.kernels.norm import rms_norm
from raystate.kernels.rotary import rope_write_kv

LAYERS = 34
ROWS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 2560, 8, 4, 256, 16


def main() -> None:
    assert torch.cuda.is_available(), "a GPU benchmark"
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    x = [torch.randn(ROWS, HIDDEN, device=dev, dtype=dt) for _ in range(LAYERS)]
    res = [torch.randn(ROWS, HIDDEN, device=dev, dtype=dt) for _ in range(LAYERS)]
    w = [torch.rand(HIDDEN, device=dev, dtype=dt) for _ in range(LAYERS)]
    qkv = [torch.randn(ROWS, qkv_width, device=dev, dtype=dt) for _ in range(LAYERS)]
    o_weights = [torch.randn(HIDDEN, HEADS * HEAD_DIM, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    qkv_weights = [torch.randn(qkv_width, HIDDEN, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
    attn_out = torch.randn(ROWS, HEADS * HEAD_DIM, device=dev, dtype=dt)
    positions = torch.randint(0, 4096, (ROWS,), device=dev)
    cos_sin = torch.randn(8192, HEAD_DIM, device=dev, dtype=torch.float32)
    k_cache = torch.zeros(ROWS * 2, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(ROWS, device=dev) * BLOCK + 3
    q_gain, k_gain = (torch.rand(HEAD_DIM, device=dev, dtype=dt) for _ in range(2))
    gains = (q_gain, k_gain, 1e-6, 1.0)

    def norm_plain(i):
        return rms_norm(x[i], w[i], 1e-6, weight_offset=1.0)

    def norm_sandwich(i):  # Gemma's post-sublayer norm, residual add and next pre-norm in one launch
        return rms_norm(x[i], w[i], 1e-6, residual=res[i], weight_offset=1.0, pre_weight=w[i - 1])

    def rope(i):
        return rope_write_kv(qkv[i], positions, cos_sin, HEADS, KV_HEADS, k_cache, v_cache, slots, gains)

    def o_proj(i):
        return torch.nn.functional.linear(attn_out, o_weights[i])

    def qkv_proj(i):
        return torch.nn.functional.linear(x[i], qkv_weights[i])

    def o_then_norm(i):
        out = o_proj(i)
        return rms_norm(out, w[i], 1e-6, residual=res[i], weight_offset=1.0, pre_weight=w[i - 1])

    def qkv_then_rope(i):
        out = qkv_proj(i)
        return rope_write_kv(out, positions, cos_sin, HEADS, KV_HEADS, k_cache, v_cache, slots, gains)

    print(torch.cuda.get_device_name(), "| us per call, median of 20 graph replays of 34 calls")
    alone = [("rms_norm", norm_plain), ("rms_norm add + sandwich", norm_sandwich), ("rope + kv", rope)]
    for name, fn in alone:
        print(f"  {name:<28} alone {graph_time_us(fn, LAYERS):6.2f}")
    chains = [("o -> sandwich norm", o_proj, o_then_norm), ("qkv -> rope + kv", qkv_proj, qkv_then_rope)]
    for name, gemm, both in chains:
        g, b = graph_time_us(gemm, LAYERS), graph_time_us(both, LAYERS)
        print(f"  {name:<28} gemm {g:6.2f}  gemm + kernel {b:6.2f}  kernel adds {b - g:5.2f}")


if __name__ == "__main__":
    main()
