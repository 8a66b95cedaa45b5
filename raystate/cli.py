"""The `raystate` command line (`python -m raystate` is the same)."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPTS = [
    "The sliding window keeps",
    "Engram memory hashes n-grams so that",
    "Prefix caching with bounded replay",
]


def _generate(args: argparse.Namespace) -> int:
    from raystate import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, seed=args.seed)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed if args.temperature > 0 else None,
    )
    prompts = args.prompt or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    for o in outs:
        print(f"--- prompt: {o.prompt!r}")
        print(f"    output: {o.text!r}")
        print(f"    tokens: {len(o.token_ids)}  finish: {o.finish_reason}  cached: {o.num_cached_tokens}")
    print(
        f"[raystate] model={args.model} device={args.device}: {len(outs)} prompts, {n} tokens in {dt:.2f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raystate", description="Serve hybrid-attention LLMs with Ray.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one-off prompts and print it")
    g.add_argument(
        "--model", default="tiny", help="a named model (tiny, bench) or a save_pretrained directory"
    )
    g.add_argument("--device", default="cpu")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three samples")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"raystate: error: {e}", file=sys.stderr)
        return 2
