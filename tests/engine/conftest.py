"""Fixtures for the in-process engine tests.

The engine tests run the kernels' PyTorch references (RAYSTATE_KERNELS=reference): under Triton's CPU
interpreter a step takes seconds. `test_engine_kernels.py` runs the engine on the interpreted Triton
kernels once; tests/kernels checks each kernel against its reference.
"""

from __future__ import annotations

import pytest
from engine_harness import LogitLog

from raystate import LLM


@pytest.fixture(autouse=True)
def reference_kernels(monkeypatch, request):
    if "triton_kernels" not in request.keywords:
        monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
        monkeypatch.setattr("raystate.kernels._common._reference_forced", True)


@pytest.fixture
def make_llm():
    def make(**kw) -> tuple[LLM, LogitLog]:
        kw.setdefault("max_model_len", 256)
        kw.setdefault("max_num_seqs", 8)
        llm = LLM(model="tiny", device="cpu", backend="inprocess", **kw)
        log = LogitLog()
        llm.engine.worker.logit_recorder = log
        return llm, log

    return make
