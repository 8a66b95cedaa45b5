"""Serving under load: N concurrent streaming clients for S seconds against the OpenAI server, side by side
with the same work through the engine without HTTP (the same Ray backend, in this process).

Each client loops: one streamed completion (`ignore_eos`, fixed `max_tokens`, greedy), then the next, until
the time is up; requests in flight then run to the end and count. A request is failed when it gets an
HTTP error or an error event, lost when its stream ends without every token, a finish reason and
`[DONE]`. Tokens are counted from each event's `token_ids` (`return_token_ids`), so an event carrying
several tokens counts them all (with a gap of 0 between them: a burst).

Workload: prompts of `--prompt-len` bytes, each client's own (no prefix hit flatters the figures), or
`--prompt-mix 128,512,2048`: lengths drawn deterministically from the list per (client, request); with
`--shared-prefixes K` each prompt starts with the first `--shared-frac` of one of K shared texts (so the
prefix cache and bounded replay take part) and ends with a tail of its own. The byte tokenizer of `tiny`
and `bench` makes one token per byte (plus BOS). `--clients 64 256` runs one load per level.

Baselines (same prompts, same engine knobs, same backend, the server stopped first):
  - engine streams: the same per-client request sequences, closed loop at the same concurrency, through
    the deployment's client (`Cluster.generate`, what the Serve replica calls) without Serve or HTTP:
    tokens/s, TTFT and the inter-token gap as the engine delivers them;
  - `LLM.generate` on all of a level's prompts at once, on an engine whose max_num_seqs is the level's
    concurrency (a fresh engine for a level below the server's max_num_seqs; --no-generate-at-concurrency:
    the same engine, batched up to its max_num_seqs);
  - the engine's mean step: the scheduler's step count over the load (`/status` while serving,
    `Cluster.status()` in the baseline), as ms per step (prefill steps included). The engine streams'
    inter-token p50 is the decode step as the engine delivers it: served / that is the ITL ratio.
`--ttft-requests N`: first, one client sends N requests one after another (`--ttft-prompt-len` bytes,
`--ttft-max-tokens`), served and in-process: TTFT p50 served minus in-process.

    python bench/bench_serve.py [--clients 64] [--duration 30] [--max-tokens 32] [--plot bench_serve.png]
    python bench/bench_serve.py --model tiny --clients 16 64 --prompt-mix 64,256,1024 --shared-prefixes 4 \\
        --ttft-requests 30 --json serve.json
    python bench/bench_serve.py --url http://127.0.0.1:8000 --no-baseline --json served.json  # a server
    python bench/bench_serve.py --baseline-from served.json --json serve.json   # then its baselines

Without --url it starts a local Ray and the Serve app (Ray backend), and stops both before the baselines,
so they have the machine to itself. With --url the baselines start their own engine (stop the server first
on a GPU: `--no-baseline`, then `--baseline-from`). `--client-procs P` spreads the clients over P
processes (a load of thousands of events per second outruns one Python process); the clients' CPU use is
reported. On a small CPU machine the load generator shares the cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from functools import cached_property

import httpx
from tqdm import tqdm

from raystate.engine_args import BACKENDS

FILLER = "tell me about sliding windows "
WORDS = ("engram", "window", "replay", "prefix", "block", "shard", "step", "token", "cache", "lookback")


@dataclass
class RequestRecord:
    prompt: str
    sent: float
    token_times: list[float] = field(default_factory=list)  # one per token (a multi-token event: repeated)
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str | None = None
    key: tuple[int, int] | None = None  # (client, seq): Workload.prompt rebuilds the prompt
    events: int = 0  # events that carried tokens

    def lost(self, max_tokens: int) -> bool:
        complete = self.done and self.finish_reason == "length" and len(self.token_times) == max_tokens
        return self.error is None and not complete


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@dataclass(frozen=True)
class Workload:
    """The prompts, a pure function of (client, seq): the served run and the baselines rebuild them."""

    prompt_len: int = 48
    mix: tuple[int, ...] = ()  # lengths to draw from (empty: prompt_len)
    shared_prefixes: int = 0  # K shared texts (0: none)
    shared_frac: float = 0.5  # of each prompt's length, taken from its shared text
    seed: int = 0

    def length(self, client: int, seq: int) -> int:
        if not self.mix:
            return self.prompt_len
        return self.mix[random.Random(f"{self.seed}:{client}:{seq}").randrange(len(self.mix))]

    @cached_property
    def prefixes(self) -> list[str]:
        longest = max(self.mix or (self.prompt_len,))
        out = []
        for k in range(self.shared_prefixes):
            rng = random.Random(f"{self.seed}:prefix:{k}")
            text = f"shared context {k}: "
            while len(text) < longest:
                text += rng.choice(WORDS) + " "
            out.append(text[:longest])
        return out

    def prompt(self, client: int, seq: int, length: int | None = None) -> str:
        n = length or self.length(client, seq)
        tail = f"client {client:03d} request {seq:05d}: " + FILLER * (1 + n // len(FILLER))
        if not self.shared_prefixes:
            return tail[:n]
        shared = self.prefixes[(client + seq) % self.shared_prefixes][: int(n * self.shared_frac)]
        return (shared + tail)[:n]

    def describe(self) -> str:
        if not self.mix:
            return f"prompts of {self.prompt_len} bytes"
        text = f"prompt lengths drawn from {','.join(map(str, self.mix))} bytes"
        if self.shared_prefixes:
            text += f", the first {self.shared_frac:.0%} from one of {self.shared_prefixes} shared prefixes"
        return text


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


async def _sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The `data:` payload of each server-sent event, split from the raw bytes (cheaper per event than
    aiter_lines, which matters at thousands of events per second)."""
    buf = b""
    async for chunk in response.aiter_bytes():
        buf += chunk
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:]


async def stream_one(
    http: httpx.AsyncClient,
    url: str,
    headers: dict,
    prompt: str,
    max_tokens: int,
    model: str,
    key: tuple[int, int] | None = None,
) -> RequestRecord:
    rec = RequestRecord(prompt, time.perf_counter(), key=key)
    body = {
        "model": model,  # the served name: a wrong one is a 404
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}"
                return rec
            async for data in _sse_data(r):
                if data == b"[DONE]":
                    rec.done = True
                    continue
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    rec.error = event["error"].get("message", "error event")
                    continue
                choice = event["choices"][0]
                n = len(choice.get("token_ids") or ())
                if n:
                    rec.events += 1
                    rec.token_times.extend([now] * n)
                rec.finish_reason = choice["finish_reason"] or rec.finish_reason
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def _client(clients: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    return httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits)


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def warm_up(send, workload: Workload, n: int) -> None:
    """Untimed: one request per prompt length of the workload (the first use of a shape may compile
    kernels), then `n` short ones at once (connections, lazy initialisation)."""
    lengths = sorted(set(workload.mix or (workload.prompt_len,)))
    await asyncio.gather(*(send(workload.prompt(990, i, n_), 4) for i, n_ in enumerate(lengths)))
    await asyncio.gather(*(send(workload.prompt(991, i, 32), 4) for i in range(n)))


class StatusSampler:
    """The engine's step count over a load, sampled every second: ms per decode step, and how many
    requests were running (means over the samples after the first quarter of the load)."""

    def __init__(self, fetch) -> None:
        self._fetch = fetch  # async () -> status dict
        self.samples: list[tuple[float, int, int]] = []  # (time, steps, running)

    async def run(self, start: float, stop) -> None:
        """Samples every second from before `start` until `stop()` is true."""
        while not stop():
            try:
                s = await self._fetch()
                running = sum(s.get("num_running", []))
                self.samples.append((time.perf_counter(), int(s.get("steps", 0)), running))
            except Exception:
                pass
            await asyncio.sleep(1.0)
        self._settle = start + 0.25 * (time.perf_counter() - start)

    def summary(self) -> dict:
        xs = [s for s in self.samples if s[0] >= getattr(self, "_settle", 0.0)] or self.samples
        if len(xs) < 2 or xs[-1][1] == xs[0][1]:
            return {"step_ms": float("nan"), "running_mean": float("nan")}
        step_ms = 1e3 * (xs[-1][0] - xs[0][0]) / (xs[-1][1] - xs[0][1])
        return {"step_ms": step_ms, "running_mean": sum(s[2] for s in xs) / len(xs)}


async def run_load(
    url: str,
    api_key: str | None,
    clients: int,
    duration_s: float,
    max_tokens: int,
    workload: Workload,
    model: str = "tiny",
    client_ids: range | None = None,
    start_at: float | None = None,
    progress: bool = True,
    sample_status: bool = True,
) -> tuple[list[RequestRecord], float, dict]:
    """`clients` closed-loop streams (ids `client_ids`, default 0..clients-1) for duration_s seconds from
    `start_at` (default: after the warm-up). Returns the records, the start, and info: the clients' CPU
    seconds and the engine's step figures (StatusSampler)."""
    headers = _headers(api_key)
    ids = client_ids if client_ids is not None else range(clients)
    records: list[RequestRecord] = []
    async with _client(len(ids)) as http:

        async def send(prompt: str, n: int, key=None) -> RequestRecord:
            return await stream_one(http, url, headers, prompt, n, model, key)

        await warm_up(send, workload, min(len(ids), 8))
        start = start_at if start_at is not None else time.perf_counter()
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        deadline = start + duration_s
        cpu0 = time.process_time()
        bar = tqdm(
            total=round(duration_s),
            desc=f"load {clients}",
            file=sys.stderr,
            bar_format="{l_bar}{bar}| {n}/{total} s{postfix}",
            disable=not progress or not sys.stderr.isatty(),
        )

        async def client(idx: int) -> None:
            seq = 0
            while time.perf_counter() < deadline:
                rec = await send(workload.prompt(idx, seq), max_tokens, (idx, seq))
                records.append(rec)
                seq += 1

        async def ticker() -> None:
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.5)
                bar.n = min(round(time.perf_counter() - start), bar.total)
                failed = sum(r.error is not None for r in records)
                bar.set_postfix(done=len(records), failed=failed, refresh=True)

        async def status() -> dict:
            return (await http.get(f"{url}/status", headers=headers, timeout=10.0)).json()

        sampler = StatusSampler(status)
        tasks = [ticker(), *(client(i) for i in ids)]
        if sample_status:
            tasks.append(sampler.run(start, lambda: time.perf_counter() >= deadline))
        await asyncio.gather(*tasks)
        bar.close()
        info = {"client_cpu_s": time.process_time() - cpu0, **sampler.summary()}
    return records, start, info


def _load_proc(job: tuple) -> tuple[list[RequestRecord], dict]:
    """One process of `--client-procs`: its share of the clients."""
    url, api_key, clients, duration_s, max_tokens, workload, model, ids, start_at, first = job
    records, _, info = asyncio.run(
        run_load(url, api_key, clients, duration_s, max_tokens, workload, model, ids, start_at, first, first)
    )
    return records, info


def run_load_procs(url, api_key, clients, duration_s, max_tokens, workload, model, procs: int):
    """run_load over `procs` processes (spawned), started together; merged records and info."""
    if procs <= 1:
        return asyncio.run(run_load(url, api_key, clients, duration_s, max_tokens, workload, model))
    import multiprocessing

    start_at = time.perf_counter() + 8.0  # spawn, imports and warm-up first (CLOCK_MONOTONIC: shared)
    shares = [range(p, clients, procs) for p in range(procs)]
    jobs = [
        (url, api_key, clients, duration_s, max_tokens, workload, model, ids, start_at, p == 0)
        for p, ids in enumerate(shares)
    ]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        results = pool.map(_load_proc, jobs)
    records = [r for recs, _ in results for r in recs]
    info = dict(results[0][1])
    info["client_cpu_s"] = sum(i["client_cpu_s"] for _, i in results)
    return records, start_at, info


async def run_ttft(
    url, api_key, n: int, max_tokens: int, workload: Workload, model: str
) -> list[RequestRecord]:
    """One client, `n` requests one after another."""
    out = []
    async with _client(1) as http:
        for i in range(4):  # warm-up
            await stream_one(http, url, _headers(api_key), workload.prompt(998, i), 4, model)
        for i in range(n):
            out.append(
                await stream_one(
                    http, url, _headers(api_key), workload.prompt(997, i), max_tokens, model, (997, i)
                )
            )
    return out


def summarize(records: list[RequestRecord], start: float, max_tokens: int) -> dict:
    ok = [r for r in records if r.error is None and not r.lost(max_tokens)]
    end = max((r.token_times[-1] for r in ok), default=start)
    elapsed = end - start
    ttft = [r.token_times[0] - r.sent for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2e = [r.token_times[-1] - r.sent for r in ok]
    tokens = sum(len(r.token_times) for r in ok)
    events = sum(r.events for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": sum(r.error is not None for r in records),
        "lost": sum(r.lost(max_tokens) for r in records),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "elapsed_s": elapsed,
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "output_tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "tokens_per_event": tokens / events if events else float("nan"),
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p10_ms": 1e3 * percentile(itl, 0.1),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5),
        "itl_p90_ms": 1e3 * percentile(itl, 0.9),
        "itl_p99_ms": 1e3 * percentile(itl, 0.99),
        "e2e_p50_ms": 1e3 * percentile(e2e, 0.5),
        "_ttft": ttft,
        "_itl": itl,
    }


# -- baselines: the same work through the engine, without Serve or HTTP -----------------------------------


async def _engine_stream(llm, prompt: str, max_tokens: int, key=None) -> RequestRecord:
    """One request through the deployment's client (Cluster.generate, as the Serve replica calls it)."""
    from raystate import SamplingParams

    rec = RequestRecord(prompt, time.perf_counter(), key=key)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        async for u in llm.cluster.generate(llm.text.encode(prompt), sp):
            if u.new_token_ids:
                rec.events += 1
                rec.token_times.extend([time.perf_counter()] * len(u.new_token_ids))
            if u.finished:
                rec.finish_reason, rec.done = u.finish_reason, True
                if u.finish_reason == "error":
                    rec.error = u.error or "error"
    except Exception as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def engine_streams(llm, workload: Workload, keys: list[list[int]], max_tokens: int, clients: int):
    """The served run's per-client request sequences, closed loop, `clients` at a time, through the engine."""
    per_client: dict[int, list[int]] = {}
    for c, s in keys:
        per_client.setdefault(c, []).append(s)
    await asyncio.gather(
        *(_engine_stream(llm, workload.prompt(991, i, 32), 4) for i in range(min(clients, 8)))
    )  # warm-up
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def client(c: int) -> None:
        for s in per_client[c]:
            records.append(await _engine_stream(llm, workload.prompt(c, s), max_tokens, (c, s)))

    finished = []
    sampler = StatusSampler(llm.cluster.status)

    async def until_done() -> None:
        await asyncio.gather(*(client(c) for c in per_client))
        finished.append(True)

    await asyncio.gather(until_done(), sampler.run(start, lambda: bool(finished)))
    return records, start, sampler.summary()


def start_llm(args: argparse.Namespace, max_num_seqs: int | None = None):
    from raystate import LLM

    return LLM(
        model=args.model,
        device=args.device,
        max_num_seqs=max_num_seqs or args.max_num_seqs,
        backend=args.backend,
        num_shards=args.num_shards,
        address="local",
        **args.engine_kv,
    )


def baselines(report: dict, workload: Workload, args: argparse.Namespace) -> None:
    """Adds to `report` each level's engine streams and LLM.generate figures, and the TTFT baseline."""

    llm = start_llm(args)
    try:
        warm_up_generate(llm, workload)
        ttft = report.get("ttft")
        if ttft is not None and llm.cluster is not None:
            tw = Workload(prompt_len=args.ttft_prompt_len, seed=args.seed)

            async def sequential():
                for i in range(4):
                    await _engine_stream(llm, tw.prompt(998, i), 4)
                return [
                    await _engine_stream(llm, tw.prompt(997, i), args.ttft_max_tokens)
                    for i in range(len(ttft["keys"]))
                ]

            recs = asyncio.run(sequential())
            ttft["engine"] = strip(summarize(recs, recs[0].sent, args.ttft_max_tokens))
        for run in report["runs"]:
            keys = run["keys"]
            if llm.cluster is not None:
                recs, start, info = asyncio.run(
                    engine_streams(llm, workload, keys, args.max_tokens, run["clients"])
                )
                run["engine_streams"] = {**strip(summarize(recs, start, args.max_tokens)), **info}
            if run["clients"] >= args.max_num_seqs or not args.generate_at_concurrency:
                run["llm_generate"] = generate_figures(
                    llm, workload, keys, args.max_tokens, args.max_num_seqs
                )
    finally:
        llm.shutdown()
    # LLM.generate batches up to max_num_seqs: a level below it gets an engine capped at its concurrency.
    for run in report["runs"]:
        if "llm_generate" not in run and run["keys"]:
            llm = start_llm(args, max_num_seqs=run["clients"])
            try:
                warm_up_generate(llm, workload)
                run["llm_generate"] = generate_figures(
                    llm, workload, run["keys"], args.max_tokens, run["clients"]
                )
            finally:
                llm.shutdown()
    if args.backend == "ray":
        import ray

        ray.shutdown()


def warm_up_generate(llm, workload: Workload) -> None:
    """Untimed: one prompt of each length of the workload (the first use of a shape may compile kernels)."""
    from raystate import SamplingParams

    lengths = sorted(set(workload.mix or (workload.prompt_len,)))
    prompts = [workload.prompt(990, i, n) for i, n in enumerate(lengths)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)


def generate_figures(llm, workload: Workload, keys, max_tokens: int, cap: int) -> dict:
    """LLM.generate on the prompts of `keys`, all at once (batched up to `cap`, the engine's max_num_seqs)."""
    from raystate import SamplingParams

    prompts = [workload.prompt(c, s) for c, s in keys]
    t0 = time.perf_counter()
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0), use_tqdm=False
    )
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "requests": len(outs),
        "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "batch_cap": cap,
    }


def strip(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not k.startswith("_")}


def ratios(run: dict) -> dict:
    served, out = run["served"], {}
    eng, gen = run.get("engine_streams"), run.get("llm_generate")
    if gen:
        out["tok_s_served_over_llm_generate"] = served["output_tokens_per_s"] / gen["output_tokens_per_s"]
    if eng:
        out["tok_s_served_over_engine_streams"] = served["output_tokens_per_s"] / eng["output_tokens_per_s"]
        out["itl_p50_served_over_engine_streams"] = served["itl_p50_ms"] / eng["itl_p50_ms"]
        if eng.get("step_ms") == eng.get("step_ms"):  # not NaN
            out["itl_p50_served_over_engine_step"] = served["itl_p50_ms"] / eng["step_ms"]
    if served.get("step_ms") == served.get("step_ms"):
        out["itl_p50_served_over_served_step"] = served["itl_p50_ms"] / served["step_ms"]
    return out


# -- the server --------------------------------------------------------------------------------------------


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


def served_phase(args: argparse.Namespace, workload: Workload) -> dict:
    app_args = {
        "model": args.model,
        "device": args.device,
        "backend": args.backend,
        "num_shards": args.num_shards,
        "cluster_name": "raystate-bench",
        "max_num_seqs": args.max_num_seqs,
        **args.engine_kv,
    }
    url = args.url.rstrip("/") if args.url else start_server(app_args, "bench")
    report: dict = {"runs": []}
    try:
        if args.ttft_requests:
            tw = Workload(prompt_len=args.ttft_prompt_len, seed=args.seed)
            recs = asyncio.run(
                run_ttft(url, args.api_key, args.ttft_requests, args.ttft_max_tokens, tw, args.model)
            )
            report["ttft"] = {
                "served": strip(summarize(recs, recs[0].sent, args.ttft_max_tokens)),
                "keys": [list(r.key) for r in recs],
            }
        for clients in args.clients:
            records, start, info = run_load_procs(
                url,
                args.api_key,
                clients,
                args.duration,
                args.max_tokens,
                workload,
                args.model,
                args.client_procs,
            )
            served = {**summarize(records, start, args.max_tokens), **info}
            ok = [r for r in records if r.error is None and not r.lost(args.max_tokens)]
            run = {"clients": clients, "served": strip(served), "keys": [list(r.key) for r in ok]}
            run["_served"] = served
            report["runs"].append(run)
    finally:
        if not args.url:
            stop_server()
    return report


# -- report ------------------------------------------------------------------------------------------------


def _fmt_pair(a, b, unit="") -> str:
    return f"{a:.1f} / {b:.1f}{unit}"


def print_report(report: dict, args: argparse.Namespace, workload: Workload) -> None:
    print(
        f"\nserving: model {args.model} on {args.device}, {args.backend} backend, max_num_seqs "
        f"{args.max_num_seqs}, {args.max_tokens} tokens per request, {workload.describe()}, "
        f"{args.duration:.0f} s per level"
    )
    ttft = report.get("ttft")
    if ttft:
        s, e = ttft["served"], ttft.get("engine")
        print(
            f"\none client, {args.ttft_prompt_len}-byte prompts, {args.ttft_max_tokens} tokens, "
            f"{s['completed']} requests one after another:"
        )
        print(f"  TTFT p50 / p99 served      {_fmt_pair(s['ttft_p50_ms'], s['ttft_p99_ms'], ' ms')}")
        print(f"  inter-token p50 served     {s['itl_p50_ms']:.2f} ms")
        if e:
            print(f"  TTFT p50 / p99 in-process  {_fmt_pair(e['ttft_p50_ms'], e['ttft_p99_ms'], ' ms')}")
            print(f"  inter-token p50 in-process {e['itl_p50_ms']:.2f} ms")
            diff = s["ttft_p50_ms"] - e["ttft_p50_ms"]
            print(f"  TTFT p50 served - in-process: {diff:+.2f} ms (goal <= 5 ms)")
    for run in report["runs"]:
        s, e, g = run["served"], run.get("engine_streams"), run.get("llm_generate")
        r = ratios(run)
        run["ratios"] = r
        print(f"\n{run['clients']} concurrent streams:")
        rows = [("", "served", "engine streams", "LLM.generate")]

        def row(name, key, fmt="{:.1f}", sides=(s, e, g), rows=rows):
            rows.append((name, *(fmt.format(x[key]) if x and key in x else "-" for x in sides)))

        rows.append(
            (
                "requests completed / failed / lost",
                f"{s['completed']} / {s['failed']} / {s['lost']}",
                f"{e['completed']} / {e['failed']} / {e['lost']}" if e else "-",
                f"{g['requests']}" if g else "-",
            )
        )
        row("output tokens/s", "output_tokens_per_s")
        row("requests/s", "requests_per_s", "{:.2f}")
        row("TTFT p50 (ms)", "ttft_p50_ms")
        row("TTFT p99 (ms)", "ttft_p99_ms")
        row("inter-token p10 (ms)", "itl_p10_ms", "{:.2f}")
        row("inter-token p50 (ms)", "itl_p50_ms", "{:.2f}")
        row("inter-token p90 (ms)", "itl_p90_ms", "{:.2f}")
        row("inter-token p99 (ms)", "itl_p99_ms", "{:.2f}")
        row("tokens per event", "tokens_per_event", "{:.2f}")
        row("LLM.generate batch cap", "batch_cap", "{}")
        row("engine ms per step (mean)", "step_ms", "{:.2f}")
        row("engine running requests (mean)", "running_mean")
        row("client CPU s", "client_cpu_s")
        widths = [max(len(x[i]) for x in rows) for i in range(4)]
        for x in rows:
            print(
                "  "
                + "  ".join(
                    f"{v:<{w}}" if i == 0 else f"{v:>{w}}"
                    for i, (v, w) in enumerate(zip(x, widths, strict=True))
                )
            )
        if s.get("errors"):
            print(f"  errors: {s['errors']}")
        names = {
            "tok_s_served_over_llm_generate": "tokens/s served / LLM.generate (goal >= 0.9)",
            "tok_s_served_over_engine_streams": "tokens/s served / engine streams",
            "itl_p50_served_over_engine_streams": "inter-token p50 served / engine streams' (goal <= 1.2)",
            "itl_p50_served_over_engine_step": "inter-token p50 served / engine mean step, no HTTP",
            "itl_p50_served_over_served_step": "inter-token p50 served / engine mean step while serving",
        }
        for k, label in names.items():
            if k in r:
                print(f"  {label}: {r[k]:.2f}")


def plot(path: str, report: dict) -> None:
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
    runs = report["runs"]
    if not runs:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for run in runs:
        if "_served" not in run:  # read back from --baseline-from's JSON: figures only, no samples
            continue
        served = run["_served"]
        axes[0].hist(
            [1e3 * x for x in served["_ttft"]], bins=40, alpha=0.6, label=f"{run['clients']} clients"
        )
        axes[1].hist([1e3 * x for x in served["_itl"]], bins=60, alpha=0.6, label=f"{run['clients']} clients")
    axes[0].set(title="time to first token (served)", xlabel="ms", ylabel="requests")
    axes[1].set(title="inter-token latency (served)", xlabel="ms", ylabel="tokens")
    if any("_served" in r for r in runs):
        axes[0].legend()
    names, rates = [], []
    for run in runs:
        for label, key in (("served", "served"), ("engine", "engine_streams"), ("generate", "llm_generate")):
            if run.get(key):
                names.append(f"{label}\n{run['clients']}")
                rates.append(run[key]["output_tokens_per_s"])
    axes[2].bar(names, rates)
    axes[2].set(title="output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"bench_serve: plot written to {path}")


def _engine_kv(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        k, _, v = p.partition("=")
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--clients", type=int, nargs="+", default=[64], help="concurrent streams; one load per value"
    )
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=48, help="prompt bytes (without --prompt-mix)")
    p.add_argument(
        "--prompt-mix", default="", help="comma-separated prompt lengths in bytes, e.g. 128,512,2048"
    )
    p.add_argument("--shared-prefixes", type=int, default=0, help="K shared prefixes (0: none)")
    p.add_argument(
        "--shared-frac", type=float, default=0.5, help="share of each prompt from its shared prefix"
    )
    p.add_argument("--seed", type=int, default=0, help="of the workload's draws")
    p.add_argument(
        "--ttft-requests", type=int, default=0, help="one-client TTFT run first: this many requests"
    )
    p.add_argument("--ttft-prompt-len", type=int, default=128)
    p.add_argument("--ttft-max-tokens", type=int, default=64)
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", help="the server's and the baselines' device (cpu, cuda)")
    p.add_argument("--backend", choices=BACKENDS, default="ray")
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--engine-arg", action="append", default=[], help="KEY=VALUE: another EngineArgs field (both sides)"
    )
    p.add_argument("--client-procs", type=int, default=1, help="processes for the clients")
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--api-key")
    p.add_argument(
        "--generate-at-concurrency",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="LLM.generate of a level below max_num_seqs on an engine capped at its concurrency",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the baselines (see --baseline-from)")
    p.add_argument("--baseline-from", help="the --json of a --no-baseline run: run its baselines only")
    p.add_argument("--plot", default="bench_serve.png", help="PNG of the results ('' for none)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    args.engine_kv = _engine_kv(args.engine_arg)

    if args.baseline_from:  # the workload and the engine knobs are the served run's
        with open(args.baseline_from) as f:
            report = json.load(f)
        keep = ("json", "plot", "baseline_from", "no_baseline", "generate_at_concurrency")
        for k, v in report["args"].items():
            if k not in keep:
                setattr(args, k, v)
        args.engine_kv = _engine_kv(args.engine_arg)
    mix = tuple(int(x) for x in args.prompt_mix.split(",") if x.strip())
    workload = Workload(args.prompt_len, mix, args.shared_prefixes, args.shared_frac, args.seed)
    if not args.baseline_from:
        report = served_phase(args, workload)
    work = report.get("ttft") or any(r["served"]["completed"] for r in report["runs"])
    if not args.no_baseline and work:
        baselines(report, workload, args)
    print_report(report, args, workload)
    if args.json:
        out = {k: v for k, v in report.items() if k != "runs"}
        out["runs"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in report["runs"]]
        out["args"] = {k: v for k, v in vars(args).items() if k != "engine_kv"}
        out["workload"] = asdict(workload)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(args.plot, report)
    bad = sum(r["served"]["failed"] + r["served"]["lost"] for r in report["runs"])
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
