"""Decode time per step through `LLM.generate`, in-process engine against the Ray deployment, side by side.

    python bench/bench_backends.py [--model bench] [--batches 1 8 64] [--tokens 257] [--rounds 2]
        [--backends inprocess ray ray-pipelined]
    python bench/bench_backends.py --device cpu --model tiny --batches 1 4 --tokens 17   # a smoke run

Why: the in-process engine overlaps a step's host work with the GPU (async scheduling launches step N+1
before it finishes N). Under the Ray backend a worker actor that runs each message to its end (launch,
wait, answer) before it reads the next ("ray", the default) leaves the GPU idle between steps for the
answer's encoding, the channel hop and the next message's decode and launch; "ray-pipelined"
(`pipeline_steps=True`) has each worker answer a step with the next message (`PipelinedCompiledDispatch`).
This measures both against the in-process engine, per batch size.

Each (backend, round) runs in its own process (a fresh engine or deployment), the list alternating
backends round after round. Per batch: B prompts of `--prompt` random byte tokens, greedy, `ignore_eos`;
one call of 1 token (prefill) and one of `--tokens` tokens, each after two untimed warm-ups; the decode
step is (t_T - t_1) / (T - 1). Every backend's tokens are compared with the first one's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(args) -> dict:
    """One backend in this process: {batch: {"step_ms", "prefill_ms", "tokens"}}."""
    import numpy as np

    from raystate import LLM, SamplingParams

    max_b = max(args.batches)
    backend, _, variant = args.backend.partition("-")
    ray_options = {"pipeline_steps": variant == "pipelined"} if backend == "ray" else None
    llm = LLM(
        model=args.model,
        backend=backend,
        ray_options=ray_options,
        device=args.device,
        max_num_seqs=max_b,
        max_model_len=args.prompt + args.tokens + 16,
    )
    rng = np.random.default_rng(0)
    out = {}
    try:
        for b in args.batches:
            prompts = [rng.integers(1, 256, args.prompt).tolist() for _ in range(b)]
            times = {}
            for n in (1, args.tokens):
                params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
                # Two warm-ups: the second hits the first's prefix, as the timed call hits theirs, so the
                # kernels of a prefix hit are compiled before the clock runs (one compiled in the timed
                # 1-token call made the in-process b=1 step come out negative: -6.4 ms, H100, 2026-12-07)
                for last in (7, 8):
                    warm = [p[:-1] + [last] for p in prompts]
                    llm.generate(prompt_token_ids=warm, sampling_params=params, use_tqdm=False)
                t0 = time.perf_counter()
                res = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
                times[n] = time.perf_counter() - t0
            step_ms = (times[args.tokens] - times[1]) / (args.tokens - 1) * 1e3
            out[b] = {
                "step_ms": step_ms,
                "prefill_ms": times[1] * 1e3,
                "tokens": [list(r.outputs[0].token_ids) for r in res],
            }
    finally:
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=257)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["inprocess", "ray", "ray-pipelined"],
        help="inprocess, ray (each step answered whole), ray-pipelined (a step may be answered one late)",
    )
    ap.add_argument("--json", default="")
    ap.add_argument("--backend", default="", help=argparse.SUPPRESS)  # the child process's one backend
    args = ap.parse_args()
    if args.backend:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return

    runs: list[tuple[str, int, dict]] = []
    # What a child process measures with (the rest is the parent's).
    base = ["--model", args.model, "--device", args.device, "--prompt", str(args.prompt)]
    base += ["--tokens", str(args.tokens), "--batches", *map(str, args.batches)]
    for r in range(args.rounds):
        for backend in args.backends:
            proc = subprocess.run(
                [sys.executable, __file__, *base, "--backend", backend],
                capture_output=True,
                text=True,
                check=False,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
                raise SystemExit(f"{backend} round {r}: exit {proc.returncode}")
            res = {int(k): v for k, v in json.loads(lines[-1][7:]).items()}
            runs.append((backend, r, res))
            print(
                f"round {r} {backend:9s} "
                + "  ".join(
                    f"b={b}: {v['step_ms']:.3f} ms/step (prefill {v['prefill_ms']:.1f} ms)"
                    for b, v in res.items()
                ),
                flush=True,
            )

    first = runs[0][2]
    print(
        f"\n{args.model} on {args.device}, prompt {args.prompt}: decode ms per step, median of {args.rounds}"
    )
    print(
        f"{'batch':>6} " + " ".join(f"{b:>16}" for b in args.backends) + "   each / the first   tokens equal"
    )
    summary = {}
    for b in args.batches:
        med = {}
        for backend in args.backends:
            xs = sorted(res[b]["step_ms"] for name, _, res in runs if name == backend)
            med[backend] = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
        same = all(res[b]["tokens"] == first[b]["tokens"] for _, _, res in runs)
        ratios = [med[x] / med[args.backends[0]] for x in args.backends[1:]]
        summary[b] = {"median_step_ms": med, "ratios": ratios, "tokens_equal": same}
        row = " ".join(f"{med[x]:>16.3f}" for x in args.backends)
        print(f"{b:>6} {row}   " + " ".join(f"{r:.3f}x" for r in ratios) + f"   {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": [(n, r, res) for n, r, res in runs], "summary": summary}, f, default=str)


if __name__ == "__main__":
    main()
