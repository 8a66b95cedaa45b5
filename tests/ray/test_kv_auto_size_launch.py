"""A deployment whose workers size their KV caches at start (CUDA, no size set): the launcher fixes the
smallest count of every shard in the config the scheduler, the client and replacement workers get, and
a worker that Ray restarted with fewer blocks than the pools is not taken back. Dry-run workers (no
model, no device) report the config's small default, so this runs on the CPU."""

from __future__ import annotations

import dataclasses
import threading
import time

import ray
from ray_harness import TEST_OPTIONS, engine_config

from raystate.cluster import Cluster
from raystate.scheduler.scheduler import Scheduler
from raystate.scheduler.supervisor import ShardSupervisor
from raystate.worker.actor import WorkerActor


def cuda_config():
    return dataclasses.replace(engine_config(), device="cuda")


def test_the_deployment_runs_the_blocks_its_workers_report(local_ray):
    config = cuda_config()
    assert config.kv_sized_at_start
    options = {**TEST_OPTIONS, "num_cpus_per_shard": 0.25, "num_gpus_per_shard": 0}
    cluster = Cluster.start(config, name="kv-auto", num_shards=2, dry_run=True, **options)
    try:
        reported = ray.get([w.kv_blocks.remote() for w in cluster.deployment.workers])
        assert reported == [config.static_group_blocks()] * 2
        assert cluster.config.cache.group_blocks == config.static_group_blocks()
        assert not cluster.config.kv_sized_at_start
        assert ray.get(cluster.scheduler.get_config.remote()) == cluster.config
        assert Cluster.connect("kv-auto").config == cluster.config  # what a Serve replica gets
    finally:
        cluster.stop()


def test_a_restarted_worker_with_fewer_blocks_than_the_pools_is_replaced(local_ray):
    small = engine_config()  # a dry-run worker reports its config's blocks
    pools = small.with_group_blocks(tuple(n + 1 for n in small.static_group_blocks()))
    worker = ray.remote(WorkerActor).options(num_cpus=0.25).remote(small, 0, True)
    try:
        ray.get(worker.incarnation.remote())
        for sched_config, holds in ((small, True), (pools, False)):
            sup = ShardSupervisor([worker], Scheduler(sched_config, 1), threading.Lock(), "actor", 10.0)
            assert sup._holds_pools(0, time.monotonic() + 10) is holds
    finally:
        ray.kill(worker)
