"""Issue 13, points 1 and 2 on the Ray backend: a request that once killed the shard (temperature 5e-324)
now runs like a greedy one beside the others, and a scheduler whose step loop died (the actor still
answering) is reported dead by `check_alive`, with a one-line reason that holds no traceback or path."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray_harness import TEST_OPTIONS, collect, distinct_prompts, engine_config, greedy, inprocess_outputs

from raystate.cluster import Cluster
from raystate.errors import EngineDead
from raystate.messages import SamplingParams

MAX_TOKENS = 12
PROMPTS = distinct_prompts(seed=21, num=6)


@pytest.fixture(scope="module")
def cluster(local_ray):
    cluster = Cluster.start(engine_config(), name="test-isolation", num_shards=1, **TEST_OPTIONS)
    yield cluster
    cluster.stop()


def test_tiny_temperatures_do_not_hurt_the_shard(cluster):
    (expected,) = inprocess_outputs([PROMPTS], MAX_TOKENS)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=t, ignore_eos=True)
        for t in (5e-324, 1e-38, 0.0, 5e-324, 0.0, 1e-9)
    ]

    async def run():
        rids = [await cluster.add_request(ids, p) for ids, p in zip(PROMPTS, params, strict=True)]
        out = await collect(cluster)
        return [out[r][0] for r in rids], [out[r][1].finish_reason for r in rids]

    tokens, reasons = asyncio.run(run())
    assert tokens == [o.token_ids for o in expected]
    assert reasons == ["length"] * len(PROMPTS)
    status = asyncio.run(cluster.status())
    assert status["recoveries"] == 0 and status["step_loop_alive"] and status["error"] is None
    assert asyncio.run(cluster.health())


def test_dead_step_loop_is_reported_by_check_alive(local_ray):
    cluster = Cluster.start(engine_config(), name="test-dead-loop", num_shards=1, **TEST_OPTIONS)
    try:

        async def run():
            await cluster.check_alive()  # alive: no error
            scheduler = ray.get_actor("scheduler", namespace="test-dead-loop")
            await scheduler.inject_fault.remote("step_loop")
            for _ in range(100):
                try:
                    await cluster.check_alive()
                except EngineDead as e:
                    return str(e), await cluster.status()
                await asyncio.sleep(0.1)
            raise AssertionError("check_alive still passes 10 s after the step loop died")

        why, status = asyncio.run(run())
        assert "step loop failed" in why
        for text in (why, str(status["error"])):
            assert "Traceback" not in text and ".py" not in text
        assert status["step_loop_alive"] is False
        # The actor itself still answers status(): that alone must not pass for health.
        with pytest.raises(EngineDead):
            asyncio.run(cluster.health())
        with pytest.raises(EngineDead):
            asyncio.run(cluster.add_request([1, 2, 3], greedy(2)))
    finally:
        cluster.stop()
