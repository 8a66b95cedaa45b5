"""Step dispatch round trip: scheduler actor -> N worker actors -> back, compiled graph vs plain actor calls.

The workers run in dry-run mode (they decode the step and answer every row without a model), so the
figures are the control path only: msgspec encode once in the scheduler, the Ray transport both ways, the
worker's decode and encode. Timed inside the scheduler actor by its step thread, exactly where real steps
are dispatched. The step is a ~1 KB StepMessage (running deltas, new block ids) per shard. Goals (issue 4):
compiled graphs at least 5x faster than actor calls, and under 150 us p50 for one shard on the GPU machine.

    python bench/bench_dispatch.py [--shards 1 2 4] [--iters 2000] [--gpus-per-shard 0]
"""

from __future__ import annotations

import argparse
import os
import platform

import ray

from raystate.cluster import Cluster
from raystate.config import EngineConfig
from raystate.messages import RunningDelta, StepMessage, encode


def step_payload(target_bytes: int = 1024) -> bytes:
    """A decode step of about `target_bytes`: running rows with a new block id each now and then."""
    running = []
    while True:
        i = len(running)
        running.append(RunningDelta(f"req-{i:06d}", [[1000 + i] if i % 4 == 0 else [], []], 1))
        data = encode(StepMessage(step_id=1234, running=running))
        if len(data) >= target_bytes:
            return data


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(
    num_shards: int, dispatch: str, payload: bytes, iters: int, warmup: int, gpus: float
) -> tuple[float, float, str]:
    cluster = Cluster.start(
        EngineConfig(),
        name=f"bench-dispatch-{dispatch}-{num_shards}",
        num_shards=num_shards,
        dispatch=dispatch,
        dry_run=True,
        num_cpus_per_shard=0.01,
        num_gpus_per_shard=gpus,
        probe_interval_s=3600.0,
    )
    try:
        times = ray.get(cluster.scheduler.bench_dispatch.remote(payload, warmup + iters))[warmup:]
        used = cluster.deployment.dispatch
    finally:
        cluster.stop()
    us = [t / 1e3 for t in times]
    return percentile(us, 0.5), percentile(us, 0.99), used


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--bytes", type=int, default=1024, help="StepMessage size per shard")
    p.add_argument("--gpus-per-shard", type=float, default=0.0, help="GPU reserved per worker (0: none)")
    p.add_argument("--address", default=None, help="a Ray cluster to use (default: start a local one)")
    args = p.parse_args()
    ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
    payload = step_payload(args.bytes)
    print(
        f"# dispatch round trip, {len(payload)} B step per shard, {args.iters} iters after {args.warmup} "
        f"warm-up, {platform.node()} ({os.cpu_count()} CPUs), ray {ray.__version__}"
    )
    row = "{:>6} | {:>12} | {:>12} | {:>10} | {:>10} | {:>12}"
    print(row.format("shards", "compiled p50", "compiled p99", "actor p50", "actor p99", "speed-up p50"))
    print("-" * 80)
    for n in args.shards:
        c50, c99, used = measure(n, "compiled", payload, args.iters, args.warmup, args.gpus_per_shard)
        a50, a99, _ = measure(n, "actor", payload, args.iters, args.warmup, args.gpus_per_shard)
        cells = [f"{x:.0f} us" for x in (c50, c99, a50, a99)]
        note = "" if used == "compiled" else f"  (compiled fell back: {used})"
        print(row.format(n, *cells, f"{a50 / c50:.1f}x") + note)
    ray.shutdown()


if __name__ == "__main__":
    main()
