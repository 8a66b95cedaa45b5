"""Fixtures of tests/hfmodels: the tiny random checkpoints of `hf_families`, made once per session, and the
kernels' PyTorch references for every engine these tests run (the Triton interpreter is too slow for whole
models) unless a module is marked `triton_kernels`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_families import FAMILIES, make_all


@pytest.fixture(scope="module", autouse=True)
def reference_kernels(request):
    """Module scope, so that engines and apps a module-scoped fixture builds run the references too."""
    if request.node.get_closest_marker("triton_kernels"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSTATE_KERNELS", "reference")
        mp.setattr("raystate.kernels._common._reference_forced", True)
        yield


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> checkpoint folder, for every family of `hf_families.FAMILIES`."""
    return make_all(tmp_path_factory.mktemp("hf_families"))


@pytest.fixture(scope="session", params=FAMILIES)
def family_checkpoint(request, family_checkpoints) -> tuple[str, Path]:
    """(family, folder), one per family."""
    return request.param, family_checkpoints[request.param]
