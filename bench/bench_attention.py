"""GPU micro-benchmark for raystate.kernels.paged_attention.

Decode is memory-bound: we report the KV bytes each step must read over the kernel time, against the HBM
bandwidth of a device-to-device copy measured in the same run. Prefill is compute-bound: we report
TFLOP/s and the time ratio against torch's flash SDPA on the same (dense, unpaged) problem.

    python bench/bench_attention.py [--dtype bf16] [--json out.json] [--sweep]

--sweep times the launch configurations the launcher could pick (tile rows, keys per step, warps,
stages) on one decode and one prefill problem, to re-tune `_launch_config` on new hardware.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing

from raystate.kernels import attention, cdiv, paged_attention


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write): the practical HBM ceiling."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100)
    return 2 * src.numel() / (ms * 1e-3)


def paged_problem(q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A paged cache with a shuffled block table, one row per (q_len, seq_len)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_row = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    block_table = torch.zeros(len(seq_lens), max(blocks_per_row), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks_per_row):
        block_table[b, :n] = perm[start : start + n]
        start += n
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], num_q_heads, head_dim, generator=gen, device="cuda", dtype=dtype)
    query_start_loc = torch.tensor(qsl, dtype=torch.int32, device="cuda")
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return query, k_cache, v_cache, block_table, query_start_loc, seq_lens_t


def bench_decode(batch, context, window, args, hbm) -> dict:
    h_q, h_kv, d = args.q_heads, args.kv_heads, args.head_dim
    dtype = DTYPES[args.dtype]
    query, k_cache, v_cache, bt, qsl, sl = paged_problem(
        [1] * batch, [context] * batch, h_q, h_kv, d, args.block_size, dtype
    )
    out = torch.empty_like(query)

    def run():
        paged_attention(query, k_cache, v_cache, bt, qsl, sl, d**-0.5, window, out=out, max_query_len=1)

    ms = triton.testing.do_bench(run, warmup=25, rep=100)
    keys = min(context, window) if window else context
    kv_bytes = 2 * batch * keys * h_kv * d * query.element_size()
    q_bytes = 2 * query.numel() * query.element_size()
    bw = (kv_bytes + q_bytes) / (ms * 1e-3)
    return {
        "case": f"decode B={batch} ctx={context} W={window}",
        "ms": ms,
        "GB/s": bw / 1e9,
        "of_hbm": bw / hbm,
    }


def bench_prefill(batch, seq, window, args) -> dict:
    h_q, h_kv, d = args.q_heads, args.kv_heads, args.head_dim
    dtype = DTYPES[args.dtype]
    query, k_cache, v_cache, bt, qsl, sl = paged_problem(
        [seq] * batch, [seq] * batch, h_q, h_kv, d, args.block_size, dtype
    )
    out = torch.empty_like(query)

    def run():
        paged_attention(query, k_cache, v_cache, bt, qsl, sl, d**-0.5, window, out=out, max_query_len=seq)

    ms = triton.testing.do_bench(run, warmup=25, rep=100)
    keys_per_query = seq / 2 if not window else min(window, seq / 2)
    flops = 4 * batch * h_q * seq * keys_per_query * d
    row = {"case": f"prefill B={batch} S={seq} W={window}", "ms": ms, "TFLOP/s": flops / (ms * 1e-3) / 1e12}
    if not window:
        q = torch.randn(batch, h_q, seq, d, device="cuda", dtype=dtype)
        k = torch.randn(batch, h_kv, seq, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            sdpa_ms = triton.testing.do_bench(
                lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), warmup=25, rep=100
            )
        row["sdpa_ms"] = sdpa_ms
        row["speed_vs_sdpa"] = sdpa_ms / ms
    return row


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sweep(args, hbm) -> list[dict]:
    """Times each candidate launch configuration by swapping the launcher's choice for it."""
    default_block_m, default_config = attention._PREFILL_BLOCK_M, attention._launch_config
    rows = []
    try:
        for block_m in (64, 128):
            for block_n in (32, 64, 128):
                for num_warps in (4, 8):
                    for num_stages in (2, 3):
                        attention._PREFILL_BLOCK_M = block_m
                        attention._launch_config = lambda bm, d, c=(block_n, num_warps, num_stages): c
                        tag = f"M={block_m} N={block_n} w={num_warps} s={num_stages}"
                        try:
                            prefill = bench_prefill(1, 8192, 0, args)
                            decode = bench_decode(64, 4096, 0, args, hbm) if block_m == 64 else {}
                        except Exception as exc:  # e.g. out of shared memory for this tile
                            print(tag, "failed:", type(exc).__name__)
                            continue
                        row = {"config": tag, "prefill_vs_sdpa": prefill["speed_vs_sdpa"]}
                        if decode:
                            row["decode_of_hbm"] = decode["of_hbm"]
                        rows.append(row)
    finally:
        attention._PREFILL_BLOCK_M, attention._launch_config = default_block_m, default_config
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--sweep", action="store_true", help="time candidate launch configurations")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"

    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {hbm / 1e9:.0f} GB/s")
    rows = sweep(args, hbm) if args.sweep else []
    for batch, context in [(1, 8192), (8, 8192), (64, 4096), (256, 2048), (128, 8192)]:
        rows.append(bench_decode(batch, context, 0, args, hbm))
    rows.append(bench_decode(64, 8192, 1024, args, hbm))
    for batch, seq in [(1, 1024), (1, 4096), (4, 4096), (1, 16384)]:
        rows.append(bench_prefill(batch, seq, 0, args))
    rows.append(bench_prefill(1, 16384, 1024, args))
    for row in rows:
        print("  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{v:<32}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)
    assert all(math.isfinite(r["ms"]) for r in rows if "ms" in r)


if __name__ == "__main__":
    main()
