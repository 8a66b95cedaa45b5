"""Faults (issue 4, test 3): a worker killed or crashed mid-generation loses only device state, and every
request still finishes with the tokens of a fault-free run (greedy, bounded replay off); a killed scheduler
makes pending calls raise EngineDead within 30 s instead of hanging."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray_harness import (
    TEST_OPTIONS,
    distinct_prompts,
    engine_config,
    greedy,
    inprocess_outputs,
    run_with_fault,
)

from raystate.cluster import Cluster
from raystate.errors import EngineDead

MAX_TOKENS = 24
PROMPTS = distinct_prompts(seed=11, num=16)


@pytest.fixture(scope="module")
def fault_free():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSTATE_KERNELS", "reference")
        mp.setattr("raystate.kernels._common._reference_forced", True)
        (outs,) = inprocess_outputs([PROMPTS], MAX_TOKENS, swa_bounded_replay=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def cluster(local_ray):
    cluster = Cluster.start(
        engine_config(swa_bounded_replay=False), name="test-faults", num_shards=2, **TEST_OPTIONS
    )
    yield cluster
    cluster.stop()


def test_killed_worker_is_replaced_and_requests_finish_with_fault_free_tokens(cluster, fault_free):
    victim = ray.get_actor("worker-1", namespace="test-faults")
    tokens, recovery_s = run_with_fault(cluster, PROMPTS, MAX_TOKENS, lambda: ray.kill(victim))
    assert tokens == fault_free
    status = asyncio.run(cluster.status())
    assert status["respawns"] == 1 and status["recoveries"] == 1 and status["live_shards"] == [0, 1]
    assert recovery_s < 30
    assert ray.get(ray.get_actor("worker-1", namespace="test-faults").where.remote())["shard"] == 1
    assert asyncio.run(cluster.health())  # the replacement runs real steps


def test_killed_scheduler_fails_pending_calls_within_30s(cluster):
    async def run():
        started = time.monotonic()
        killed = False
        with pytest.raises(EngineDead):
            async for u in cluster.generate([1, 2, 3], greedy(400)):
                if not killed and not u.finished:
                    # Updates already in flight may still arrive: kill once.
                    ray.kill(ray.get_actor("scheduler", namespace="test-faults"))
                    killed = True
        waited = time.monotonic() - started
        with pytest.raises(EngineDead):
            async for _ in cluster.generate([4, 5, 6], greedy(4)):
                pass
        with pytest.raises(EngineDead):
            await cluster.health()
        return waited

    assert asyncio.run(run()) < 30
    cluster.stop()  # the workers of a dead scheduler go too
    for shard in range(2):
        with pytest.raises(ValueError):
            ray.get_actor(f"worker-{shard}", namespace="test-faults")


@pytest.mark.parametrize(
    ("options", "victim"),
    [({"dispatch": "actor"}, "worker-0"), ({"pipeline_steps": True}, "worker-1")],
    ids=["actor-calls", "pipelined-graph"],
)
def test_crashed_worker_restarts(local_ray, fault_free, options, victim):
    """Ray restarts the crashed worker in place (its device state lost, its requests sent again), and the
    dispatch goes on over it: actor calls through the same handles; the compiled graph of
    `execute_behind` (pipeline_steps) rebuilt, as the plain graph is."""
    name = "test-faults-" + next(iter(options))
    cluster = Cluster.start(
        engine_config(swa_bounded_replay=False), name=name, num_shards=2, **{**TEST_OPTIONS, **options}
    )
    try:
        actor = ray.get_actor(victim, namespace=name)
        tokens, recovery_s = run_with_fault(cluster, PROMPTS, MAX_TOKENS, lambda: actor.crash.remote())
        status = asyncio.run(cluster.status())
    finally:
        cluster.stop()
    assert tokens == fault_free
    assert status["restarts"] == 1 and status.get("respawns", 0) == 0 and status["live_shards"] == [0, 1]
    assert status["pipelined"] == options.get("pipeline_steps", False)
    assert recovery_s < 30
