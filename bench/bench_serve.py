"""Serving under load: N concurrent streaming clients for S seconds against the OpenAI server, then the
same prompts through plain `LLM.generate` for the serving overhead.

Each client loops: one streamed completion (`ignore_eos`, fixed `max_tokens`, a prompt of its own so no
prefix-cache hit flatters the figures), then the next, until the time is up; requests in flight then run
to the end and count. A request is failed when it gets an HTTP error or an error event, lost when its
stream ends without every token, a finish reason and `[DONE]`. Reported: requests/s, output tokens/s,
time to first token and inter-token latency (p50, p99, as the clients see them), failed and lost counts,
and the ratio of `LLM.generate`'s token rate to the server's.

    python bench/bench_serve.py [--clients 64] [--duration 30] [--max-tokens 32] [--plot bench_serve.png]
    python bench/bench_serve.py --url http://127.0.0.1:8000 --api-key KEY   # a server already running

Without --url it starts a local Ray and the Serve app (Ray backend), and stops both before the baseline,
so the baseline has the machine to itself. On a small CPU machine the load generator shares the cores
with the server, which the figures include.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from raystate.engine_args import BACKENDS


@dataclass
class RequestRecord:
    prompt: str
    sent: float
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None

    def lost(self, max_tokens: int) -> bool:
        complete = self.done and self.finish_reason == "length" and len(self.token_times) == max_tokens
        return self.error is None and not complete


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def make_prompt(client: int, seq: int, length: int) -> str:
    head = f"client {client:03d} request {seq:05d}: "
    return (head + "tell me about sliding windows " * (1 + length // 30))[:length]


async def completion_choices(response: httpx.Response, record) -> AsyncIterator[dict]:
    """The choice of each event of a streamed completion; sets `record.done` at `data: [DONE]` and
    `record.error` at an error event (bench_faults' streams use it too)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            record.done = True
            continue
        event = json.loads(data)
        if "error" in event:
            record.error = event["error"].get("message", "error event")
            continue
        yield event["choices"][0]


async def stream_one(
    http: httpx.AsyncClient, url: str, headers: dict, prompt: str, max_tokens: int, model: str
) -> RequestRecord:
    rec = RequestRecord(prompt, time.perf_counter())
    body = {
        "model": model,  # the served name: a wrong one is a 404
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}"
                return rec
            async for choice in completion_choices(r, rec):
                rec.token_times.append(time.perf_counter())
                rec.finish_reason = choice["finish_reason"] or rec.finish_reason
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_load(
    url: str,
    api_key: str | None,
    clients: int,
    duration_s: float,
    max_tokens: int,
    prompt_len: int,
    model: str = "tiny",
):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        # Warm-up (not recorded): the first requests pay for connection set-up and lazy initialisation.
        await asyncio.gather(
            *(stream_one(http, url, headers, make_prompt(999, i, prompt_len), 4, model) for i in range(4))
        )
        start = time.perf_counter()
        deadline = start + duration_s
        bar = tqdm(
            total=round(duration_s),
            desc="load",
            file=sys.stderr,
            bar_format="{l_bar}{bar}| {n}/{total} s{postfix}",
        )

        async def client(idx: int) -> None:
            seq = 0
            while time.perf_counter() < deadline:
                records.append(
                    await stream_one(http, url, headers, make_prompt(idx, seq, prompt_len), max_tokens, model)
                )
                seq += 1

        async def ticker() -> None:
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.5)
                bar.n = min(round(time.perf_counter() - start), bar.total)
                failed = sum(r.error is not None for r in records)
                bar.set_postfix(done=len(records), failed=failed, refresh=True)

        await asyncio.gather(ticker(), *(client(i) for i in range(clients)))
        bar.close()
    return records, start


def summarize(records: list[RequestRecord], start: float, max_tokens: int) -> dict:
    ok = [r for r in records if r.error is None and not r.lost(max_tokens)]
    end = max((r.token_times[-1] for r in ok), default=start)
    elapsed = end - start
    ttft = [r.token_times[0] - r.sent for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2e = [r.token_times[-1] - r.sent for r in ok]
    tokens = sum(len(r.token_times) for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": sum(r.error is not None for r in records),
        "lost": sum(r.lost(max_tokens) for r in records),
        "elapsed_s": elapsed,
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "output_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5),
        "itl_p99_ms": 1e3 * percentile(itl, 0.99),
        "e2e_p50_ms": 1e3 * percentile(e2e, 0.5),
        "_ttft": ttft,
        "_itl": itl,
    }


def baseline(prompts: list[str], max_tokens: int, args: argparse.Namespace) -> dict:
    """The same prompts through plain LLM.generate on the same backend, without Serve or HTTP."""
    from raystate import LLM, SamplingParams

    backend = args.backend
    llm = LLM(
        model=args.model,
        max_num_seqs=args.max_num_seqs,
        backend=backend,
        num_shards=args.num_shards,
        address="local",
    )
    try:
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
        if backend == "ray":
            import ray

            ray.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "backend": backend,
        "requests": len(outs),
        "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": tokens / elapsed,
    }


def start_server(app_args: dict, name: str) -> str:
    """A local Ray, Serve on a free loopback port, and the app of `app_args` (the Serve args) at its root,
    named `name`; returns its URL (bench_faults starts its server this way too)."""
    import ray
    from ray import serve

    from raystate.serve.app import build_app

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args), name=name, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_server() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def print_table(served: dict, base: dict | None, args: argparse.Namespace) -> None:
    print(
        f"\nserving: {args.clients} streaming clients, {args.duration:.0f} s, {args.max_tokens} tokens per "
        f"request, prompts of {args.prompt_len} bytes, model {args.model}, {args.backend} backend"
    )
    rows = [
        (
            "requests (completed / failed / lost)",
            f"{served['completed']} / {served['failed']} / {served['lost']}",
        ),
        ("requests/s", f"{served['requests_per_s']:.2f}"),
        ("output tokens/s", f"{served['output_tokens_per_s']:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{served['ttft_p50_ms']:.1f} / {served['ttft_p99_ms']:.1f}"),
        ("inter-token p50 / p99 (ms)", f"{served['itl_p50_ms']:.1f} / {served['itl_p99_ms']:.1f}"),
        ("request latency p50 (ms)", f"{served['e2e_p50_ms']:.1f}"),
    ]
    if base is not None:
        ratio = (
            base["output_tokens_per_s"] / served["output_tokens_per_s"]
            if served["output_tokens_per_s"]
            else 0
        )
        rows += [
            (f"LLM.generate ({base['backend']}), same prompts: requests/s", f"{base['requests_per_s']:.2f}"),
            ("LLM.generate output tokens/s", f"{base['output_tokens_per_s']:.1f}"),
            ("serving overhead (LLM.generate / served tokens/s)", f"{ratio:.2f}x"),
        ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def plot(path: str, served: dict, base: dict | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "bench_serve: matplotlib is not installed; no plot (pip install 'raystate[bench]')",
            file=sys.stderr,
        )
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].hist([1e3 * x for x in served["_ttft"]], bins=40)
    axes[0].set(title="time to first token", xlabel="ms", ylabel="requests")
    axes[1].hist([1e3 * x for x in served["_itl"]], bins=60)
    axes[1].set(title="inter-token latency", xlabel="ms", ylabel="tokens")
    names, rates = ["served"], [served["output_tokens_per_s"]]
    if base is not None:
        names.append("LLM.generate")
        rates.append(base["output_tokens_per_s"])
    axes[2].bar(names, rates)
    axes[2].set(title="output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"bench_serve: plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=48, help="prompt bytes")
    p.add_argument("--model", default="tiny")
    p.add_argument("--backend", choices=BACKENDS, default="ray")
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--api-key")
    p.add_argument("--no-baseline", action="store_true", help="skip the LLM.generate run")
    p.add_argument("--plot", default="bench_serve.png", help="PNG of the results ('' for none)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)

    app_args = {
        "model": args.model,
        "backend": args.backend,
        "num_shards": args.num_shards,
        "cluster_name": "raystate-bench",
        "max_num_seqs": args.max_num_seqs,
    }
    url = args.url.rstrip("/") if args.url else start_server(app_args, "bench")
    try:
        records, start = asyncio.run(
            run_load(
                url, args.api_key, args.clients, args.duration, args.max_tokens, args.prompt_len, args.model
            )
        )
    finally:
        if not args.url:
            stop_server()
    served = summarize(records, start, args.max_tokens)
    base = None
    if not args.no_baseline and served["completed"]:
        prompts = [r.prompt for r in records if r.error is None and not r.lost(args.max_tokens)]
        base = baseline(prompts, args.max_tokens, args)
    print_table(served, base, args)
    if args.json:
        figures = {"args": vars(args), "served": {k: v for k, v in served.items() if not k.startswith("_")}}
        figures["llm_generate"] = base
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    if args.plot:
        plot(args.plot, served, base)
    return 0 if served["failed"] == 0 and served["lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
