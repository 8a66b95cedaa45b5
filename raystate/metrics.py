"""Engine metrics through `ray.util.metrics`, exported by Ray's metrics agent (Prometheus format).

Recorded by the scheduler actor: running and waiting requests per shard (gauges), prefix-hit tokens,
replayed tokens and preemptions (counters, fed from the scheduler's running totals), step time (dispatch
to results, the whole round trip) and dispatch time (that round trip minus the slowest shard's model time:
what the control path costs) as histograms. Every series carries the deployment name, so several
deployments in one Ray cluster stay apart.

The scheduler's totals are read at most every `stats_interval_s`, off the dispatch path, so recording
costs the step loop almost nothing.
"""

from __future__ import annotations

import time

from ray.util.metrics import Counter, Gauge, Histogram

# Seconds; from tens of microseconds (dispatch) to seconds (a long prefill step on a big model).
_TIME_BOUNDARIES = [
    5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
]  # fmt: skip


class EngineMetrics:
    def __init__(self, deployment: str, num_shards: int, stats_interval_s: float = 0.5) -> None:
        self._tags = {"deployment": deployment}
        self._shard_tags = [{"deployment": deployment, "shard": str(s)} for s in range(num_shards)]
        self.stats_interval_s = stats_interval_s
        self._next_stats = 0.0
        self._totals = {
            "prefix_hit_tokens": 0,
            "replayed_tokens": 0,
            "shared_replay_tokens": 0,
            "num_preemptions": 0,
        }
        per_shard = ("deployment", "shard")
        self.running = Gauge("raystate_running_requests", "Requests running on a shard", tag_keys=per_shard)
        self.waiting = Gauge(
            "raystate_waiting_requests", "Requests queued on a shard (preempted ones included)", per_shard
        )
        self.counters = {
            "prefix_hit_tokens": Counter(
                "raystate_prefix_hit_tokens", "Prompt tokens found in the prefix cache", ("deployment",)
            ),
            "replayed_tokens": Counter(
                "raystate_replayed_tokens",
                "Cached tokens recomputed for the sliding window (SWA bounded replay)",
                ("deployment",),
            ),
            "shared_replay_tokens": Counter(
                "raystate_shared_replay_tokens",
                "Cached window tokens borrowed from a request replaying the same hit in the same step",
                ("deployment",),
            ),
            "num_preemptions": Counter(
                "raystate_preemptions", "Requests preempted by recompute", ("deployment",)
            ),
        }
        self.step_time = Histogram(
            "raystate_step_time_s", "Step round trip: dispatch to results", _TIME_BOUNDARIES, ("deployment",)
        )
        self.dispatch_time = Histogram(
            "raystate_dispatch_time_s",
            "Step round trip minus the slowest shard's model time",
            _TIME_BOUNDARIES,
            ("deployment",),
        )

    def record_step(self, step_s: float, dispatch_s: float) -> None:
        self.step_time.observe(step_s, self._tags)
        self.dispatch_time.observe(max(dispatch_s, 0.0), self._tags)

    def stats_due(self) -> bool:
        return time.monotonic() >= self._next_stats

    def record_stats(self, stats) -> None:
        """Takes a `SchedulerStats`: gauges per shard, and counters advanced by the totals' growth."""
        self._next_stats = time.monotonic() + self.stats_interval_s
        for s, tags in enumerate(self._shard_tags):
            self.running.set(stats.num_running[s], tags)
            self.waiting.set(stats.num_waiting[s], tags)
        for name, counter in self.counters.items():
            total = getattr(stats, name)
            if total > self._totals[name]:
                counter.inc(total - self._totals[name], self._tags)
            self._totals[name] = total
