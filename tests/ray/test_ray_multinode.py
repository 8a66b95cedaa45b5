"""Multi-node (issue 4, test 2): a `ray.cluster_utils.Cluster` with two fake-GPU nodes. Shards spread over
both (one GPU bundle each) while running on the CPU, since the device comes from the config; removing a
node mid-generation drops its shard (no GPU is left for a new worker) and every request still finishes
with the fault-free tokens on the other one."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.cluster_utils import Cluster as LocalCluster
from ray_harness import WORKER_ENV, distinct_prompts, engine_config, inprocess_outputs, run_with_fault

from raystate.cluster import Cluster

pytestmark = pytest.mark.slow  # starts its own multi-node local Ray cluster

MAX_TOKENS = 16
PROMPTS = distinct_prompts(seed=21, num=8)
NAME = "test-multinode"


@pytest.fixture(scope="module")
def two_gpu_nodes():
    if ray.is_initialized():
        ray.shutdown()  # the local Ray of the other modules; the next one that needs it starts it again
    nodes = LocalCluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            # Notice a removed node in about 5 s instead of the default 30 s; not faster, or a node that
            # is merely slow on a loaded 2-core machine (the scheduler's own) may be declared dead.
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5},
        },
    )
    workers = [nodes.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
    ray.init(address=nodes.address, log_to_driver=False)
    nodes.wait_for_nodes()
    yield nodes, workers
    ray.shutdown()
    nodes.shutdown()


def test_shards_spread_over_gpu_nodes_and_survive_a_node_removal(two_gpu_nodes, monkeypatch):
    (want,) = inprocess_outputs([PROMPTS], MAX_TOKENS, swa_bounded_replay=False)
    nodes, gpu_nodes = two_gpu_nodes
    cluster = Cluster.start(
        engine_config(swa_bounded_replay=False),
        name=NAME,
        num_shards=2,
        num_gpus_per_shard=1,
        num_cpus_per_shard=0.5,
        worker_env=WORKER_ENV,
        probe_interval_s=1.0,
        respawn_timeout_s=2.0,
        scheduler_node_id=nodes.head_node.node_id,
    )
    try:
        where = [ray.get(ray.get_actor(f"worker-{i}", namespace=NAME).where.remote()) for i in range(2)]
        assert sorted(w["node_id"] for w in where) == sorted(n.node_id for n in gpu_nodes)
        assert all(w["device"] == "cpu" for w in where)
        victim = next(n for n in gpu_nodes if n.node_id == where[1]["node_id"])
        tokens, recovery_s = run_with_fault(
            cluster, PROMPTS, MAX_TOKENS, lambda: nodes.remove_node(victim), after_updates=24
        )
        status = asyncio.run(cluster.status())
    finally:
        cluster.stop()
    assert tokens == [o.token_ids for o in want]
    assert status["drops"] == 1 and status["live_shards"] == [0] and status["dispatch"] == "compiled"
    assert recovery_s < 60
