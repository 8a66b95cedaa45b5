"""On a GPU: decode steps replayed from captured CUDA graphs give the eager steps' tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystate import LLM, SamplingParams
from raystate.worker.cudagraph import capture_sizes


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(dtype):
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 256, 80).tolist()
    # 11 requests: the decode batches are padded to the captured sizes 16 and smaller.
    prompts = [prefix[: 40 + 3 * i] + rng.integers(0, 256, 5 + i).tolist() for i in range(11)]
    # Greedy rows sample inside the graph; every third row samples on the host from the graph's logits.
    params = [
        SamplingParams(max_tokens=24 - i, ignore_eos=True)
        if i % 3
        else SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(11)
    ]
    outs = {}
    for graphs in (True, False):
        llm = LLM(
            backend="inprocess",
            device="cuda",
            dtype=dtype,
            cuda_graphs=graphs,
            max_num_seqs=16,
            max_model_len=512,
            num_blocks=513,  # sized, not from the GPU the test processes share
        )
        worker = llm.engine.worker
        assert (worker.graphs is not None) == graphs
        lookback_addr = worker.model_state.lookback.data_ptr()
        outs[graphs] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        if graphs:
            assert worker.graphs.num_replays > 0  # the decode steps really ran from graphs
            # The persistent lookback buffer kept the address the graphs captured.
            assert worker.model_state.lookback.data_ptr() == lookback_addr
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_graph_replay_with_logit_controls_equals_eager():
    """The controlled graph variant (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens) gives
    the eager steps' tokens, in batches mixing controlled and plain rows."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, 12 + 5 * i).tolist() for i in range(6)]
    params = [
        SamplingParams(max_tokens=20, repetition_penalty=1.5, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=20, ignore_eos=True),  # plain
        SamplingParams(max_tokens=20, bad_words_token_ids=[[65], [66, 67], [1, 2, 3]], ignore_eos=True),
        SamplingParams(max_tokens=20, allowed_token_ids=list(range(60, 90)), logit_bias={70: 2.0}),
        SamplingParams(max_tokens=20, min_tokens=10, temperature=0.9, seed=4, presence_penalty=1.0),
        SamplingParams(max_tokens=14, ignore_eos=True),  # plain
    ]
    outs = {}
    for graphs in (True, False):
        llm = LLM(
            backend="inprocess",
            device="cuda",
            cuda_graphs=graphs,
            max_num_seqs=8,
            max_model_len=256,
            num_blocks=257,
        )
        outs[graphs] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        if graphs:
            assert llm.engine.worker.graphs.num_replays > 0
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
    assert set(outs[True][3]) <= set(range(60, 90))
