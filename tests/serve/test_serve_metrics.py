"""GET /metrics: Prometheus text whose counters and histograms move with the traffic they describe."""

from __future__ import annotations

import uuid

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families


def _samples(app) -> dict[str, float]:
    """{sample name with sorted labels: value} of one scrape."""
    out = {}
    for family in text_string_to_metric_families(app.metrics()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics_move_with_requests_and_prefix_hits(open_app):
    before = _samples(open_app)
    client = openai.OpenAI(base_url=open_app.v1, api_key="unused", max_retries=0)
    # Distinct from every other test's prompts; 100 bytes + BOS = 101 tokens, so 6 whole blocks of 16.
    prompt = f"M{uuid.uuid4().hex}" + "m" * 67
    assert len(prompt) == 100
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    after = _samples(open_app)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert hit == 96  # whole blocks, never the whole prompt (DESIGN 3.1)
    # W = 32 > 0 replayed for the sliding window (DESIGN 3.3), and reported so
    assert second.usage.prompt_tokens_details.model_extra["replayed_tokens"] == 32

    assert delta("raystate_time_to_first_token_seconds_count") == 2
    assert delta("raystate_inter_token_latency_seconds_count") == 2 * 4
    assert delta("raystate_request_latency_seconds_count") == 2
    assert delta("raystate_generation_tokens_total") == 10
    assert delta("raystate_prompt_tokens_total") == 2 * 101
    assert delta("raystate_cached_prompt_tokens_total") == hit
    assert delta("raystate_requests_total{endpoint=completions,finish_reason=length}") == 2
    assert delta("raystate_prefix_hit_tokens_total") == hit
    assert delta("raystate_replayed_tokens_total") == 32
    assert after["raystate_backend_up"] == 1
    for name in ("raystate_queue_depth", "raystate_running_requests", "raystate_preemptions_total"):
        assert name in after
    assert after["raystate_shards"] == 1
    assert after["raystate_free_kv_blocks{group=0,shard=0}"] > 0


def test_errors_are_counted(open_app):
    before = _samples(open_app).get("raystate_request_errors_total{status=400}", 0.0)
    client = openai.OpenAI(base_url=open_app.v1, api_key="unused", max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="M err", max_tokens=0)
    assert _samples(open_app)["raystate_request_errors_total{status=400}"] == before + 3
