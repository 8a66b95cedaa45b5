"""Ray backend tests: one local Ray (2 CPUs, as in CI) shared by every module here; deployments are stopped
between modules, Ray is not. The multi-node module brings its own `ray.cluster_utils.Cluster`: it shuts the
local Ray down first, and the next module that needs it starts it again.
"""

from __future__ import annotations

import pytest
import ray


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch):
    """In-process runs (the expected outputs) use the kernels' PyTorch references, like the worker actors
    (ray_harness.WORKER_ENV): under Triton's CPU interpreter a step takes seconds."""
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
