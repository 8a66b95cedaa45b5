"""Fixtures of tests/hfmodels: the tiny random checkpoints of `hf_families`, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_families import FAMILIES, make_all


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """family -> checkpoint folder, for every family of `hf_families.FAMILIES`."""
    return make_all(tmp_path_factory.mktemp("hf_families"))


@pytest.fixture(scope="session", params=FAMILIES)
def family_checkpoint(request, family_checkpoints) -> tuple[str, Path]:
    """(family, folder), one per family."""
    return request.param, family_checkpoints[request.param]
