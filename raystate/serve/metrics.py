"""Prometheus metrics of the OpenAI front end, served at GET /metrics.

Latencies are measured where the user feels them, in the ingress: time to first token from the moment the
request reached the server, and the gap between consecutive tokens of a stream. Engine-wide figures
(queue depth, running requests, free KV blocks, prefix-hit and replayed tokens, preemptions) belong to the
backend and are read from `Client.status()` at scrape time, so they are exact whichever replica answers.

Each server owns a private registry: several apps (or tests) in one process never share or clash on
metric names, and Ray's own metrics are left alone.

vLLM's main series are exported too, under vLLM's names and with its `model_name` label, so that a
dashboard made for vLLM works unchanged (deploy/grafana/raystate-vllm-dashboard.json). They are not
measured a second time: `_VLLMCollector` renames our own series at scrape time (TTFT, inter-token latency,
end-to-end latency, prompt and generated tokens, finished requests), and the backend's status gives the
running and waiting requests and the KV cache use. The prefix cache's queries and hits are the prompt
tokens and cached prompt tokens of finished requests (vLLM counts them at admission, in tokens too).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _total(value: Any) -> float:
    """Status fields are per shard (lists, possibly nested per group) or already totals."""
    if isinstance(value, (list, tuple)):
        return float(sum(_total(v) for v in value))
    return float(value or 0)


def kv_cache_usage(status: dict[str, Any]) -> float | None:
    """The used fraction of the KV blocks (0..1) over every shard and group, from `num_free_blocks` and
    `num_blocks` (the usable blocks per group and shard); None when the status lacks them."""
    total = status.get("num_blocks")
    free = [float(n) for shard in status.get("num_free_blocks", []) for n in _as_list(shard)]
    if not total or not free:
        return None
    return min(1.0, max(0.0, 1.0 - sum(free) / (float(total) * len(free))))


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class _BackendCollector(Collector):
    """Turns the latest `Client.status()` snapshot into metric families when the registry is scraped."""

    def __init__(self, owner: ServeMetrics) -> None:
        self.status: dict[str, Any] | None = None
        self._owner = owner

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
        # vLLM's names for the same figures
        label = [self._owner.model_name]
        usage = kv_cache_usage(status)
        vllm_gauges = [
            ("vllm:num_requests_running", "Requests running (raystate_running_requests)", "num_running"),
            ("vllm:num_requests_waiting", "Requests waiting (raystate_queue_depth)", "num_waiting"),
        ]
        for name, doc, key in vllm_gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, _total(status.get(key, 0)))
            yield g
        if usage is not None:
            for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                g = GaugeMetricFamily(
                    name, "Used fraction of the KV cache blocks (1 = full)", labels=["model_name"]
                )
                g.add_metric(label, usage)
                yield g


class _VLLMCollector(Collector):
    """Our own series again under vLLM's names (read at scrape time, never measured twice).

    Each entry: (our metric, vLLM's name, its help text, {our label: vLLM's label or None to sum it
    away}). Every series gets the `model_name` label."""

    def __init__(self, owner: ServeMetrics) -> None:
        self._owner = owner

    def _renamed(self, source: Any, name: str, doc: str, labels: dict[str, str | None]) -> Metric | None:
        families = list(source.collect())
        if not families:
            return None
        family = families[0]
        out = Metric(name, doc, family.type)
        summed: dict[tuple, list] = {}
        for sample in family.samples:
            suffix = sample.name[len(family.name) :]
            # one creation time per series: dropped where series are summed
            if suffix == "_created" and any(v is None for v in labels.values()):
                continue
            kept = {(labels.get(k) or k): v for k, v in sample.labels.items() if labels.get(k, k) is not None}
            kept["model_name"] = self._owner.model_name
            key = (suffix, tuple(sorted(kept.items())))
            if key in summed:
                summed[key][1] += sample.value
            else:
                summed[key] = [kept, sample.value]
        for (suffix, _), (kept, value) in summed.items():
            out.samples.append(Sample(name + suffix, kept, value))
        return out

    def collect(self) -> Iterator[Metric]:
        m = self._owner
        table = [
            (m.ttft, "vllm:time_to_first_token_seconds", "Time to first token in seconds", {}),
            (m.inter_token, "vllm:inter_token_latency_seconds", "Inter-token latency in seconds", {}),
            (m.inter_token, "vllm:time_per_output_token_seconds", "Time per output token (older name)", {}),
            (m.e2e, "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds", {}),
            (m.prompt_tokens, "vllm:prompt_tokens", "Prefill tokens processed", {}),
            (m.generation_tokens, "vllm:generation_tokens", "Generation tokens processed", {}),
            (m.prompt_tokens, "vllm:prefix_cache_queries", "Prefix cache queries, in tokens", {}),
            (m.cached_tokens, "vllm:prefix_cache_hits", "Prefix cache hits, in tokens", {}),
            (
                m.requests,
                "vllm:request_success",
                "Finished requests, by finish reason",
                {"endpoint": None, "finish_reason": "finished_reason"},
            ),
        ]
        for source, name, doc, labels in table:
            family = self._renamed(source, name, doc, labels)
            if family is not None:
                yield family


class ServeMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name  # the vLLM series' `model_name` label (RaystateServer sets it)
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
        self._backend = _BackendCollector(self)
        r.register(self._backend)
        r.register(_VLLMCollector(self))

    def render(self, status: dict[str, Any] | None) -> bytes:
        """Prometheus text exposition; `status` is `Client.status()` (None: the backend did not answer)."""
        self._backend.status = status
        return generate_latest(self.registry)
