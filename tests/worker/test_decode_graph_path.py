"""The decode-graph step's device work, run eagerly on the CPU (an uncaptured `DecodeGraphs`), gives the
plain eager path's tokens: staging, the in-step slot/lookback/table preparation, padding rows on the
scratch slot, the in-step greedy append and host-side sampling for non-greedy rows."""

from __future__ import annotations

import numpy as np
import pytest

from raystate import LLM, SamplingParams


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")  # the kernels' own tests cover the Triton side
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)


def _generate(graph_path: bool, prompts, params):
    llm = LLM(backend="inprocess", device="cpu", max_num_seqs=8, max_model_len=256)
    worker = llm.engine.worker
    if graph_path:
        worker.graphs = worker.new_decode_graphs()  # never captured: `replay` runs the step eagerly
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs], worker


def test_graph_decode_step_equals_eager_path():
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 256, 40).tolist()
    # 7 requests: decode batches of 7, then fewer as they finish, padded up to 8 / 4 / 2 / 1 rows.
    prompts = [prefix[: 10 + 4 * i] + rng.integers(0, 256, 3 + i).tolist() for i in range(7)]
    params = [
        SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)
        if i % 3
        else SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=i, ignore_eos=True)
        for i in range(7)
    ]
    plain, _ = _generate(False, prompts, params)
    via_graph, worker = _generate(True, prompts, params)
    assert via_graph == plain
    states = worker.states
    # Padding rows touched only the scratch slot: its token 0 stays a valid id, no request slot is used.
    assert int(states.all_token_ids[states.scratch_slot, 0]) == 0
    assert worker.graphs.num_eager_steps >= 12  # the decode steps really took this path


def test_graph_path_is_skipped_for_prefill_and_mixed_steps():
    llm = LLM(backend="inprocess", device="cpu", max_num_seqs=4, max_model_len=128)
    worker = llm.engine.worker
    worker.graphs = worker.new_decode_graphs()
    calls = []
    real = worker.graphs.replay
    worker.graphs.replay = lambda slots, *a: calls.append(len(slots)) or real(slots, *a)
    llm.generate(
        prompt_token_ids=[[5] * 20],
        sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    # The prefill step (20 tokens) ran eagerly; the three decode steps after the first token replayed.
    assert calls == [1, 1, 1]
