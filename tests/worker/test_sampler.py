"""Sampling: greedy, top-k / top-p filtering, and seeds that make tokens independent of the batch."""

from __future__ import annotations

import torch

from raystate import LLM, SamplingParams
from raystate.messages import FAILED_ROW
from raystate.worker.sampler import MIN_TEMPERATURE, Sampler, _filter_top_k_top_p, greedy_checked


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
    out, failures = sampler(logits, params, [0] * 5)
    assert not failures
    assert out.tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_ignores_batch_and_order():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=g)
    sampler = Sampler(torch.device("cpu"), seed=0)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone, _ = sampler(logits[2:3], [p], [7])
    mixed, _ = sampler(logits[[0, 2, 1]], [SamplingParams(temperature=1.0), p, SamplingParams()], [0, 7, 0])
    assert alone.item() == mixed[1].item()
    # Other positions draw other numbers: over many positions the tokens are not all the same.
    draws = {sampler(logits[2:3], [p], [k])[0].item() for k in range(20)}
    assert len(draws) > 3


def test_seeded_generation_repeats_across_engines(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")  # sampling is under test here, not the kernels
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    prompts = ["abc", "the window"]
    a = LLM(backend="inprocess", max_model_len=128, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    b = LLM(backend="inprocess", max_model_len=128, max_num_seqs=4, seed=99).generate(
        prompts[::-1], params, use_tqdm=False
    )
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]]


def test_tiny_temperatures_are_greedy_and_never_nan():
    """5e-324 and 1e-38 once raised "probability tensor contains inf/nan" (l / t overflowed to inf)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=g) * 30
    sampler = Sampler(torch.device("cpu"), seed=0)
    temps = [5e-324, 1e-38, 1e-6, MIN_TEMPERATURE, 1e-3, 1e4]
    params = [SamplingParams(temperature=t, seed=5) for t in temps]
    out, failures = sampler(logits, params, [0] * 6)
    assert not failures
    assert out[:3].tolist() == logits[:3].argmax(-1).tolist()  # below the floor: greedy
    assert all(0 <= t < 300 for t in out.tolist())


def test_non_finite_rows_fail_alone():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    expected_ok = [0, 4]
    assert greedy_checked(logits).tolist()[1:4] == [FAILED_ROW] * 3
    sampler = Sampler(torch.device("cpu"), seed=0)
    for params in ([SamplingParams()] * 5, [SamplingParams(temperature=0.7, top_p=0.9, seed=1)] * 5):
        out, _ = sampler(logits, params, [0] * 5)
        assert out[1:4].tolist() == [FAILED_ROW] * 3
        assert all(0 <= out[i] < 40 for i in expected_ok)


def test_a_row_whose_sampling_raises_fails_alone():
    """A bad value that got past validation (a float seed: SamplingParams() does not type-check)."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(torch.device("cpu"), seed=0)
    bad = SamplingParams(temperature=1.0, seed=1.5)
    params = [SamplingParams(temperature=1.0, seed=3), bad, SamplingParams()]
    out, failures = sampler(logits, params, [0, 0, 0])
    assert list(failures) == [1] and "sampling failed" in failures[1]
    assert out[1] == FAILED_ROW and out[2] == logits[2].argmax()


def test_top_p_that_underflows_keeps_the_first_token():
    """top_p = 5e-324 is 0 in fp32: the filter must still keep the most likely token (the fuzzer found a
    500 here)."""
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = [
        SamplingParams(temperature=1.0, top_p=5e-324, seed=1),
        SamplingParams(temperature=0.5, top_p=1e-300),
    ]
    out, failures = sampler(logits, params, [0, 0])
    assert not failures and out.tolist() == logits.argmax(-1).tolist()
