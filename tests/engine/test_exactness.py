"""Without bounded replay, paged chunked execution with prefix hits and preemption equals a cold run."""

from __future__ import annotations

import pytest
import torch
from engine_harness import greedy_oracle, shared_prefix_prompts

from raystate import SamplingParams

MAX_TOKENS = 6


def _check(llm, log, prompts, outs):
    model = llm.engine.worker.model
    for prompt, out in zip(prompts, outs, strict=True):
        want_tokens, want_logits = greedy_oracle(model, prompt, MAX_TOKENS)
        assert out.token_ids == want_tokens
        assert out.finish_reason == "length"
        n = len(prompt) + MAX_TOKENS - 1
        # Positions below the prefix hit were never computed for this request; all others were.
        first = min(log.rows[out.request_id])
        assert first <= out.num_cached_tokens
        got = log.stacked(out.request_id, first, n)
        torch.testing.assert_close(got, want_logits[first:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [1, 3, 7, 64, 2048])
@pytest.mark.parametrize("concurrent", [True, False], ids=["concurrent", "sequential"])
def test_cache_everything_equals_cold_run(make_llm, budget, concurrent):
    prompts = shared_prefix_prompts(seed=budget, num=4, prefix_len=40)
    llm, log = make_llm(swa_bounded_replay=False, block_size=4, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    if concurrent:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    else:
        outs = [llm.generate(prompt_token_ids=p, sampling_params=params, use_tqdm=False)[0] for p in prompts]
    _check(llm, log, prompts, outs)
    if not concurrent:
        # The later prompts of each family really reused the cache (whole blocks of the shared prefix).
        assert any(o.num_cached_tokens > 0 for o in outs[2:])
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("budget", [7, 64])
def test_preemption_equals_cold_run(make_llm, budget):
    prompts = shared_prefix_prompts(seed=100 + budget, num=5, prefix_len=44)
    # 24 blocks of 4 tokens: not enough for five ~50-token requests at once.
    llm, log = make_llm(swa_bounded_replay=False, block_size=4, num_blocks=24, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    _check(llm, log, prompts, outs)
    llm.engine.scheduler.check_integrity()


def test_prefix_caching_off_equals_cold_run(make_llm):
    prompts = shared_prefix_prompts(seed=7, num=3, prefix_len=40)
    llm, log = make_llm(enable_prefix_caching=False, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = [llm.generate(prompt_token_ids=p, sampling_params=params, use_tqdm=False)[0] for p in prompts]
    assert all(o.num_cached_tokens == 0 for o in outs)
    _check(llm, log, prompts, outs)
