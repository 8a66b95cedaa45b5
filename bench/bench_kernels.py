"""Launch-bound kernels against an empty Triton kernel, and the engram hash + row gather of a decode step.

gather_lookback and pad_replayed_slots move a few KB per step, so what they cost is their launch: the goal
is each within 1.3x of an empty Triton kernel's launch, measured in the same run, and never a host sync.
engram_hash plus the engram table row gather (`table[rows]` in Engram.fuse) should together stay under 5%
of a bench-model decode step (batch 64, 2k context).

Two figures per kernel, each also as a ratio to the empty kernel:
- host: wall time per call of ITERS back-to-back calls, then one synchronize (median over rounds that
  interleave all kernels, so drift hits each alike). The GPU finishes each of these kernels faster than
  the host issues the next one, so this is the launcher's CPU cost: what "launch-bound" means.
- device: GPU time per call inside a CUDA graph of LAUNCHES calls (CUDA events around a replay, median
  over replays), i.e. the cost once the host is out of the way, as in a graph-captured decode step.
Rows marked "diagnostic" split the host cost: "direct" launches the same kernel as `kernel[grid](*args)`
with the arguments precomputed (Triton's own dispatch for that argument list), and "empty via FastLaunch"
launches the empty kernel the way the launchers launch theirs (`raystate.kernels._launch.FastLaunch`,
which skips Triton's per-call dispatch once a signature is compiled): the "x fast" column is each row
against that, like for like. Every launch path is checked against the PyTorch reference first.

    python3 bench/bench_kernels.py [--json out.json] [--decode-step-ms 2.079]
    TRITON_INTERPRET=1 python3 bench/bench_kernels.py --smoke    # CPU: tiny sizes, checks the script runs

--decode-step-ms is the bench-model decode step to compare the engram cost with (2.079 ms with CUDA graphs
and async scheduling at batch 64, 2k context in bench/results/decode_h200.log; bench/bench_decode.py
measures it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from bench_decode import graph_time_us

from raystate.config import ModelConfig
from raystate.kernels import (
    PAD_SLOT_ID,
    compute_slot_mappings,
    compute_slot_mappings_ref,
    engram_hash_ref,
    gather_lookback,
    gather_lookback_ref,
    pad_replayed_slots,
    pad_replayed_slots_ref,
)
from raystate.kernels._common import interpreting
from raystate.kernels._launch import FastLaunch, fast_launch_enabled
from raystate.kernels.lookback import _BLOCK_IDS as LOOKBACK_BLOCK
from raystate.kernels.lookback import _gather_lookback_kernel
from raystate.kernels.slot_mapping import _BLOCK_TOKENS as SLOT_BLOCK
from raystate.kernels.slot_mapping import _compute_slot_mappings_kernel, _pad_replayed_slots_kernel
from raystate.model.engram import Engram

HOST_GOAL = 1.3  # x the empty kernel's host cost, for the launch-bound kernels
ENGRAM_SHARE_GOAL = 0.05  # of a decode step, engram hash + row gather over all engram layers


@triton.jit(do_not_specialize=["n"])  # so FastLaunch can relaunch it too (the diagnostic row)
def _empty_kernel(ptr, n):
    # One program whose only store is masked off (n = 0): the launch and nothing else.
    pid = tl.program_id(0)
    tl.store(ptr + pid, pid, mask=pid < n)


_empty_fast = FastLaunch(_empty_kernel, pointer_args=(0,))


@dataclass
class Case:
    """One launch path of one kernel, with what it takes to check its result.

    `reset` restores the output to its state before a call, `expected` is the reference result, so
    `check(fn)` proves a launch path computes the right thing before it is timed.
    """

    name: str
    fn: Callable[[], object]
    output: torch.Tensor | None = None
    expected: torch.Tensor | None = None
    reset: Callable[[], None] = lambda: None
    goal: float | None = None  # host ratio goal, for the rows the issue sets one on
    diagnostic: bool = False
    notes: list[str] = field(default_factory=list)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(case: Case, device: torch.device) -> None:
    if case.output is None:
        case.fn()
        return
    case.reset()
    case.fn()
    sync(device)
    assert torch.equal(case.output, case.expected), f"{case.name}: result differs from the reference"


def host_us(cases: list[Case], iters: int, rounds: int, device: torch.device) -> dict[str, float]:
    """Per-call wall time of `iters` back-to-back calls and one synchronize, median over `rounds`.

    The rounds interleave the cases, so a slow patch of the host hits every case alike.
    """
    samples: dict[str, list[float]] = {c.name: [] for c in cases}
    for c in cases:
        c.fn()  # first calls (compile, allocator, dispatch caches) stay out of the figures
    for _ in range(rounds):
        for c in cases:
            fn = c.fn
            sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync(device)
            samples[c.name].append((time.perf_counter() - t0) / iters * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def graph_us(fn: Callable[[], object], launches: int, replays: int) -> float:
    """GPU time per call inside one CUDA graph of `launches` calls: events around a replay, median."""
    return graph_time_us(lambda _: fn(), launches, replays)


def host_syncs(fn: Callable[[], object]) -> str:
    """'none' unless the call makes torch synchronize with the device (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return f"SYNC ({str(exc).splitlines()[0][:60]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return "none"


def add_direct_row(cases: list[Case], base: Case, kernel, grid: tuple, args: tuple) -> None:
    """Appends the diagnostic "direct" row of `base`'s kernel: `kernel[grid](*args)`, checked first.

    `args` must repeat the launcher's argument list exactly (constexpr tuples included), so this row and
    the launcher share one compiled kernel and differ only by the launcher's own Python.
    """
    cases.append(
        Case(
            f"  {base.name.split()[0]} direct",
            lambda: kernel[grid](*args),
            base.output,
            base.expected,
            base.reset,
            diagnostic=True,
        )
    )


def lookback_cases(rows: int, depth: int, history: int, device: torch.device, gen: torch.Generator):
    """gather_lookback over R rows, all requests live, chunk starts anywhere in an L-token history."""
    all_token_ids = torch.randint(0, 50_000, (rows, history), generator=gen, dtype=torch.int32).to(device)
    num_computed = torch.randint(0, history + 1, (rows,), generator=gen, dtype=torch.int32).to(device)
    # The worker's idx_mapping is an int64 slice of its packed per-step buffer.
    idx_mapping = torch.randperm(rows, generator=gen).to(device)
    lookback = torch.full((rows, depth), -1, dtype=torch.int32, device=device)
    expected = torch.empty_like(lookback)
    gather_lookback_ref(expected, idx_mapping, num_computed, all_token_ids, rows)

    def wrapper():
        gather_lookback(lookback, idx_mapping, num_computed, all_token_ids, rows)

    base = Case(
        f"gather_lookback R={rows} D={depth}",
        wrapper,
        lookback,
        expected,
        lambda: lookback.fill_(12345),
        goal=HOST_GOAL,
    )
    cases = [base]
    # As gather_lookback passes them: the layout tuple (D, history row stride, R * D) is one constexpr.
    args = (
        lookback,
        idx_mapping,
        num_computed,
        all_token_ids,
        rows,
        (depth, all_token_ids.stride(0), rows * depth),
    )
    add_direct_row(cases, base, _gather_lookback_kernel, (triton.cdiv(rows * depth, LOOKBACK_BLOCK),), args)
    return cases


def slot_cases(
    rows: int,
    chunk: int,
    groups: int,
    cacheable: list[int],
    window: int,
    block_size: int,
    device: torch.device,
    gen: torch.Generator,
):
    """A prefill batch of R rows of `chunk` tokens each (T = R * chunk), every row replaying from a
    nonzero start a few tokens before its chunk, G groups of which `cacheable` are prefix-cacheable."""
    num_tokens = rows * chunk
    starts = torch.randint(window, 4 * window + 1, (rows,), generator=gen)  # chunk starts
    positions = (starts[:, None] + torch.arange(chunk)[None, :]).reshape(-1)  # int64 [T]
    replay_start = (starts - torch.randint(0, chunk, (rows,), generator=gen)).to(torch.int32)  # >= 1
    qsl = (torch.arange(rows + 1) * chunk).to(torch.int32)
    max_blocks = -(-int(positions.max() + 1) // block_size)
    tables = torch.randint(1, 1 << 20, (groups, rows, max_blocks), generator=gen, dtype=torch.int32)
    idx_mapping = torch.randperm(rows, generator=gen)  # int64, as in the worker
    # The reference takes the cacheable groups as a tensor, the launcher as a tuple of host ints.
    cacheable_t = torch.tensor(cacheable, dtype=torch.int32)
    cacheable_groups = tuple(cacheable)
    initial = torch.randint(0, 1 << 24, (groups, num_tokens), generator=gen, dtype=torch.int64)

    pad_expected = initial.clone()
    pad_replayed_slots_ref(pad_expected, cacheable_t, qsl, positions, replay_start, window)
    slots_expected = torch.empty_like(initial)
    compute_slot_mappings_ref(tables, idx_mapping, qsl, positions, block_size, slots_expected)

    dev = {
        name: t.to(device)
        for name, t in dict(
            positions=positions,
            replay_start=replay_start,
            qsl=qsl,
            tables=tables,
            idx_mapping=idx_mapping,
            initial=initial,
            pad_expected=pad_expected,
            slots_expected=slots_expected,
        ).items()
    }
    pad_out = dev["initial"].clone()
    slots_out = torch.empty_like(dev["initial"])
    cases = []

    def pad():
        pad_replayed_slots(
            pad_out, cacheable_groups, dev["qsl"], dev["positions"], dev["replay_start"], window
        )

    base = Case(
        f"pad_replayed_slots R={rows} T={num_tokens} G={groups}",
        pad,
        pad_out,
        dev["pad_expected"],
        lambda: pad_out.copy_(dev["initial"]),
        goal=HOST_GOAL,
    )
    cases.append(base)
    blocks = (triton.cdiv(num_tokens, SLOT_BLOCK),)
    pad_args = (
        pad_out,
        pad_out.stride(0),
        dev["qsl"],
        dev["positions"],
        dev["replay_start"],
        rows,
        (cacheable_groups, window, PAD_SLOT_ID),  # one constexpr, as pad_replayed_slots passes it
    )
    add_direct_row(cases, base, _pad_replayed_slots_kernel, blocks, pad_args)

    def slots():
        compute_slot_mappings(
            dev["tables"], dev["idx_mapping"], dev["qsl"], dev["positions"], block_size, slots_out
        )

    base = Case(
        f"compute_slot_mappings R={rows} T={num_tokens} G={groups}",
        slots,
        slots_out,
        dev["slots_expected"],
        lambda: slots_out.fill_(-7),
    )
    cases.append(base)
    slot_args = (
        slots_out,
        slots_out.stride(0),
        dev["tables"],
        dev["idx_mapping"],
        dev["qsl"],
        dev["positions"],
        rows,
        num_tokens,
        (dev["tables"].stride(0), dev["tables"].stride(1), block_size),  # one constexpr, as the launcher's
    )
    add_direct_row(cases, base, _compute_slot_mappings_kernel, blocks + (groups,), slot_args)
    return cases


def bench_launches(args, device: torch.device) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    cases = [Case("empty Triton kernel", lambda: _empty_kernel[(1,)](flag, 0))]
    # The same empty kernel through the launchers' own path: what a launch costs once Triton's per-call
    # dispatch is gone (like for like with the kernels below when FastLaunch is on).
    cases.append(Case("  empty via FastLaunch", lambda: _empty_fast((1, 1, 1), flag, 0), diagnostic=True))
    cases += lookback_cases(args.rows, args.depth, args.history, device, gen)
    cases += slot_cases(args.rows, args.chunk, args.groups, [0, 2], args.window, args.block_size, device, gen)
    checked = []
    for c in cases:  # also compiles every kernel before any timing
        if not c.diagnostic:
            check(c, device)
            checked.append(c)
            continue
        try:
            check(c, device)
            checked.append(c)
        except Exception as exc:  # a diagnostic path this Triton does not take: say so, time the rest
            print(f"skipped {c.name.strip()}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
    cases = checked

    host = host_us(cases, args.iters, args.rounds, device)
    on_cuda = device.type == "cuda"
    dev_us = {c.name: graph_us(c.fn, args.graph_launches, args.replays) for c in cases} if on_cuda else {}
    empty = cases[0].name
    fast_empty = "  empty via FastLaunch" if "  empty via FastLaunch" in host else empty
    rows = []
    for c in cases:
        row = {
            "case": c.name,
            "host_us": host[c.name],
            "host_x_empty": host[c.name] / host[empty],
            "host_x_fast_empty": host[c.name] / host[fast_empty],
            "device_us": dev_us.get(c.name),
            "device_x_empty": dev_us[c.name] / dev_us[empty] if on_cuda else None,
            "diagnostic": c.diagnostic,
        }
        if on_cuda and not c.diagnostic:
            row["host_sync"] = host_syncs(c.fn)
        if on_cuda and row["device_us"] >= 0.9 * row["host_us"]:
            # The GPU took about as long as the host to issue: the host figure may be the device's pace.
            c.notes.append("device time near host time: host figure may be device-bound")
        if c.goal is not None:
            row["goal"] = f"host <= {c.goal}x empty, no host sync"
            if on_cuda:  # the interpreter's figures say nothing about launch cost
                row["met"] = row["host_x_empty"] <= c.goal and row["host_sync"] == "none"
        if c.notes:
            row["notes"] = c.notes
        rows.append(row)
    return rows


def bench_engram(args, device: torch.device) -> dict:
    """engram_hash + table row gather for T decode tokens, per engram layer of the bench model."""
    cfg = ModelConfig.named("bench")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1)
    tokens = args.decode_tokens
    depth = cfg.token_lookback_depth
    input_ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen, dtype=torch.int32).to(device)
    qsl = torch.arange(tokens + 1, dtype=torch.int32, device=device)  # one token per row: decode
    lookback = torch.randint(0, cfg.vocab_size, (tokens, depth), generator=gen, dtype=torch.int32).to(device)
    layers = []
    for layer_id in sorted(set(cfg.engram_layer_ids)):
        engram = Engram(cfg, layer_id).to(device=device, dtype=dtype)  # int64 hash buffers stay int64
        with torch.no_grad():
            engram.table.normal_(0.0, 0.02)
        rows = engram.hash(input_ids, qsl, lookback)
        # The Triton path against the reference on the same inputs, before any timing.
        expected = engram_hash_ref(
            input_ids, qsl, lookback, engram.compress, engram.multipliers, engram.primes, engram.offsets,
            engram.pad_id,
        )  # fmt: skip
        assert torch.equal(rows, expected), f"engram layer {layer_id}: hash differs from the reference"
        table = engram.table

        def hash_only(e=engram):
            return e.hash(input_ids, qsl, lookback)

        def gather_only(t=table, r=rows):
            return t[r]

        def both(e=engram, t=table):
            return t[e.hash(input_ids, qsl, lookback)]

        fns = {"hash": hash_only, "gather": gather_only, "hash+gather": both}
        if device.type == "cuda":
            times = {k: graph_us(f, args.graph_launches, args.replays) for k, f in fns.items()}
            method = "device (CUDA graph)"
        else:
            times = host_us([Case(k, f) for k, f in fns.items()], args.iters, args.rounds, device)
            method = "host (CPU smoke)"
        layers.append(
            {
                "layer": layer_id,
                "table_rows": table.shape[0],
                "columns": engram.num_columns,
                **{f"{k}_us": v for k, v in times.items()},
            }
        )
        del engram, table
    total = sum(row["hash+gather_us"] for row in layers)
    out = {"tokens": tokens, "method": method, "layers": layers, "total_us": total}
    if args.decode_step_ms:
        out["decode_step_ms"] = args.decode_step_ms
        out["share"] = total / (args.decode_step_ms * 1e3)
        out["met"] = out["share"] < ENGRAM_SHARE_GOAL
    return out


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def print_launches(rows: list[dict]) -> None:
    head = ["case", "host us", "x empty", "x fast", "device us", "x empty", "host sync", "goal met"]
    widths = [46, 9, 8, 8, 10, 8, 10, 8]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    for r in rows:
        cells = [
            r["case"] + (" (diagnostic)" if r["diagnostic"] else ""),
            fmt(r["host_us"]),
            fmt(r["host_x_empty"]),
            fmt(r["host_x_fast_empty"]),
            fmt(r["device_us"]),
            fmt(r["device_x_empty"]),
            r.get("host_sync", "-"),
            {True: "yes", False: "NO"}.get(r.get("met"), "-"),
        ]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
        for note in r.get("notes", []):
            print(f"    note: {note}")


def print_engram(e: dict) -> None:
    print(f"engram (bench model) at T={e['tokens']} decode tokens, {e['method']} us per call:")
    for row in e["layers"]:
        print(
            f"  layer {row['layer']:>2} ({row['table_rows']} rows x {row['columns']} columns): "
            f"hash {row['hash_us']:.2f}  gather {row['gather_us']:.2f}  "
            f"hash+gather {row['hash+gather_us']:.2f}"
        )
    line = f"  all {len(e['layers'])} engram layers: {e['total_us']:.2f} us"
    if "share" in e:
        line += (
            f" = {100 * e['share']:.2f}% of a {e['decode_step_ms']:.3f} ms decode step "
            f"(goal < {100 * ENGRAM_SHARE_GOAL:.0f}%: {'yes' if e['met'] else 'NO'})"
        )
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="max_num_reqs: lookback rows, batch rows")
    parser.add_argument("--depth", type=int, default=3, help="D, lookback ids per row")
    parser.add_argument("--history", type=int, default=8192 + 64, help="L, all_token_ids columns")
    parser.add_argument("--chunk", type=int, default=8, help="tokens per row: T = rows * chunk")
    parser.add_argument("--groups", type=int, default=4, help="G; groups 0 and 2 are prefix-cacheable")
    parser.add_argument("--window", type=int, default=128, help="P, the replay length")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64, help="T for the engram rows (batch 64)")
    parser.add_argument("--decode-step-ms", type=float, help="a bench-model decode step, for the share")
    parser.add_argument("--iters", type=int, default=2000, help="back-to-back calls per host sample")
    parser.add_argument("--rounds", type=int, default=7, help="host samples per case (median)")
    parser.add_argument("--graph-launches", type=int, default=200, help="calls captured in one graph")
    parser.add_argument("--replays", type=int, default=20, help="graph replays per case (median)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and counts; runs on the CPU")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.history, args.chunk, args.window = 8, 64, 4, 8
        args.decode_tokens, args.iters, args.rounds, args.graph_launches, args.replays = 4, 2, 1, 4, 2

    if torch.cuda.is_available():
        device = torch.device("cuda")
        name = torch.cuda.get_device_name()
    else:
        if not (args.smoke and interpreting()):
            parser.error("needs CUDA, or --smoke with TRITON_INTERPRET=1 on the CPU")
        device, name = torch.device("cpu"), "CPU (Triton interpreter)"
    method = (
        f"host: {args.iters} back-to-back calls + one synchronize, median of {args.rounds} interleaved "
        f"rounds; device: CUDA graph of {args.graph_launches} calls, CUDA events, median of {args.replays} "
        "replays"
    )
    print(
        f"{name}, torch {torch.__version__}, triton {triton.__version__}, "
        f"FastLaunch {'on' if fast_launch_enabled() else 'off'}"
    )
    print(f"method: {method}" + ("" if device.type == "cuda" else " (no device timing on the CPU)"))

    with torch.inference_mode():  # as the worker runs the model: no autograd records on the hot path
        launches = bench_launches(args, device)
        print_launches(launches)
        engram = bench_engram(args, device)
    print_engram(engram)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "method": method,
                    "args": vars(args),
                    "launches": launches,
                    "engram": engram,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
