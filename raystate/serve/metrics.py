"""Prometheus metrics of the OpenAI front end, served at GET /metrics.

Latencies are measured where the user feels them, in the ingress: time to first token from the moment the
request reached the server, and the gap between consecutive tokens of a stream. Engine-wide figures
(queue depth, running requests, free KV blocks, prefix-hit and replayed tokens, preemptions) belong to the
backend and are read from `Client.status()` at scrape time, so they are exact whichever replica answers.

Each server owns a private registry: several apps (or tests) in one process never share or clash on
metric names, and Ray's own metrics are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _total(value: Any) -> float:
    """Status fields are per shard (lists, possibly nested per group) or already totals."""
    if isinstance(value, (list, tuple)):
        return float(sum(_total(v) for v in value))
    return float(value or 0)


class _BackendCollector(Collector):
    """Turns the latest `Client.status()` snapshot into metric families when the registry is scraped."""

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        status = self.status
        up = GaugeMetricFamily("raystate_backend_up", "1 if the backend answered the last status call")
        up.add_metric([], 0.0 if status is None else 1.0)
        yield up
        if status is None:
            return
        gauges = [
            ("raystate_shards", "Model-state shards (worker actors)", status.get("num_shards", 0)),
            ("raystate_queue_depth", "Requests waiting to be scheduled", status.get("num_waiting", 0)),
            ("raystate_running_requests", "Requests running on a shard", status.get("num_running", 0)),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], _total(value))
            yield g
        free = GaugeMetricFamily("raystate_free_kv_blocks", "Free KV blocks", labels=["shard", "group"])
        for shard, per_group in enumerate(status.get("num_free_blocks", [])):
            for group, n in enumerate(per_group if isinstance(per_group, (list, tuple)) else [per_group]):
                free.add_metric([str(shard), str(group)], float(n))
        yield free
        counters = [
            ("raystate_prefix_hit_tokens", "Prompt tokens served from the prefix cache", "prefix_hit_tokens"),
            (
                "raystate_replayed_tokens",
                "Prefix-hit tokens recomputed for the sliding window",
                "replayed_tokens",
            ),
            (
                "raystate_shared_replay_tokens",
                "Prefix-hit window tokens borrowed from a request that rebuilt them in the same step",
                "shared_replay_tokens",
            ),
            ("raystate_preemptions", "Requests preempted to free KV blocks", "num_preemptions"),
        ]
        for name, doc, key in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], _total(status.get(key, 0)))
            yield c


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "raystate_time_to_first_token_seconds",
            "From request arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "raystate_inter_token_latency_seconds",
            "Gap between consecutive generated tokens of one request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "raystate_request_latency_seconds",
            "From request arrival to its last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "raystate_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r
        )
        self.errors = Counter(
            "raystate_request_errors", "Requests answered with an error", ["status"], registry=r
        )
        self.prompt_tokens = Counter(
            "raystate_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter("raystate_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            "raystate_cached_prompt_tokens",
            "Prompt tokens of finished requests found in the prefix cache",
            registry=r,
        )
        self.in_flight = Gauge("raystate_requests_in_flight", "Requests this server is answering", registry=r)
        self._backend = _BackendCollector()
        r.register(self._backend)

    def render(self, status: dict[str, Any] | None) -> bytes:
        """Prometheus text exposition; `status` is `Client.status()` (None: the backend did not answer)."""
        self._backend.status = status
        return generate_latest(self.registry)
