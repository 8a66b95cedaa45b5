"""Profile mode of the in-process engine: one `StepTiming` per step, phases filled where work ran."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystate import LLM, SamplingParams
from raystate.engine import PHASES, StepTiming


def _run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, dict[str, list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished():
        for u in engine.step():
            out[u.req_id].extend(u.new_token_ids)
        steps += 1
    return steps, out


def test_profile_records_one_timing_per_step(make_llm):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (40, 23, 57)]
    max_tokens = 4
    # No prefix caching: every prompt token is computed, so the scheduled-token count is known exactly.
    # A small token budget splits the prefills over several steps (rows that sample nothing).
    llm, _ = make_llm(enable_prefix_caching=False, max_num_batched_tokens=32)
    engine = llm.engine
    engine.worker.logit_recorder = None
    assert engine.profile is False
    engine.profile = True
    assert engine.worker.profile is True

    steps, out = _run(engine, prompts, max_tokens)

    times = engine.step_times
    assert len(times) == steps > len(prompts)
    assert all(isinstance(t, StepTiming) for t in times)
    for t in times:
        for name in (*PHASES, "total"):
            assert getattr(t, name) >= 0.0, (name, t)
        assert t.schedule > 0 and t.total > 0
        assert t.total >= sum(getattr(t, name) for name in PHASES)
        if t.num_rows > 0:
            assert t.prepare > 0 and t.forward > 0 and t.sample > 0 and t.dispatch > 0 and t.update > 0, t
            assert t.num_tokens >= t.num_rows
    assert any(t.num_rows > 0 for t in times)
    # Each prompt token once, then every generated token but the last fed back as a decode input.
    assert sum(t.num_tokens for t in times) == sum(map(len, prompts)) + len(prompts) * (max_tokens - 1)
    assert all(len(v) == max_tokens for v in out.values())

    # Off again: the next steps add no records.
    engine.profile = False
    more, _ = _run(engine, [prompts[0][:9]], max_tokens=2)
    assert more > 0 and len(engine.step_times) == steps

    # Profiling changes no token: the same greedy outputs as an engine that never profiled.
    llm_off, _ = make_llm(enable_prefix_caching=False, max_num_batched_tokens=32)
    llm_off.engine.worker.logit_recorder = None
    _, out_off = _run(llm_off.engine, prompts, max_tokens)  # (async scheduling: its step count differs)
    assert llm_off.engine.step_times == []
    assert out_off == out


@pytest.mark.gpu
@pytest.mark.triton_kernels  # the compiled kernels, not the references the other engine tests run
def test_profile_on_cuda_with_graphs_keeps_tokens():
    """Profile mode's device syncs sit between phases: the tokens match, graph replays are timed too."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (70, 33, 95, 12)]
    outs = {}
    for profile in (False, True):
        llm = LLM(backend="inprocess", device="cuda", max_num_seqs=8, max_model_len=256, num_blocks=129)
        engine = llm.engine
        engine.profile = profile
        steps, outs[profile] = _run(engine, prompts, max_tokens=12)
        assert len(engine.step_times) == (steps if profile else 0)
        if profile:
            assert engine.worker.graphs.num_replays > 0
            ran = [t for t in engine.step_times if t.num_rows]
            assert ran and all(t.prepare > 0 and t.forward > 0 and t.sample > 0 for t in ran)
        del llm, engine
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
