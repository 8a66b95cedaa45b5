"""Sampling: greedy, top-k / top-p filtering, and seeds that make tokens independent of the batch."""

from __future__ import annotations

import torch

from raystate import LLM, SamplingParams
from raystate.worker.sampler import Sampler, _filter_top_k_top_p


def test_top_k_and_top_p_filter():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    kept = torch.isfinite(_filter_top_k_top_p(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, False, True]
    # softmax([3, 2, 1, 0]) = [0.644, 0.237, 0.087, 0.032]: 0.7 needs the two largest.
    kept = torch.isfinite(_filter_top_k_top_p(logits, top_k=0, top_p=0.7))
    assert kept.tolist() == [False, True, False, True]
    kept = torch.isfinite(_filter_top_k_top_p(logits, top_k=0, top_p=0.5))
    assert kept.tolist() == [False, True, False, False]


def test_greedy_and_top_k_one_pick_the_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)] * 2 + [SamplingParams()]
    out = sampler(logits, params, [0] * 5)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_ignores_batch_and_order():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=g)
    sampler = Sampler(torch.device("cpu"), seed=0)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = sampler(logits[2:3], [p], [7])
    mixed = sampler(logits[[0, 2, 1]], [SamplingParams(temperature=1.0), p, SamplingParams()], [0, 7, 0])
    assert alone.item() == mixed[1].item()
    # Other positions draw other numbers: over many positions the tokens are not all the same.
    draws = {sampler(logits[2:3], [p], [k]).item() for k in range(20)}
    assert len(draws) > 3


def test_seeded_generation_repeats_across_engines(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")  # sampling is under test here, not the kernels
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    prompts = ["abc", "the window"]
    a = LLM(backend="inprocess", max_model_len=128, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    b = LLM(backend="inprocess", max_model_len=128, max_num_seqs=4, seed=99).generate(
        prompts[::-1], params, use_tqdm=False
    )
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]]
