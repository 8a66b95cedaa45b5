"""Faults injected into a running server, and what each one cost: the reliability figures of BENCHMARKS.md.

It starts a local Ray and the Serve app on loopback (Ray backend, `--shards` worker shards, the tiny model,
the kernels' PyTorch references), and runs each scenario with `--clients` concurrent streaming clients
(greedy, `ignore_eos`, `--max-tokens` tokens each, distinct prompts):

- worker kill: `ray.kill` of one worker actor mid-stream. Its requests are re-sent in full to the
  replacement worker; every stream must still end with its `[DONE]` and the fault-free run's exact text
  (bounded replay off, so a recompute is bit-exact). Recovery: the longest gap between two tokens of any
  stream.
- scheduler kill: `ray.kill` of the scheduler actor. The requests in flight die with it (the scheduler
  held them); each stream must end with an error event and `[DONE]`, none cut short. Recovery: from the
  kill to the first healthy `/health` (Serve's replica check fails, the replica is replaced, its new
  deployment started).
- step-loop death: the scheduler's step loop raises (the actor stays up); the same outcome as above.
- disconnect storm: `--storm` streaming clients hang up after their first tokens while `--clients` others
  stream on; the others must get the fault-free text, and every KV block must come back.

A stream is *lost* when it ends with neither every token plus a finish reason and `[DONE]`, nor an error
event plus `[DONE]`: a client that cannot tell what happened. The target is zero lost in every scenario.

    python bench/bench_faults.py [--clients 16] [--max-tokens 48] [--shards 2] [--storm 64]
                                 [--out bench/results/faults_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx
from bench_serve import completion_choices, start_server

CLUSTER = "raystate-faults"


@dataclass
class Stream:
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    token_times: list[float] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.done and self.finish_reason is not None and self.error is None

    @property
    def failed_cleanly(self) -> bool:
        return self.done and self.error is not None

    @property
    def lost(self) -> bool:
        return not (self.complete or self.failed_cleanly)


def prompt(i: int) -> str:
    return f"client {i:03d}: the sliding window keeps the last tokens of " + "abcdefghij"[i % 10] * (
        i % 7 + 3
    )


async def stream(
    http: httpx.AsyncClient, url: str, text: str, max_tokens: int, hang_up_after: int = 0
) -> Stream:
    s = Stream()
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error, s.done = f"HTTP {r.status_code}", True  # refused before it started: told at once
                return s
            async for choice in completion_choices(r, s):
                s.text += choice["text"]
                s.token_times.append(time.monotonic())
                s.finish_reason = choice["finish_reason"] or s.finish_reason
                if hang_up_after and len(s.token_times) >= hang_up_after:
                    return s  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, ValueError) as e:
        s.error = f"{type(e).__name__}"
    return s


async def wait_healthy(url: str, timeout_s: float = 300.0) -> float:
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() - t0 < timeout_s:
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{url} not healthy within {timeout_s} s")


async def run_streams(url: str, n: int, max_tokens: int, fault=None, fault_after_s: float = 1.5):
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        tasks = [asyncio.create_task(stream(http, url, prompt(i), max_tokens)) for i in range(n)]
        fault_at = None
        if fault is not None:
            await asyncio.sleep(fault_after_s)
            fault_at = time.monotonic()
            await asyncio.to_thread(fault)
        return await asyncio.gather(*tasks), fault_at


def max_gap(streams: list[Stream]) -> float:
    gaps = [b - a for s in streams for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
    return max(gaps, default=0.0)


def exact(streams: list[Stream], expected: list[str]) -> int:
    return sum(s.complete and s.text == e for s, e in zip(streams, expected, strict=True))


def summary(name: str, streams: list[Stream], expected: list[str] | None, **extra) -> dict:
    row = {
        "scenario": name,
        "streams": len(streams),
        "completed": sum(s.complete for s in streams),
        "failed_with_error_event": sum(s.failed_cleanly for s in streams),
        "lost": sum(s.lost for s in streams),
        **extra,
    }
    if expected is not None:
        row["exact_text"] = exact(streams, expected)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--storm", type=int, default=64, help="clients that hang up in the disconnect storm")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()

    os.environ.setdefault("RAYSTATE_KERNELS", "reference")
    import ray
    from ray import serve

    from raystate import launch

    app_args = {
        "model": "tiny",
        "cluster_name": CLUSTER,
        "num_shards": args.shards,
        "swa_bounded_replay": False,  # recomputes are then bit-exact: the text must match
        "health_check_period_s": 1.0,
    }
    url = start_server(app_args, "faults")
    rows = []
    try:
        asyncio.run(wait_healthy(url))
        clean, _ = asyncio.run(run_streams(url, args.clients, args.max_tokens))
        expected = [s.text for s in clean]
        rows.append(summary("no fault", clean, expected))

        def kill_worker():
            ray.kill(ray.get_actor("worker-1", namespace=CLUSTER))

        got, _ = asyncio.run(run_streams(url, args.clients, args.max_tokens, kill_worker))
        rows.append(summary("worker kill", got, expected, recovery_s=round(max_gap(got), 2)))

        for name, fault in (
            ("scheduler kill", lambda: ray.kill(ray.get_actor("scheduler", namespace=CLUSTER))),
            (
                "step-loop death",
                lambda: ray.get(
                    ray.get_actor("scheduler", namespace=CLUSTER).inject_fault.remote("step_loop")
                ),
            ),
        ):
            got, fault_at = asyncio.run(run_streams(url, args.clients, args.max_tokens, fault))
            asyncio.run(wait_healthy(url))
            recovery = time.monotonic() - fault_at
            after, _ = asyncio.run(run_streams(url, args.clients, args.max_tokens))
            rows.append(
                summary(
                    name,
                    got,
                    None,
                    recovery_s=round(recovery, 1),
                    served_after=f"{exact(after, expected)}/{len(after)} exact",
                )
            )

        async def storm():
            limits = httpx.Limits(max_connections=args.clients + args.storm + 8)
            async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
                steady = [
                    asyncio.create_task(stream(http, url, prompt(i), args.max_tokens))
                    for i in range(args.clients)
                ]
                quitters = [
                    asyncio.create_task(stream(http, url, prompt(1000 + i), args.max_tokens, hang_up_after=2))
                    for i in range(args.storm)
                ]
                await asyncio.gather(*quitters)
                return await asyncio.gather(*steady)

        status0 = httpx.get(f"{url}/status", timeout=30).json()
        got = asyncio.run(storm())
        t0 = time.monotonic()
        while True:
            st = httpx.get(f"{url}/status", timeout=30).json()
            if (
                sum(st["num_running"]) + sum(st["num_waiting"]) == 0
                and st["num_free_blocks"] == status0["num_free_blocks"]
            ):
                break
            if time.monotonic() - t0 > 60:
                raise AssertionError(f"KV blocks not back after the storm: {st['num_free_blocks']}")
            time.sleep(0.1)
        rows.append(
            summary(
                f"disconnect storm ({args.storm} hang up)",
                got,
                expected,
                blocks_back_s=round(time.monotonic() - t0, 2),
            )
        )
    finally:
        serve.shutdown()
        launch.stop(CLUSTER)
        ray.shutdown()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
