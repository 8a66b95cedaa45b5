"""Errors and teardown across processes: a refusal raised in an actor reaches the caller as the same
InvalidRequest (type, field, message), and a stopped deployment's worker processes are gone when `stop`
returns (their GPU memory is free for the next engine)."""

from __future__ import annotations

import os
import pickle

import pytest
import ray
from ray_harness import TEST_OPTIONS, engine_config

from raystate import launch
from raystate.cluster import Cluster
from raystate.errors import InvalidRequest
from raystate.hf.chat_template import ChatTemplateError
from raystate.hf.hub import ModelNotAvailable
from raystate.hf.model_config import UnsupportedConfig
from raystate.serve.server import ModelNotFound
from raystate.serve.text import NoChatTemplate

REFUSALS = [
    InvalidRequest("gpu_memory_utilization", "at most 0.473", 0.5),
    UnsupportedConfig("config.json: rope_scaling", "one of yarn, linear", "dynamic"),
    ChatTemplateError("roles must alternate"),
    ModelNotAvailable("org/model", "/hf", "the hub is unreachable"),
    ModelNotFound("other", "tiny"),
    NoChatTemplate("tiny"),
]


@pytest.mark.parametrize("error", REFUSALS, ids=lambda e: type(e).__name__)
def test_every_refusal_pickles_as_itself(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error) and back.args == error.args
    assert (back.field, back.limit, back.got) == (error.field, error.limit, error.got)


@ray.remote
def _refuse(error: InvalidRequest) -> None:
    raise error


def test_a_refusal_raised_in_a_ray_task_reaches_the_caller_as_an_invalid_request(local_ray):
    with pytest.raises(InvalidRequest, match="gpu_memory_utilization: must be at most 0.473") as info:
        ray.get(_refuse.remote(REFUSALS[0]))
    assert info.value.field == "gpu_memory_utilization"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_stop_returns_once_the_worker_processes_have_exited(local_ray):
    options = {**TEST_OPTIONS, "num_cpus_per_shard": 0.25, "num_gpus_per_shard": 0}
    cluster = Cluster.start(engine_config(), name="teardown", num_shards=2, dry_run=True, **options)
    pids = [where["pid"] for where in ray.get([w.where.remote() for w in cluster.deployment.workers])]
    assert all(_exists(pid) for pid in pids) and os.getpid() not in pids
    cluster.stop()
    assert not any(_exists(pid) for pid in pids)
    assert not launch.exists("teardown")
