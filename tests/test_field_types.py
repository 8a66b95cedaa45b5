"""The Python API's option classes check their values' types and their keyword names, and say which
field is at fault (the CLI and the Serve args have schemas of their own in front of them)."""

from __future__ import annotations

import numpy as np
import pytest

from raystate.cluster import Cluster
from raystate.errors import InvalidRequest
from raystate.launch import LaunchOptions


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("num_shards", "2", "of type int"),
        ("num_shards", 2.0, "of type int"),
        ("num_cpus_per_shard", "1", "of type float"),
        ("num_gpus_per_shard", "half", "of type float or None"),
        ("detached", 1, "of type bool"),
        ("worker_env", ["A=1"], "of type dict"),
        ("name", 7, "of type str"),
    ],
)
def test_a_launch_option_of_the_wrong_type_names_the_field(field, value, limit):
    with pytest.raises(InvalidRequest, match=limit) as err:
        LaunchOptions(**{field: value})
    assert err.value.field == field


def test_launch_options_take_numbers_of_any_integral_or_real_type():
    options = LaunchOptions(num_shards=np.int64(2), num_cpus_per_shard=1, num_gpus_per_shard=None)
    assert options.num_shards == 2 and options.num_cpus_per_shard == 1


def test_pipeline_steps_defaults_from_the_environment(monkeypatch):
    monkeypatch.delenv("RAYSTATE_PIPELINE_STEPS", raising=False)
    assert LaunchOptions().pipeline_steps is True  # on by default (measured: BENCHMARKS.md)
    monkeypatch.setenv("RAYSTATE_PIPELINE_STEPS", "0")
    assert LaunchOptions().pipeline_steps is False
    assert LaunchOptions(pipeline_steps=True).pipeline_steps is True
    monkeypatch.setenv("RAYSTATE_PIPELINE_STEPS", "1")
    assert LaunchOptions().pipeline_steps is True
    with pytest.raises(InvalidRequest, match="of type bool"):
        LaunchOptions(pipeline_steps="yes")


def test_an_unknown_launch_option_is_refused_before_ray_is_touched():
    import ray

    ray_before = ray.is_initialized()  # an earlier test module may have started one
    with pytest.raises(InvalidRequest, match="a launch option .*num_cpus_per_shard") as err:
        Cluster.start(None, name="never", num_cpu_per_shard=1)
    assert err.value.field == "num_cpu_per_shard"
    assert ray.is_initialized() == ray_before
