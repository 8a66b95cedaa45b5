"""End-to-end decode step of the `bench` model (~1B), or of any `--model` (a Hugging Face checkpoint
folder), on one GPU: CUDA graphs with and without async scheduling, and eager.

Measures, in one run: the two ceilings (device-to-device copy bandwidth, bf16 matmul rate), then a
decode batch of B requests at C tokens of context through the in-process engine, and reports the decode
step time against its floor: (weight bytes + KV bytes the step must read) / copy bandwidth.

    python3 bench/bench_decode.py [--batch 64] [--context 2048] [--steps 32] [--plot decode.png]
    python3 bench/bench_decode.py --model /ckpt/qwen3-8b --context 4096 --configs "graphs + async"

Several configurations run one after another in one process, and a later one can run slower than the
same configuration alone (0.3 ms, 3.5%, of a Gemma-3-4B step on an H100: BENCHMARKS.md, "Where the rest
of the step goes"): to compare two, run each in its own process (one --configs label each), alternating.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time

import numpy as np
import torch
import triton.testing

from raystate import LLM, SamplingParams


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def graph_time_us(fn, calls: int, replays: int = 20) -> float:
    """Per-call GPU time of `calls` calls of fn (each call takes its call index) in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def decode_floor_bytes(llm: LLM, batch: int, context: int) -> tuple[int, int]:
    model = llm.engine.worker.model
    # Every weight is read once per step, but an untied embedding table only at the batch's rows.
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.embed.weight is not model.lm_head.weight:
        weights -= model.embed.weight.numel() * model.embed.weight.element_size()
    cfg = model.config
    elt = next(model.parameters()).element_size()
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * elt  # k and v of one layer
    kv = 0
    for t in cfg.layer_types:
        kv += per_token * (min(context, cfg.sliding_window) if t == "sliding" else context)
    return weights, kv * batch


def run(
    graphs: bool,
    async_scheduling: bool,
    batch: int,
    context: int,
    steps: int,
    profile_steps: int = 0,
    model: str = "bench",
    logprobs: int | None = None,
) -> tuple[list[float], LLM, list[list[int]], object]:
    """Decodes `steps` tokens for `batch` requests; returns the decode step times, the LLM, each request's
    tokens and, with profile_steps > 0, a torch.profiler run over that many steady decode steps (from
    the tenth on; those steps' times are then not representative).

    The prompts are prefilled over several steps, and a request decodes from the step its prefill ends,
    so each request asks for `steps` tokens more than the prefill takes steps: the `steps` timed steps
    all run the whole batch (a request that finished would shrink the batch, and the KV the step reads,
    inside the timed window)."""
    prefill_steps = -(-batch * context // 8192) + 2
    max_tokens = steps + prefill_steps + 2
    max_len = context + max_tokens + 16
    blocks = batch * (-(-max_len // 16) + 1) + 1
    llm = LLM(
        model=model,
        device="cuda",
        backend="inprocess",
        cuda_graphs=graphs,
        async_scheduling=async_scheduling,
        max_num_seqs=batch,
        max_model_len=max_len,
        num_blocks=blocks,
        max_num_batched_tokens=8192,
    )
    rng = np.random.default_rng(0)
    vocab = min(llm.config.model.vocab_size, 1000)
    prompts = [rng.integers(0, vocab, context).tolist() for _ in range(batch)]
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}
    clock = ReplayClock(llm) if graphs and torch.cuda.is_available() else None
    if clock is not None:
        print(
            f"  CUDA graphs captured in {engine.worker.startup_s.get('cuda_graphs', 0.0):.2f} s", flush=True
        )
    # Step time = the interval between successive step() calls once every request decodes, with no
    # device sync in the loop (a sync would stop async scheduling's overlap): in steady state the loop
    # runs at the pace of the slower of host and device, which is the rate a server would see.
    times = []
    last = None
    prof = None
    while engine.has_unfinished():
        decoding = all(len(v) > 0 for v in tokens.values())
        if profile_steps and decoding and len(times) == 10 and prof is None:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.start()
        if clock is not None:
            clock.waited = 0.0
            clock.active = decoding and last is not None and len(times) < steps and prof is None
        updates = engine.step()
        now = time.perf_counter()
        if decoding and last is not None and len(times) < steps:
            times.append(now - last)
            if clock is not None and clock.active:
                clock.host_busy.append(now - last - clock.waited)
            if prof is not None and len(times) == 10 + profile_steps:
                torch.cuda.synchronize()
                prof.stop()
        last = now if decoding else None
        for u in updates:
            tokens[u.req_id].extend(u.new_token_ids)
    torch.cuda.synchronize()
    if clock is not None:
        clock.restore()
        clock.report()
    return times, llm, [tokens[f"r{i}"] for i in range(batch)], prof


class ReplayClock:
    """Where a graph step's wall time goes, without a sync in the loop, over the timed steps (`active`):
    CUDA events around each graph replay (its staged-input copy and the graph) give the GPU's time per
    replay and the interval from one replay's start to the next, whose rest is the GPU outside the graph
    (the sampled ids' copy back, the next replay's launch, or waiting for the host). On the host: the
    time inside `replay` (staging and the graph launch), and the step's wall time less the time blocked
    waiting for the device's answer (ReadyEvent.synchronize)."""

    def __init__(self, llm: LLM) -> None:
        from raystate.worker import cudagraph

        self._cudagraph = cudagraph
        self.graphs = llm.engine.worker.graphs
        self.active = False  # record this pass (a timed step)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.in_replay: list[float] = []  # s of host time inside replay(), per timed step
        self.host_busy: list[float] = []  # s per timed step: wall less waiting for the answer
        self.waited = 0.0
        replay, synchronize = self.graphs.replay, cudagraph.ReadyEvent.synchronize
        self._saved = (replay, synchronize)

        def timed_replay(*args, **kwargs):
            if not self.active:
                return replay(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            out = replay(*args, **kwargs)
            end.record()
            self.in_replay.append(time.perf_counter() - t)
            self.events.append((start, end))
            return out

        def timed_synchronize(ready):
            t = time.perf_counter()
            synchronize(ready)
            self.waited += time.perf_counter() - t

        self.graphs.replay = timed_replay
        cudagraph.ReadyEvent.synchronize = timed_synchronize

    def restore(self) -> None:
        del self.graphs.replay  # the instance attribute; the class's method shows again
        self._cudagraph.ReadyEvent.synchronize = self._saved[1]

    def report(self) -> None:
        pairs = self.events[2:]  # consecutive replays of the timed steps
        if len(pairs) < 3:
            return
        inside = [s.elapsed_time(e) * 1e3 for s, e in pairs[:-1]]  # us
        period = [a[0].elapsed_time(b[0]) * 1e3 for a, b in zip(pairs[:-1], pairs[1:], strict=True)]
        outside = [p - i for p, i in zip(period, inside, strict=True)]
        med = statistics.median
        in_replay = [t * 1e6 for t in self.in_replay[2:]]
        busy = [t * 1e6 for t in self.host_busy[2:]]
        print(
            f"  GPU per step: graph replay {med(inside):.1f} us, replay start to next {med(period):.1f} us, "
            f"outside the graph {med(outside):.1f} us (median; max {max(outside):.1f}). Host per step: "
            f"{med(in_replay):.0f} us inside replay() (max {max(in_replay):.0f}), "
            f"busy {med(busy):.0f} us (wall less waiting for the answer)",
            flush=True,
        )


# (label, CUDA graphs, async scheduling, variant): "unguarded" replaces the graph's checked greedy step
# with a plain argmax, to show the guard's cost side by side; "logprobs 5" asks every request for its
# sampled token's logprob and the top 5 (the logprobs variant of the graphs); "no split-KV" turns the
# split-KV decode attention off (one program per row and kv head), its before/after; "cuBLASLt" has
# torch issue the projections through cuBLASLt instead of cuBLAS (bench_blas.py times both); "no PDL"
# launches every kernel plainly (RAYSTATE_PDL=0); "fp32 greedy" takes the greedy ids as before 2026-12-05
# (the head's output converted to fp32, then torch's row max); "no split-K" runs every projection as one
# plain GEMM (RAYSTATE_SPLIT_K=0; raystate.kernels.split_k); "weights as stored" keeps every projection's
# weight row-major as loaded (RAYSTATE_WEIGHT_LAYOUT=as_stored; raystate.model.weight_layout); "bounds
# after wait" has the attention kernels read the row's bounds after their PDL wait (attention.EARLY_BOUNDS
# off). Those eight are run only when named in --configs.
CONFIGS = (
    ("graphs + async", True, True, "default"),
    ("graphs + async, unguarded argmax", True, True, "unguarded"),
    ("graphs + async + logprobs 5", True, True, "logprobs"),
    ("graphs + async + no split-KV", True, True, "no_split"),
    ("graphs + async + cuBLASLt", True, True, "cublaslt"),
    ("graphs + async + no PDL", True, True, "no_pdl"),
    ("graphs + async + fp32 greedy", True, True, "fp32_greedy"),
    ("graphs + async + no split-K", True, True, "no_split_k"),
    ("graphs + async + weights as stored", True, True, "as_stored"),
    ("graphs + async + bounds after wait", True, True, "late_bounds"),
    ("graphs", True, False, "default"),
    ("eager", False, False, "default"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--plot", default="", help="PNG of step time per configuration against the floor")
    ap.add_argument("--model", default="bench", help="a named model or a checkpoint folder")
    ap.add_argument("--configs", default="", help="comma-separated labels of CONFIGS to run (default: all)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="then profile 3 decode steps of each configuration run (one more run each)",
    )
    args = ap.parse_args()
    bw = copy_bandwidth()
    flops = matmul_rate()
    name = torch.cuda.get_device_name(0)
    print(f"{name}: copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    results = {}
    medians: dict[str, float] = {}
    floor = 0.0
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    for label, graphs, async_scheduling, layout in CONFIGS:
        if (chosen and label not in chosen) or (not chosen and layout in OPT_IN_VARIANTS):
            continue
        with step_variant(layout):
            times, llm, toks, _ = run(
                graphs,
                async_scheduling,
                args.batch,
                args.context,
                args.steps,
                model=args.model,
                logprobs=5 if layout == "logprobs" else None,
            )
        weights, kv = decode_floor_bytes(llm, args.batch, args.context)
        floor = (weights + kv) / bw
        med = statistics.median(times[2:])
        mean = statistics.fmean(times[2:])  # total decode time / steps: immune to uneven intervals
        results[label] = toks
        medians[label] = med
        print(
            f"decode B={args.batch} ctx={args.context} {label}: step median {med * 1e3:.3f} ms "
            f"(mean {mean * 1e3:.3f}, {mean / floor:.2f}x the floor; min {min(times) * 1e3:.3f}, "
            f"p90 {np.percentile(times, 90) * 1e3:.3f}, {len(times)} steps), floor {floor * 1e3:.3f} ms "
            f"(weights {weights / 1e9:.2f} GB + KV {kv / 1e9:.2f} GB), {med / floor:.2f}x the floor, "
            f"{args.batch / med:.0f} tokens/s",
            flush=True,
        )
        layer_types = llm.engine.worker.model.config.layer_types
        del llm
        torch.cuda.empty_cache()
        if args.profile and graphs:  # one more run of the same configuration, profiled
            with step_variant(layout):
                prof = run(True, async_scheduling, args.batch, args.context, args.steps, 3, args.model)[3]
            print(f"[{label}]", end=" ")
            print_profile(prof, 3, layer_types, floor)
            torch.cuda.empty_cache()
    # Every configuration against eager where it ran, else against the first one run.
    base_label = "eager" if "eager" in results else next(iter(results), None)
    for label in results if base_label is not None else ():
        if label != base_label:
            same = sum(a == b for a, b in zip(results[label], results[base_label], strict=True))
            print(f"{label} vs {base_label}: {same}/{args.batch} requests with identical tokens")
    if args.plot:
        plot(args.plot, medians, floor, args, name)


OPT_IN_VARIANTS = (
    "logprobs",
    "no_split",
    "cublaslt",
    "no_pdl",
    "fp32_greedy",
    "no_split_k",
    "as_stored",
    "late_bounds",
)


# variant: (module, constant, value for the run). "no_split": decode_kv_splits then gives 1.
_MODULE_CONSTANTS = {
    "late_bounds": ("raystate.kernels.attention", "EARLY_BOUNDS", False),
    "no_split": ("raystate.kernels.attention_launch", "SPLIT_PROGRAMS_PER_SM", 0),
}


@contextlib.contextmanager
def step_variant(variant: str):
    """ "unguarded": the graph's greedy step without the non-finite-row guard (a plain argmax), for its
    cost; "no_split": no split-KV decode attention; "cublaslt": projections through cuBLASLt;
    "no_pdl": every kernel launched plainly; "fp32_greedy": greedy ids from an fp32 copy of the head's
    output by torch's row max; "no_split_k": no split-K projections; "as_stored": projection weights
    row-major as loaded; "late_bounds": the attention kernels read the row's bounds after their PDL wait
    (attention.EARLY_BOUNDS off); "default" and "logprobs": as shipped."""
    if variant in ("default", "logprobs"):
        yield
        return
    if variant in ("no_pdl", "no_split_k", "as_stored"):  # a module's own on/off switch
        module = importlib.import_module(
            {
                "no_pdl": "raystate.kernels._pdl",
                "no_split_k": "raystate.kernels.split_k",
                "as_stored": "raystate.model.weight_layout",
            }[variant]
        )
        saved = module.set_enabled(False)
        try:
            yield
        finally:
            module.set_enabled(saved)
        return
    if variant == "fp32_greedy":
        from raystate.kernels.greedy import greedy_checked_ref
        from raystate.messages import FAILED_ROW
        from raystate.worker import cudagraph

        saved_guard = cudagraph.greedy_checked
        cudagraph.greedy_checked = lambda logits, out: out.copy_(
            greedy_checked_ref(logits.float(), FAILED_ROW)
        )
        try:
            yield
        finally:
            cudagraph.greedy_checked = saved_guard
        return
    if variant == "cublaslt":
        saved_library = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(saved_library)
        return
    if variant in _MODULE_CONSTANTS:  # a module constant set for the run, then restored
        module_name, attr, value = _MODULE_CONSTANTS[variant]
        module = importlib.import_module(module_name)
        saved = getattr(module, attr)
        setattr(module, attr, value)
        try:
            yield
        finally:
            setattr(module, attr, saved)
        return
    from raystate.worker import cudagraph

    saved_guard = cudagraph.greedy_checked
    cudagraph.greedy_checked = lambda logits, out: out.copy_(torch.argmax(logits, dim=-1))
    try:
        yield
    finally:
        cudagraph.greedy_checked = saved_guard


def kernel_kind(name: str) -> str:
    """A kernel's share of the step: GEMM (cuBLAS / CUTLASS), attention, or the small fused kernels."""
    lowered = name.lower()
    if any(k in lowered for k in ("gemm", "cutlass", "xmma", "nvjet", "skinny_linear")):
        return "gemm"
    if "paged_attention" in lowered:
        return "attention"
    return "other"


LONG_GAP_US = 20.0  # a gap in the GPU's timeline this long or longer is the host's, between two steps


def idle_gaps(kernels) -> tuple[float, float, int]:
    """The GPU's idle time over the profiled kernels' timeline (us): in gaps shorter than LONG_GAP_US
    (between the kernels of a graph; a programmatic dependent that overlaps its predecessor leaves none),
    in longer ones, and how many short gaps. The difference between a step's wall time and its kernels'
    time is these gaps (where kernels never overlap)."""
    spans = sorted((evt.time_range.start, evt.time_range.end) for evt in kernels)
    small = large = 0.0
    num_small = 0
    frontier = spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        gap = start - frontier
        if gap >= LONG_GAP_US:
            large += gap
        elif gap > 0:
            small += gap
            num_small += 1
        frontier = max(frontier, end)
    return small, large, num_small


def print_profile(prof, steps: int, layer_types: tuple[str, ...], floor: float) -> None:
    """Kernel time per decode step by kind (GEMM, attention, the rest) and the largest kernels, from a
    torch.profiler run over `steps` steady decode steps; then the attention launches of full-attention
    and sliding-window layers apart."""
    kernels = [
        evt
        for evt in prof.events()
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time > 0
    ]
    by_name: dict[str, list[float]] = {}
    kinds: dict[str, float] = {}
    for evt in kernels:
        by_name.setdefault(evt.name, []).append(evt.device_time)  # us
        kinds[kernel_kind(evt.name)] = kinds.get(kernel_kind(evt.name), 0.0) + evt.device_time / steps
    busy = sum(kinds.values())
    print(
        f"profile of {steps} decode steps: kernels {busy / 1e3:.3f} ms per step = "
        f"{busy * 1e-6 / floor:.2f}x the floor; "
        + ", ".join(f"{k} {v / 1e3:.3f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    )
    small, large, num_small = idle_gaps(kernels)
    print(
        f"  GPU idle per step: {small / steps:.1f} us in {num_small // steps} gaps under {LONG_GAP_US:g} us "
        f"(between kernels, inside a step's graph), {large / steps:.1f} us in longer gaps (between steps)"
    )
    for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:14]:
        per_call = sum(ts) / len(ts)
        print(f"  {sum(ts) / steps:8.1f} us/step  {len(ts) // steps:4d} x {per_call:6.2f} us  {name[:90]}")
    # The profile may start inside a step, so launches are not matched to layers by position: a decode
    # step's full-attention layers read the whole context and sliding ones W keys, so the longest
    # num_full / num_layers of the launches are the full-attention ones.
    attn = sorted(evt.device_time for evt in kernels if kernel_kind(evt.name) == "attention")
    num_full = round(len(attn) * layer_types.count("full") / len(layer_types))
    if attn and 0 < num_full < len(attn):
        sliding, full = attn[:-num_full], attn[-num_full:]
        print(
            f"  attention: full-attention layers {statistics.mean(full):.2f} us each, "
            f"sliding-window layers {statistics.mean(sliding):.2f} us each"
        )


def plot(path: str, medians: dict[str, float], floor: float, args, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [label.replace(", ", ",\n") for label in medians]
    ms = [v * 1e3 for v in medians.values()]
    bars = ax.bar(names, ms, color=["tab:green", "tab:olive", "tab:blue", "tab:gray"][: len(ms)])
    ax.bar_label(bars, labels=[f"{v:.2f} ms ({v / (floor * 1e3):.1f}x)" for v in ms])
    ax.axhline(floor * 1e3, color="black", linestyle="--", label=f"floor {floor * 1e3:.2f} ms")
    ax.axhline(1.5 * floor * 1e3, color="tab:red", linestyle=":", label="goal: 1.5x the floor")
    ax.set_yscale("log")
    ax.set_ylabel("decode step (ms, log)")
    ax.set_title(f"{args.model} model, batch {args.batch}, {args.context} context, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
