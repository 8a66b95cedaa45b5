"""GPU micro-benchmark for raystate.kernels.paged_attention.

Decode is memory-bound: we report the KV bytes each step must read over the kernel time, against the HBM
bandwidth of a device-to-device copy measured in the same run. Prefill is compute-bound: we report
TFLOP/s and the time ratio against torch's flash SDPA on the same (dense, unpaged) problem.

    python bench/bench_attention.py [--dtype bf16] [--json out.json] [--sweep [--only REGEX]]
                                    [--split-sweep] [--max-model-len N]

The split-KV section times decode on the bench model's heads with and without splitting each row's keys
(the policy splits batches too small to fill the GPU), side by side; --split-sweep adds split counts, key
steps and keys-per-split minimums around the policy's choice; --max-model-len widens the block tables as
the model's are (the policy's split count may depend on the table width, never on seq_lens).

--sweep first times the tiles the launcher can be given (`AttentionLaunch`: score rows, keys per step,
warps, stages) in each layout: the tile layout on causal prefill S = 4k, 8k, 16k and 4 x 4k, the row
layout on decode B = 64 at 4k context, and prints a table of time and ratio per tile (plus each one's
largest difference from the default launch's output, a guard against a fast but wrong variant). It
chooses nothing: the defaults in kernels/attention_launch.py are set by hand from the table. The inner
loop of each layout is fixed in the kernel (see BENCHMARKS.md for the sweep that fixed it). The whole run
takes about two minutes on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
import triton.testing
from bench_decode import copy_bandwidth, graph_time_us, step_variant

from raystate.kernels import _pdl, attention, cdiv, next_pow2, paged_attention
from raystate.kernels.attention_launch import AttentionLaunch, device_limits, launch_config, plan_launch
from raystate.kernels.rotary import rope_write_kv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PREFILL_SWEEP = ((1, 4096), (1, 8192), (1, 16384), (4, 4096))  # (rows, tokens per row), causal
DECODE_SWEEP = (64, 4096)  # (rows, context)


def paged_problem(
    q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, table_keys=0
):
    """A paged cache with a shuffled block table, one row per (q_len, seq_len); the table is at least
    cdiv(table_keys, block_size) blocks wide (as the model's, sized by max_model_len; the columns past a
    row's length hold block 0 and are never read)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_row = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    width = max(max(blocks_per_row), cdiv(table_keys, block_size))
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32, device="cuda")
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


class Problem:
    """One paged attention call, runnable under any launch: `batch` rows of q_len queries over seq_len
    keys (prefill: q_len = seq_len; decode: q_len = 1), max_query_len passed as the model passes it."""

    def __init__(self, batch: int, q_len: int, seq_len: int, window: int, args):
        self.batch, self.q_len, self.seq_len, self.window = batch, q_len, seq_len, window
        self.group = args.q_heads // args.kv_heads
        self.inputs = paged_problem(
            [q_len] * batch,
            [seq_len] * batch,
            args.q_heads,
            args.kv_heads,
            args.head_dim,
            args.block_size,
            DTYPES[args.dtype],
            table_keys=getattr(args, "max_model_len", 0),
        )
        self.scale = args.head_dim**-0.5
        self.out = torch.empty_like(self.inputs[0])

    def run(self, launch: AttentionLaunch | None = None) -> torch.Tensor:
        return paged_attention(
            *self.inputs, self.scale, self.window, out=self.out, max_query_len=self.q_len, launch=launch
        )

    def compile(self, launch: AttentionLaunch | None = None) -> None:
        """Compiles the kernel this call would launch, launching nothing."""
        args = (*self.inputs, self.scale, self.window, None, self.out)
        attention._paged_attention_triton(args, self.q_len, launch, compile_only=True)

    def time_ms(self, launch: AttentionLaunch | None = None) -> float:
        return triton.testing.do_bench(lambda: self.run(launch), warmup=25, rep=100)

    def current_launch(self) -> AttentionLaunch:
        """The launch today's policy resolves for this call without splitting keys (kv_splits = 1): the
        one-launch path as it was before split-KV decode, same kernel, same tile."""
        k_cache = self.inputs[1]
        smem, sms = device_limits(k_cache.device.index or 0)
        key_row_bytes = max(16, next_pow2(k_cache.shape[3])) * k_cache.element_size()
        waves = self.batch * k_cache.shape[2] / sms
        return launch_config(self.group, self.q_len, None, self.window, key_row_bytes, smem, waves)[1]

    def policy_plan(self):
        """The policy's LaunchPlan for this call (its kv_splits: 1 = no split)."""
        query, k_cache, block_table = self.inputs[0], self.inputs[1], self.inputs[3]
        return plan_launch(
            query.shape[0],
            self.batch,
            k_cache.shape[2],
            self.group,
            max(16, next_pow2(k_cache.shape[3])) * k_cache.element_size(),
            k_cache.device,
            self.q_len,
            self.window,
            None,
            block_table.shape[1] * k_cache.shape[1],
        )

    def kv_bytes(self) -> int:
        query, k_cache = self.inputs[0], self.inputs[1]
        keys = min(self.seq_len, self.window) if self.window else self.seq_len
        kv = 2 * self.batch * keys * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
        return kv + 2 * query.numel() * query.element_size()  # + reading q and writing out

    def causal_flops(self) -> float:
        query = self.inputs[0]
        keys_per_query = self.seq_len / 2 if not self.window else min(self.window, self.seq_len / 2)
        return 4 * self.batch * query.shape[1] * self.seq_len * keys_per_query * query.shape[2]


def sdpa_ms(batch: int, seq: int, args) -> float:
    """torch's flash SDPA on the same causal problem, dense and unpaged: the prefill yardstick."""
    dtype = DTYPES[args.dtype]
    q = torch.randn(batch, args.q_heads, seq, args.head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, args.kv_heads, seq, args.head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return triton.testing.do_bench(
            lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True), warmup=25, rep=100
        )


def bench_decode(batch, context, window, args, hbm) -> dict:
    """The default launch, and beside it the launch without split-KV (`nosplit_*`: today's one-launch
    path; the same launch where the policy does not split)."""
    problem = Problem(batch, 1, context, window, args)
    ms = problem.time_ms()
    bw = problem.kv_bytes() / (ms * 1e-3)
    nosplit_ms = problem.time_ms(problem.current_launch())
    return {
        "case": f"decode B={batch} ctx={context} W={window}",
        "ms": ms,
        "GB/s": bw / 1e9,
        "of_hbm": bw / hbm,
        "splits": problem.policy_plan().kv_splits,
        "nosplit_ms": nosplit_ms,
        "nosplit_of_hbm": problem.kv_bytes() / (nosplit_ms * 1e-3) / hbm,
    }


def bench_prefill(batch, seq, window, args) -> dict:
    problem = Problem(batch, seq, seq, window, args)
    ms = problem.time_ms()
    row = {
        "case": f"prefill B={batch} S={seq} W={window}",
        "ms": ms,
        "TFLOP/s": problem.causal_flops() / (ms * 1e-3) / 1e12,
    }
    if not window:
        row["sdpa_ms"] = sdpa_ms(batch, seq, args)
        row["speed_vs_sdpa"] = row["sdpa_ms"] / ms
    return row


def decode_layouts(args, hbm) -> list[dict]:
    """Decode on the bench model's heads (16 q / 4 kv of 128): the default launch (the row layout, 128- or
    64-key steps by the program-count and window rules) against each key step on its own, each inside a
    CUDA graph rotating over enough problem copies that every call reads its KV from HBM, not from L2."""
    heads = argparse.Namespace(**{**vars(args), "q_heads": 16, "kv_heads": 4, "head_dim": 128})
    launches = {
        "default": None,
        "rows N64": AttentionLaunch(row_programs=True),
        "rows N128": AttentionLaunch(block_n=128, row_programs=True),
    }
    rows = []
    for batch, context, window in [(64, 2048, 0), (64, 2048, 128), (64, 8192, 128), (256, 2048, 128)]:
        one = Problem(batch, 1, context, window, heads)
        copies = [one] + [
            Problem(batch, 1, context, window, heads) for _ in range(max(1, (160 << 20) // one.kv_bytes()))
        ]
        ref = one.run().clone()
        case = f"decode bench heads B={batch} ctx={context} W={window}"
        row = {"case": case, "kv_MB": one.kv_bytes() / 1e6}
        for name, launch in launches.items():
            diff = (one.run(launch).float() - ref.float()).abs().max().item()
            assert diff < 2e-2, f"{name}: differs from the default by {diff}"
            us = graph_time_us(lambda i, L=launch, c=copies: c[i % len(c)].run(L), 2 * len(copies))
            row[name] = us
            row[f"{name} of_hbm"] = one.kv_bytes() / (us * 1e-6) / hbm
        rows.append(row)
        print(
            f"{row['case']:<44} "
            + "  ".join(f"{n}: {row[n]:.2f} us ({row[n + ' of_hbm']:.2f})" for n in launches),
            flush=True,
        )
    return rows


# Split-KV decode on the bench model's heads: (batch, context, window). Batches 1 and 8 leave most of the
# 132 SMs idle without splitting; 64 x 4 kv heads fills them (the policy keeps one launch there).
SPLIT_CASES = (
    (1, 2048, 0),
    (1, 8192, 0),
    (8, 2048, 0),
    (8, 8192, 0),
    (64, 2048, 0),
    (64, 8192, 0),
    (1, 8192, 1024),
    (8, 8192, 1024),
    (64, 8192, 128),
)
NOISE = 0.03  # relative time difference taken as run-to-run noise in a CUDA-graph timing


@triton.jit
def _empty_kernel(ptr):
    tl.store(ptr + tl.program_id(0), tl.load(ptr + tl.program_id(0)) + 1)


@triton.jit
def _stream_kernel(src_ptr, dst_ptr, ELEMS: tl.constexpr, STEP: tl.constexpr):
    """Program p sums src[p * ELEMS : (p + 1) * ELEMS] (bf16) in STEP-element loads: a read with no
    dependent address, no arithmetic to wait on and one launch."""
    base = src_ptr + tl.program_id(0).to(tl.int64) * ELEMS
    total = tl.zeros([STEP], tl.float32)
    for i in tl.static_range(0, ELEMS, STEP):
        total += tl.load(base + i + tl.arange(0, STEP)).to(tl.float32)
    tl.store(dst_ptr + tl.program_id(0), tl.sum(total, 0))


def small_read_floors(hbm: float) -> list[dict]:
    """What a call that reads batch 1's 8k context of bench heads (16.8 MB) can cost at best here, timed
    as the attention rows are (a CUDA graph over copies that make every call read HBM): one empty kernel
    and two in a row (a graph node's cost), a plain streaming read of the 16.8 MB over 128-2048 programs,
    and torch's device copy of it."""
    rows = []
    flag = torch.zeros(1024, dtype=torch.int32, device="cuda")
    one = graph_time_us(lambda i: _empty_kernel[(1,)](flag), 40)
    two = graph_time_us(lambda i: (_empty_kernel[(1,)](flag), _empty_kernel[(16,)](flag)), 40)
    print(f"empty kernel: {one:.2f} us a call; two in a row: {two:.2f} us", flush=True)
    rows.append({"case": "empty kernel", "us": one, "two_us": two})
    elems = 8_400_000  # bf16: 16.8 MB
    bufs = [torch.randn(elems, device="cuda", dtype=torch.bfloat16) for _ in range(12)]
    sink = torch.empty(8192, device="cuda")
    for progs in (128, 256, 512, 1024, 2048):
        step = min(4096, next_pow2(elems // progs) // 2)
        per = elems // progs // step * step

        def read(i, p=progs, e=per, s=step):
            _stream_kernel[(p,)](bufs[i % len(bufs)], sink, ELEMS=e, STEP=s)

        us = graph_time_us(read, 24)
        nbytes = progs * per * 2
        share = nbytes / (us * 1e-6) / hbm
        print(
            f"plain read of {nbytes / 1e6:.1f} MB over {progs} programs: {us:.2f} us ({share:.2f})",
            flush=True,
        )
        rows.append({"case": f"read over {progs} programs", "us": us, "of_hbm": share})
    dsts = [torch.empty_like(b) for b in bufs[:6]]
    us = graph_time_us(lambda i: dsts[i % 6].copy_(bufs[6 + i % 6]), 24)
    share = 4 * elems / (us * 1e-6) / hbm
    print(f"torch copy of {2 * elems / 1e6:.1f} MB: {us:.2f} us (read + write: {share:.2f})", flush=True)
    rows.append({"case": "torch copy", "us": us, "of_hbm": share})
    return rows


def split_variants(problem: Problem, sweep: bool, tune: bool = False) -> dict[str, AttentionLaunch | None]:
    """'current' (no split: the one-launch row kernel) and 'policy' (the default launch); where the policy
    splits, with `sweep` also half / the same / double / quadruple its split count at 64- and 128-key
    steps (at least 128 keys a split), and with `tune` each of those at 1-4 stages of the key loop
    (tuning data for attention_launch's SPLIT_LAUNCH)."""
    current = problem.current_launch()
    variants: dict[str, AttentionLaunch | None] = {"current": current, "policy": None}
    splits = problem.policy_plan().kv_splits
    if splits > 1 and (sweep or tune):
        for s in sorted({max(2, splits // 2), splits, 2 * splits, 4 * splits}):
            for n in (64, 128):
                for stages in (1, 2, 3, 4) if tune else (2,):
                    variants.setdefault(
                        f"S{s} N{n} s{stages}",
                        AttentionLaunch(
                            block_n=n, num_stages=stages, row_programs=True, kv_splits=s, split_min_keys=128
                        ),
                    )
    return variants


def split_decode(args, hbm) -> list[dict]:
    """Split-KV decode against today's one-launch path on the bench model's heads (16 q / 4 kv of 128),
    each inside a CUDA graph rotating over enough problem copies that every call reads its KV from HBM
    (the graph also checks the split path captures: its partials come from the graph's pool). Prints, per
    case, us per call and the share of copy bandwidth of each variant, the policy's split count, and the
    policy's time over the current path's: a row where the policy is slower by more than NOISE is
    flagged (expected only as noise where the policy does not split: the same kernel runs)."""
    heads = argparse.Namespace(**{**vars(args), "q_heads": 16, "kv_heads": 4, "head_dim": 128})
    rows = []
    cases = [c for c in SPLIT_CASES if c[0] < 64] if args.split_tune else SPLIT_CASES
    for batch, context, window in cases:
        one = Problem(batch, 1, context, window, heads)
        copies = [one] + [
            Problem(batch, 1, context, window, heads) for _ in range(max(1, (160 << 20) // one.kv_bytes()))
        ]
        ref = one.run(one.current_launch()).clone()
        splits = one.policy_plan().kv_splits
        row = {"case": f"B={batch} ctx={context} W={window}", "kv_MB": one.kv_bytes() / 1e6, "splits": splits}
        variants = split_variants(one, args.split_sweep, args.split_tune)
        for name, launch in variants.items():
            try:
                diff = (one.run(launch).float() - ref.float()).abs().max().item()
                assert diff < 2e-2, f"{name}: differs from the current path by {diff}"
                us = graph_time_us(lambda i, L=launch, c=copies: c[i % len(c)].run(L), 2 * len(copies))
            except Exception as exc:  # out of shared memory for a swept variant, ...
                row[name] = _error_line(exc)
                continue
            row[name] = us
            row[f"{name} of_hbm"] = one.kv_bytes() / (us * 1e-6) / hbm
        # The policy's launches as bench_decode's step variants make them, side by side in the same graphs:
        # plainly, not as programmatic dependents (where they split), and with the row's bounds read after
        # the PDL wait (attention.EARLY_BOUNDS off).
        toggles = [("policy w/o PDL", "no_pdl")] if splits > 1 else []
        for name, variant in [*toggles, ("bounds after wait", "late_bounds")]:
            with step_variant(variant):
                row[name] = graph_time_us(lambda i, c=copies: c[i % len(c)].run(), 2 * len(copies))
            row[f"{name} of_hbm"] = one.kv_bytes() / (row[name] * 1e-6) / hbm
            variants = {**variants, name: None}
        ratio = row["policy"] / row["current"]
        row["policy/current"] = ratio
        row["slower"] = ratio > 1 + NOISE
        rows.append(row)
        cells = [
            f"{n}: {row[n]:.2f} us ({row[n + ' of_hbm']:.2f})"
            if isinstance(row[n], float)
            else f"{n}: {row[n]}"
            for n in variants
        ]
        flag = "  SLOWER THAN CURRENT" if row["slower"] else ""
        print(f"{row['case']:<24} S={splits:<3} x{ratio:.3f}{flag}  " + "  ".join(cells), flush=True)
        del copies
        torch.cuda.empty_cache()
    slower = [r["case"] for r in rows if r["slower"]]
    print(
        "no row slower than the current path by more than noise"
        if not slower
        else f"slower than the current path by more than {NOISE:.0%}: {', '.join(slower)}"
    )
    return rows


# Gemma-3-4B's decode attention at batch 64, 4k context: (batch, context, window); 29 of its 34 layers
# slide over 1024 keys, and 64 rows x 4 kv heads are 256 programs, just under the split rule's 264.
WIDE_HEAD_CASES = ((64, 4096, 1024), (64, 4096, 0))


def wide_head_decode(args, hbm) -> list[dict]:
    """Gemma-3-4B's heads (8 q / 4 kv of 256): the default launch (one program per row and kv head)
    against 2 and 4 splits per row (split kernel + combine) at 32- and 64-key steps and 2-4 stages, and the
    one-launch kernel at 8 warps, in CUDA graphs over enough copies that every call reads HBM. Variants
    that do not fit shared memory print their error."""
    heads = argparse.Namespace(**{**vars(args), "q_heads": 8, "kv_heads": 4, "head_dim": 256})
    variants: dict[str, AttentionLaunch | None] = {"default": None}
    for splits in (1, 2, 4):
        for n in (32, 64):
            for stages in (2, 3, 4):
                variants[f"S{splits} N{n} s{stages}"] = AttentionLaunch(
                    block_n=n,
                    num_stages=stages,
                    row_programs=True,
                    kv_splits=splits,
                    split_min_keys=128,
                )
    for n in (32, 64):  # the one-launch kernel at 8 warps (the policy gives 16 score rows 4)
        for stages in (2, 3):
            variants[f"S1 N{n} s{stages} w8"] = AttentionLaunch(
                block_n=n, num_warps=8, num_stages=stages, row_programs=True
            )
    rows = []
    for batch, context, window in WIDE_HEAD_CASES:
        one = Problem(batch, 1, context, window, heads)
        copies = [one] + [
            Problem(batch, 1, context, window, heads) for _ in range(max(1, (160 << 20) // one.kv_bytes()))
        ]
        ref = one.run().clone()
        row = {"case": f"D=256 B={batch} ctx={context} W={window}", "kv_MB": one.kv_bytes() / 1e6}
        for name, launch in variants.items():
            try:
                diff = (one.run(launch).float() - ref.float()).abs().max().item()
                assert diff < 2e-2, f"{name}: differs from the default by {diff}"
                us = graph_time_us(lambda i, L=launch, c=copies: c[i % len(c)].run(L), 2 * len(copies))
            except Exception as exc:  # out of shared memory, ...
                row[name] = _error_line(exc)
                continue
            row[name] = us
            row[f"{name} of_hbm"] = one.kv_bytes() / (us * 1e-6) / hbm
        rows.append(row)
        timed = sorted((n for n in variants if isinstance(row[n], float)), key=lambda n: row[n])
        print(f"{row['case']:<28} default: {row['default']:.2f} us ({row['default of_hbm']:.2f})", flush=True)
        for n in timed[:8]:
            print(f"    {n:<16} {row[n]:.2f} us ({row[n + ' of_hbm']:.2f})", flush=True)
        del copies
        torch.cuda.empty_cache()
    return rows


@triton.jit
def _stream_loop_kernel(src_ptr, dst_ptr, elems, STEP: tl.constexpr):
    """Program p sums src[p * elems : (p + 1) * elems] (bf16) in STEP-element loads, in a pipelined loop:
    a plain read of large spans with nothing but the bytes on its critical path."""
    base = src_ptr + tl.program_id(0).to(tl.int64) * elems
    total = tl.zeros([STEP], tl.float32)
    for i in tl.range(0, elems, STEP, num_stages=3):
        total += tl.load(base + i + tl.arange(0, STEP)).to(tl.float32)
    tl.store(dst_ptr + tl.program_id(0), tl.sum(total, 0))


# A decode launch's fixed cost: (label, q heads, kv heads, head dim) at batch 64, 4k context, over windows.
FIXED_COST_HEADS = (("gemma", 8, 4, 256), ("bench", 16, 4, 128))
FIXED_COST_WINDOWS = (256, 512, 1024, 2048, 0)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _rope_then_attend(problem: Problem, slots: torch.Tensor, rope: tuple) -> None:
    """The rotation + KV store kernel (each row's newest key written to its slot, `slots`), then the
    attention call: the two launches of a decode layer in a row."""
    qkv, positions, cos_sin, q_heads, kv_heads = rope
    rope_write_kv(qkv, positions, cos_sin, q_heads, kv_heads, problem.inputs[1], problem.inputs[2], slots)
    problem.run()


def _plain_read_us(src: torch.Tensor, sink: torch.Tensor, programs: int, per: int, stride: int, copies: int):
    """us per call of a plain read of programs x per bf16 elements, each call at its own offset."""
    return graph_time_us(
        lambda i: _stream_loop_kernel[(programs,)](src[(i % copies) * stride :], sink, per, STEP=4096),
        2 * copies,
    )


def fixed_cost(args, hbm) -> list[dict]:
    """Decode attention at batch 64, 4k context, over windows of 256-4096 keys: time per call against the
    KV bytes read, fitted as t = t0 + bytes / bandwidth, for the launch as shipped and with PDL off, each
    alone (back-to-back calls over copies, in a CUDA graph) and after the rotation + KV store kernel, as a
    decode layer runs it; beside them a plain read of the same bytes over as many programs (one per row
    and kv head), the floor for a launch of that shape. t0 is what a launch costs beyond its bytes: paid
    once a layer, it is most of what separates a 1024-key window's attention from the copy bandwidth."""
    rows = []
    for label, q_heads, kv_heads, head_dim in FIXED_COST_HEADS:
        heads = argparse.Namespace(
            **{**vars(args), "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim}
        )
        variants = ("shipped", "PDL off")
        fits: dict[str, list[tuple[float, float]]] = {f"{v}{m}": [] for v in variants for m in ("", " +rope")}
        fits["plain read"] = []
        for window in FIXED_COST_WINDOWS:
            one = Problem(64, 1, 4096, window, heads)
            copies = [one] + [
                Problem(64, 1, 4096, window, heads) for _ in range(max(1, (160 << 20) // one.kv_bytes()))
            ]
            kv_bytes = one.kv_bytes()
            # A rotation launch before each call, as a layer runs: qkv of 64 tokens, each written to the
            # slot of its row's newest key.
            newest = 4095  # each row's newest key: the one the rotation kernel writes
            qkv = torch.randn(64, (q_heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
            positions = torch.full((64,), newest, dtype=torch.int64, device="cuda")
            cos_sin = torch.randn(newest + 1, head_dim, device="cuda")
            slots = [
                p.inputs[3][:, newest // args.block_size].long() * args.block_size + newest % args.block_size
                for p in copies
            ]
            rope = (qkv, positions, cos_sin, q_heads, kv_heads)
            for p, sl in zip(copies, slots, strict=True):  # the newest keys as every timed call leaves them
                _rope_then_attend(p, sl, rope)
            ref = one.run().clone()
            row = {"case": f"{label} B=64 ctx=4096 W={window}", "kv_MB": kv_bytes / 1e6}
            for name in variants:
                saved_pdl = _pdl.set_enabled(name != "PDL off")
                try:
                    diff = (one.run().float() - ref.float()).abs().max().item()
                    assert diff == 0.0, f"{name}: differs from the shipped launch by {diff}"
                    us = graph_time_us(lambda i, c=copies: c[i % len(c)].run(), 2 * len(copies))
                    pair_us = graph_time_us(
                        lambda i, c=copies, sl=slots, r=rope: _rope_then_attend(
                            c[i % len(c)], sl[i % len(c)], r
                        ),
                        2 * len(copies),
                    )
                finally:
                    _pdl.set_enabled(saved_pdl)
                row[name], row[f"{name} +rope"] = us, pair_us
                fits[name].append((kv_bytes, us))
                fits[f"{name} +rope"].append((kv_bytes, pair_us))
            src = torch.randn(len(copies) * kv_bytes // 2 + 4096, device="cuda", dtype=torch.bfloat16)
            sink = torch.empty(64 * kv_heads, device="cuda")
            per = kv_bytes // 2 // (64 * kv_heads) // 4096 * 4096
            read = _plain_read_us(src, sink, 64 * kv_heads, per, kv_bytes // 2, len(copies))
            row["plain read"] = read * kv_bytes / (64 * kv_heads * per * 2)  # scaled to the same bytes
            fits["plain read"].append((kv_bytes, row["plain read"]))
            rows.append(row)
            print(
                f"{row['case']:<28} {kv_bytes / 1e6:7.1f} MB  "
                + "  ".join(f"{k}: {v:.2f}" for k, v in row.items() if isinstance(v, float) and k != "kv_MB"),
                flush=True,
            )
            del copies, src
            torch.cuda.empty_cache()
        for name, points in fits.items():
            t0, slope = _fit_line([b for b, _ in points], [t for _, t in points])
            bw = 1e6 / slope if slope > 0 else float("nan")  # slope: us per byte
            print(
                f"  {label} {name:<24} t0 {t0:6.2f} us, {bw / 1e9:6.0f} GB/s ({bw / hbm:.2f} of copy)",
                flush=True,
            )
            rows.append({"case": f"{label} fit", "variant": name, "t0_us": t0, "GBps": bw / 1e9})
    return rows


def prefill_variants() -> list[AttentionLaunch]:
    """Tile-layout candidates for PREFILL_LAUNCH (10): 64 or 128 score rows x 64 or 128 keys, on 4 warps
    for 64 x 64 and 8 for the rest (64 x 128 and 128 x 64 on 4 warps spill registers: ptxas for sm_90,
    Triton 3.6), 2 or 3 stages, and 4 for 64-key steps."""
    return [
        AttentionLaunch(block_m=m, block_n=n, num_warps=4 if m == n == 64 else 8, num_stages=s)
        for m in (64, 128)
        for n in (64, 128)
        for s in ((2, 3, 4) if n == 64 else (2, 3))
    ]


def decode_variants() -> list[AttentionLaunch]:
    """Row-layout candidates for DECODE_LAUNCH (8; the tile shrinks to 16 score rows whatever block_m
    says): 32, 64 or 128 keys per step at 2 or 3 stages, 64 at 4 stages, and 64 on 2 warps."""
    variants = [
        AttentionLaunch(block_n=n, num_stages=s, row_programs=True) for n in (32, 64, 128) for s in (2, 3)
    ]
    variants.append(AttentionLaunch(block_n=64, num_stages=4, row_programs=True))
    variants.append(AttentionLaunch(block_n=64, num_warps=2, row_programs=True))
    return variants


def precompile(jobs: list[tuple[Problem, AttentionLaunch]]) -> None:
    """Compiles every variant up front on a thread pool (Triton's compiler and ptxas release the GIL),
    so the sweep is not 18 serial compiles. Uses Triton's private AsyncCompileMode (in 3.6); where it is
    missing or a compile fails here, the sweep compiles that variant on first use and reports its error.
    """
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        print("precompile: no AsyncCompileMode in this Triton; compiling variants one by one")
        return
    start = time.monotonic()
    try:
        with (
            ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool,
            AsyncCompileMode(pool, ignore_errors=True),
        ):
            for problem, launch in jobs:
                problem.compile(launch)
    except Exception as exc:  # a private Triton API: never let it stop the sweep
        print("precompile failed, compiling variants one by one:", _error_line(exc))
        return
    print(f"precompile: {len(jobs)} variants in {time.monotonic() - start:.1f} s")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _ms_list(names: list[str], times: list[float]) -> str:
    return "  ".join(f"{n} {ms:.3f} ms" for n, ms in zip(names, times, strict=True))


def _error_line(exc: Exception) -> str:
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:80] if lines else ''}"


def sweep(args, hbm) -> list[dict]:
    """Times every variant on every sweep shape; rows print as they finish, so a cut-off log still
    holds the variants timed so far. Variants that fail (e.g. out of shared memory) are listed too."""
    only = re.compile(args.only) if args.only else None
    deadline = time.monotonic() + args.sweep_budget_s
    prefill = [Problem(b, s, s, 0, args) for b, s in PREFILL_SWEEP]
    decode = Problem(DECODE_SWEEP[0], 1, DECODE_SWEEP[1], 0, args)
    # Outputs of the default launch: each variant must reproduce them up to bf16 rounding.
    prefill_ref = prefill[0].run().clone()
    decode_ref = decode.run().clone()
    sdpa = [sdpa_ms(b, s, args) for b, s in PREFILL_SWEEP]
    names = [f"{'' if b == 1 else f'{b}x'}{s // 1024}k" for b, s in PREFILL_SWEEP]
    print("flash SDPA:", _ms_list(names, sdpa))

    # Tags show each launch as resolved for its problem (decode shrinks M to the group, warps filled in).
    group = args.q_heads // args.kv_heads
    swept = [
        (kind, launch, problem, launch_config(group, problem.q_len, launch)[1].tag())
        for kind, variants, problem in (
            ("prefill", prefill_variants(), prefill[0]),
            ("decode", decode_variants(), decode),
        )
        for launch in variants
    ]
    swept = [job for job in swept if only is None or only.search(f"{job[0]} {job[3]}")]
    precompile([(problem, launch) for _, launch, problem, _ in swept])

    rows: list[dict] = []
    for kind in ("prefill", "decode"):
        print(f"\n== {kind} variants (tile as launched: score rows M, keys N, warps, stages)")
        for launch, tag in ((launch, tag) for k, launch, _, tag in swept if k == kind):
            row = {"kind": kind, "variant": tag, "launch": dataclasses.asdict(launch)}
            if time.monotonic() > deadline:
                row["error"] = "skipped: --sweep-budget-s spent"
            else:
                try:
                    if kind == "prefill":
                        row["max_diff"] = _max_diff(prefill[0].run(launch), prefill_ref)
                        for name, problem, ref_ms in zip(names, prefill, sdpa, strict=True):
                            ms = problem.time_ms(launch)
                            row[f"{name}_ms"], row[f"{name}_vs_sdpa"] = ms, ref_ms / ms
                    else:
                        row["max_diff"] = _max_diff(decode.run(launch), decode_ref)
                        ms = decode.time_ms(launch)
                        row["ms"], row["of_hbm"] = ms, decode.kv_bytes() / (ms * 1e-3) / hbm
                except Exception as exc:  # out of shared memory or registers for this tile, ...
                    row["error"] = _error_line(exc)
            rows.append(row)
            print(format_sweep_row(row, names), flush=True)
    # SDPA again at the end: a drift between the two readings bounds the clock / thermal noise.
    sdpa_end = [sdpa_ms(b, s, args) for b, s in PREFILL_SWEEP]
    print("\nflash SDPA at the end:", _ms_list(names, sdpa_end))
    print_sorted(rows, names)
    rows.append({"kind": "sdpa", "shapes": names, "start_ms": sdpa, "end_ms": sdpa_end})
    return rows


def format_sweep_row(row: dict, names: list[str]) -> str:
    head = f"{row['variant']:<24}"
    if "error" in row:
        return f"{head} {row['error']}"
    if row["kind"] == "prefill":
        cells = [f"{n} {row[f'{n}_ms']:7.3f} ms {row[f'{n}_vs_sdpa']:.3f}x" for n in names]
    else:
        cells = [f"{row['ms']:7.3f} ms {row['of_hbm']:.3f} of copy bw"]
    return f"{head} {'  '.join(cells)}  max_diff {row['max_diff']:.2e}"


def print_sorted(rows: list[dict], names: list[str]) -> None:
    """The same rows again, fastest first (prefill by the 8k time, decode by time): a reading aid."""
    key8k = f"{names[1]}_ms"
    timed = [r for r in rows if "error" not in r]
    print(f"\n== prefill variants by {names[1]} time")
    for row in sorted((r for r in timed if r["kind"] == "prefill"), key=lambda r: r[key8k]):
        print(format_sweep_row(row, names))
    print("\n== decode variants by time")
    for row in sorted((r for r in timed if r["kind"] == "decode"), key=lambda r: r["ms"]):
        print(format_sweep_row(row, names))


def host_us_per_call(fn, calls: int = 200, warmup: int = 20) -> float:
    """Wall time per call of `calls` back-to-back calls of fn and no synchronize between them (the host's
    cost, which an eager call pays whatever the GPU does), after `warmup` calls and a synchronize."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host_us


def eager_check(args) -> list[dict]:
    """Batch 1 and 8 at 8k context on the default table's heads, one call timed four ways: host time per
    call (launches only, no sync), triton's do_bench (eager launches, as the default table), a CUDA
    graph of the same call, and each kernel's median GPU time (torch.profiler). Shows whether an eager
    row measures the kernels or the Python and launch cost in front of them."""
    rows = []
    for batch in (1, 8):
        problem = Problem(batch, 1, 8192, 0, args)
        host_us = host_us_per_call(problem.run)
        eager_us = triton.testing.do_bench(problem.run, warmup=25, rep=100) * 1e3
        graph_us = graph_time_us(lambda i, p=problem: p.run(), 20)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                problem.run()
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(event.name, []).append(event.device_time_total)
        medians = {name: statistics.median(times) for name, times in kernels.items()}
        row = {
            "batch": batch,
            "host_us": host_us,
            "eager_us": eager_us,
            "graph_us": graph_us,
            "kernels": medians,
        }
        rows.append(row)
        cells = ", ".join(f"{name} {us:.2f} us" for name, us in medians.items())
        print(
            f"B={batch} ctx=8192: host {host_us:.1f} us a call, eager (do_bench) {eager_us:.1f} us, "
            f"CUDA graph {graph_us:.2f} us; kernels: {cells}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--sweep", action="store_true", help="time the tiles of both layouts first")
    parser.add_argument("--only", help="sweep only variants whose 'prefill TAG' / 'decode TAG' matches")
    parser.add_argument(
        "--sweep-budget-s", type=float, default=150.0, help="start no sweep variant after this many seconds"
    )
    parser.add_argument(
        "--split-sweep", action="store_true", help="also time split counts, key steps, keys per split"
    )
    parser.add_argument(
        "--split-tune",
        action="store_true",
        help="also time split counts, key steps and stages of small split batches",
    )
    parser.add_argument(
        "--split-only",
        action="store_true",
        help="only the split-KV cases and Gemma-3-4B's heads (no layouts, default table or prefill)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="block tables this many keys wide (the model's max_model_len; 0: each problem's context)",
    )
    parser.add_argument(
        "--fixed-cost",
        action="store_true",
        help="only a decode launch's fixed cost at batch 64 over windows (PDL on and off, a plain read)",
    )
    parser.add_argument(
        "--eager-check", action="store_true", help="only time batch 1 and 8 eager, in a graph and per kernel"
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    if args.eager_check:
        eager_check(args)
        return

    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {hbm / 1e9:.0f} GB/s")
    if args.fixed_cost:
        print("\n== decode at batch 64: us per call in a CUDA graph, fitted t0 + bytes / bandwidth")
        rows = fixed_cost(args, hbm)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "fixed_cost": rows}, f, indent=1)
        return
    sweep_rows = sweep(args, hbm) if args.sweep else []
    layout_rows = []
    if not args.split_only:
        print("\n== decode layouts (us per call in a CUDA graph, share of copy bandwidth)")
        layout_rows = decode_layouts(args, hbm)
    floor_rows = []
    if args.split_only:
        print("\n== floors for a small decode call (us per call in a CUDA graph, share of copy bandwidth)")
        floor_rows = small_read_floors(hbm)
    print("\n== split-KV decode, bench heads (us per call in a CUDA graph, share of copy bandwidth)")
    split_rows = split_decode(args, hbm)
    print("\n== decode, Gemma-3-4B heads (us per call in a CUDA graph, share of copy bandwidth; fastest 8)")
    wide_rows = wide_head_decode(args, hbm)
    if args.split_only:
        if args.json:
            with open(args.json, "w") as f:
                payload = {"device": torch.cuda.get_device_name(), "args": vars(args)}
                payload.update(split_decode=split_rows, wide_head_decode=wide_rows, floors=floor_rows)
                json.dump(payload, f, indent=1)
        return
    rows = []
    for batch, context in [(1, 8192), (8, 8192), (64, 4096), (256, 2048), (128, 8192)]:
        rows.append(bench_decode(batch, context, 0, args, hbm))
    rows.append(bench_decode(64, 8192, 1024, args, hbm))
    for batch, seq in [(1, 1024), (1, 4096), (4, 4096), (1, 16384)]:
        rows.append(bench_prefill(batch, seq, 0, args))
    rows.append(bench_prefill(1, 16384, 1024, args))
    print("\n== default launch")
    for row in rows:
        print(
            "  ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" if isinstance(v, int) else f"{v:<32}"
                for k, v in row.items()
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            payload = {
                "device": torch.cuda.get_device_name(),
                "args": vars(args),
                "rows": rows,
                "decode_layouts": layout_rows,
                "split_decode": split_rows,
                "wide_head_decode": wide_rows,
            }
            if sweep_rows:
                payload["sweep"] = sweep_rows
            json.dump(payload, f, indent=1)
    assert all(math.isfinite(r["ms"]) for r in rows if "ms" in r)


if __name__ == "__main__":
    main()
