"""The decode-graph step with logit controls in the batch (penalties, logit_bias, min_tokens, bad words),
run eagerly on the CPU (an uncaptured `DecodeGraphs`), gives the eager path's tokens, and replays the
controlled variant only for batches that have a controlled row."""

from __future__ import annotations

import numpy as np
import pytest

from raystate import LLM, SamplingParams


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)


def _generate(graph_path: bool, prompts, params):
    llm = LLM(backend="inprocess", device="cpu", max_num_seqs=8, max_model_len=256)
    worker = llm.engine.worker
    variants = []
    if graph_path:
        worker.graphs = worker.new_decode_graphs()  # never captured: `replay` runs the step eagerly
        real = worker.graphs.replay
        worker.graphs.replay = lambda slots, positions, controlled=False: (
            variants.append(controlled) or real(slots, positions, controlled)
        )
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs], [o.finish_reason for o in outs], worker, variants


def test_graph_decode_with_controls_equals_eager_path():
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 8 + 3 * i).tolist() for i in range(7)]
    params = [
        SamplingParams(max_tokens=10, repetition_penalty=1.8, ignore_eos=True),
        SamplingParams(max_tokens=14, ignore_eos=True),  # plain
        SamplingParams(max_tokens=12, ignore_eos=True, bad_words_token_ids=[[200], [17, 30], [5, 5, 5]]),
        SamplingParams(max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={100: 2.5}),
        SamplingParams(
            max_tokens=9, temperature=0.8, seed=7, frequency_penalty=1.0, min_p=0.05, ignore_eos=True
        ),
        SamplingParams(max_tokens=11, temperature=1.1, top_k=30, seed=2, ignore_eos=True),  # plain, random
        SamplingParams(max_tokens=8, min_tokens=6, stop_token_ids=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ]
    plain, plain_reasons, _, _ = _generate(False, prompts, params)
    via_graph, reasons, worker, variants = _generate(True, prompts, params)
    assert via_graph == plain and reasons == plain_reasons
    assert True in variants  # controlled rows decoded through the graph step with the controls
    # The rows that finish last (max_tokens 14 and 11) are plain: those batches take the plain variant.
    assert variants[-1] is False
    assert worker.graphs.num_eager_steps == len(variants)
    assert not worker.controls.host_enabled.any()  # finished requests leave their slots off


def test_graph_decode_with_only_plain_rows_never_applies_controls(monkeypatch):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, 10).tolist() for _ in range(3)]
    called = []
    from raystate.worker.penalties import LogitControls

    real_apply = LogitControls.apply
    monkeypatch.setattr(LogitControls, "apply", lambda self, *a: called.append(1) or real_apply(self, *a))
    _, _, _, variants = _generate(True, prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert variants and not any(variants)
    assert not called
