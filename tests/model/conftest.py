"""Shared fixtures of the model tests: one seeded tiny model, loaded once."""

import pytest

from raystate.model import load_model


@pytest.fixture(scope="session")
def tiny_model():
    return load_model("tiny", seed=0)
