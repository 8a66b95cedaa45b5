"""The `raystate` command line (`python -m raystate` is the same).

raystate serve [--host 127.0.0.1] [--port 8000] [--model tiny] [--num-shards 1] [--api-key KEY]
raystate generate [--prompt TEXT ...]
raystate status [--url http://127.0.0.1:8000]
raystate bench [--suite serve] [script options]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

DEFAULT_PROMPTS = [
    "The sliding window keeps",
    "Engram memory hashes n-grams so that",
    "Prefix caching with bounded replay",
]


def _generate(args: argparse.Namespace) -> int:
    from raystate import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, seed=args.seed, backend=args.backend)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed if args.temperature > 0 else None,
    )
    prompts = args.prompt or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, sampling_params=params)
    finally:
        llm.shutdown()
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


def _curl_example(url: str, model: str, api_key: str | None) -> str:
    auth = " -H 'Authorization: Bearer $RAYSTATE_API_KEY'" if api_key else ""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16, "temperature": 0})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def _wait_for_signal() -> int:
    """Blocks until SIGINT or SIGTERM; returns the signal number."""
    received: list[int] = []
    done = threading.Event()

    def handler(signum, _frame):
        received.append(signum)
        done.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return received[0]


def _serve(args: argparse.Namespace) -> int:
    from raystate.serve.app import API_KEY_ENV, AppArgs, build_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    local = args.address is None
    if local and api_key:
        # The local Ray's processes inherit this environment: the key reaches the replica without being
        # written into the application's stored arguments, and a replica without it refuses to start.
        os.environ[API_KEY_ENV] = api_key
    app = build_app(
        AppArgs(
            model=args.model,
            backend=args.backend,
            cluster_name=args.name,
            num_shards=args.num_shards,
            device=args.device,
            max_num_seqs=args.max_num_seqs,
            kv_cache_bytes=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30),
            api_key=None if local else api_key,
            require_api_key=api_key is not None,
        )
    )  # validates the arguments before Ray starts
    import ray
    from ray import serve

    # No address: a new local Ray of our own (never one found on the machine), stopped on exit.
    ray.init(address=args.address or "local", log_to_driver=args.verbose)
    rc = 0
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=args.name, route_prefix="/", blocking=False)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        print(f"raystate: serving model {args.model!r} ({args.backend} backend, {args.num_shards} shard(s))")
        print(f"raystate: OpenAI API at {url}/v1  (health: {url}/health, metrics: {url}/metrics)")
        if args.host in ("0.0.0.0", "::"):
            print("raystate: listening on every interface" + ("" if api_key else " WITHOUT an API key"))
        print(f"raystate: try  {_curl_example(url, args.model, api_key)}")
        print("raystate: Ctrl-C stops the server", flush=True)
        signum = _wait_for_signal()
        print(f"raystate: {signal.Signals(signum).name}: shutting down", flush=True)
    except KeyboardInterrupt:  # Ctrl-C while starting
        print("raystate: interrupted: shutting down", flush=True)
        rc = 130
    except Exception as e:  # e.g. the port is taken: say why in one line, then clean up
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"raystate: error: the server did not start: {reason}", file=sys.stderr)
        rc = 1
    finally:
        try:
            serve.delete(args.name)
            if local:
                serve.shutdown()
        finally:
            if local:
                ray.shutdown()
    print("raystate: stopped")
    return rc


def _get_json(url: str, api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url, headers=headers, timeout=30.0)
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def format_status(status: dict) -> str:
    """Shards, requests and KV cache use as a small table."""
    running, waiting = status.get("num_running", []), status.get("num_waiting", [])
    free = status.get("num_free_blocks", [])
    total = status.get("num_blocks")  # usable blocks per group and shard
    lines = [
        f"backend: {status.get('backend', '?')}   shards: {status.get('num_shards', len(running))}",
        f"{'shard':>5}  {'running':>7}  {'waiting':>7}  KV cache per group (free/total, use)",
    ]
    for shard, (r, w) in enumerate(zip(running, waiting, strict=False)):
        groups = free[shard] if shard < len(free) else []
        if total:
            cache = ", ".join(f"{n}/{total} ({100 * (total - n) / total:.0f}%)" for n in groups)
        else:
            cache = ", ".join(str(n) for n in groups)
        lines.append(f"{shard:>5}  {r:>7}  {w:>7}  {cache}")
    lines.append(
        f"prefix-hit tokens: {status.get('prefix_hit_tokens', 0)}   "
        f"replayed tokens: {status.get('replayed_tokens', 0)}   "
        f"preemptions: {status.get('num_preemptions', 0)}"
    )
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("RAYSTATE_API_KEY") or None
    try:
        status = _get_json(args.url.rstrip("/") + "/status", api_key)
    except Exception as e:  # connection refused, 401, timeout: say so, no traceback
        print(f"raystate: cannot read status from {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    import runpy

    script = Path(__file__).resolve().parents[1] / "bench" / f"bench_{args.suite}.py"
    if not script.is_file():
        print(f"raystate: {script} not found (raystate bench runs from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *rest]
    sys.path.insert(0, str(script.parent))  # as `python bench/bench_x.py` would: scripts import each other
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raystate", description="Serve hybrid-attention LLMs with Ray.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI API over Ray Serve (foreground; Ctrl-C stops)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", default="tiny", help="a named model (tiny, bench) or a model directory")
    s.add_argument("--num-shards", type=int, default=1, help="worker actors (one per GPU)")
    s.add_argument(
        "--api-key", help="require this bearer key on every route but /health (default: $RAYSTATE_API_KEY)"
    )
    s.add_argument("--address", help="a running Ray cluster (default: start a local one, stopped on exit)")
    s.add_argument("--backend", choices=("ray", "local"), default="ray")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument(
        "--kv-cache-gib",
        type=float,
        help="KV cache per shard in GiB, split across the attention groups (default: sized from "
        "max-num-seqs and the model's max length)",
    )
    s.add_argument("--name", default="raystate", help="the Serve application and backend cluster name")
    s.add_argument("--verbose", action="store_true", help="forward Ray's worker logs to this terminal")
    s.set_defaults(func=_serve)

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
    g.add_argument(
        "--backend",
        choices=("inprocess", "ray"),
        default="inprocess",
        help="inprocess (default: no Ray start-up for a one-off run) or ray (a local Ray deployment)",
    )
    g.set_defaults(func=_generate)

    st = sub.add_parser("status", help="shards, requests and cache use of a running server")
    st.add_argument("--url", default="http://127.0.0.1:8000")
    st.add_argument("--api-key", help="bearer key (default: $RAYSTATE_API_KEY)")
    st.add_argument("--json", action="store_true", help="print the raw status object")
    st.set_defaults(func=_status)

    b = sub.add_parser(
        "bench", help="run a benchmark script of bench/ (unknown options go to the script)", add_help=False
    )
    b.add_argument(
        "--suite",
        default="serve",
        help="bench/bench_<suite>.py: serve, scheduler, dispatch (CPU or GPU); decode, prefix, "
        "throughput, attention, gemm, kernels (GPU)",
    )
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.cmd != "bench" and rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest) if args.cmd == "bench" else args.func(args)
    except ValueError as e:
        print(f"raystate: error: {e}", file=sys.stderr)
        return 2
