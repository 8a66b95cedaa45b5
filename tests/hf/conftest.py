"""Fixtures of tests/hf: the tiny checkpoints of `hf_checkpoint`, made once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from hf_checkpoint import MAKERS


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_checkpoints")
    return {name: make(root / name) for name, make in MAKERS.items()}


@pytest.fixture(scope="session", params=sorted(MAKERS))
def checkpoint(request, checkpoints) -> Path:
    return checkpoints[request.param]


@pytest.fixture(scope="session")
def pair(checkpoint):
    """(ours, transformers') tokenizers of one checkpoint."""
    from raystate.hf import HFTokenizer

    return HFTokenizer.from_pretrained(checkpoint), transformers.AutoTokenizer.from_pretrained(
        str(checkpoint)
    )
