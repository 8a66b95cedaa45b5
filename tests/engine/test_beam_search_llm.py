"""LLM.beam_search on the tiny model equals a plain beam search over the model's own dense forward (prefix
caching off, so that every step's logits are a cold forward's), and runs with the prefix cache on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from beam_reference import reference_beam_search

from raystate import BeamSearchParams, SamplingParams
from raystate.errors import InvalidRequest
from raystate.model import dense_forward


def test_beams_equal_the_reference_over_the_dense_forward(make_llm):
    llm, _ = make_llm(enable_prefix_caching=False)
    model = llm.engine.worker.model
    eos = set(llm.config.model.eos_token_ids)

    def next_logprobs(tokens: list[int]) -> torch.Tensor:
        return torch.log_softmax(dense_forward(model, tokens)[-1].double(), -1)

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (7, 19)]
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.7)
    outs = llm.beam_search([*prompts[:1], {"prompt_token_ids": prompts[1]}], params)
    for prompt, out in zip(prompts, outs, strict=True):
        want = reference_beam_search(next_logprobs, prompt, 3, 5, eos, False, 0.7)
        assert [s.tokens for s in out.sequences] == [t for t, _, _ in want]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c, _ in want], abs=1e-4)
        for s, (tokens, _, ended) in zip(out.sequences, want, strict=True):
            assert s.finish_reason == ("stop" if ended else "length")
            assert s.text == llm.text.decode(tokens[len(prompt) : len(tokens) - int(ended)])
    # the greedy beam: width 1 is greedy decoding unless an EOS ends it sooner
    [greedy] = llm.beam_search([prompts[0]], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    greedy_params = SamplingParams(max_tokens=5, ignore_eos=True)
    plain = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=greedy_params, use_tqdm=False)
    assert greedy.sequences[0].tokens[len(prompts[0]) :] == plain[0].token_ids


def test_with_the_prefix_cache_and_text_prompts(make_llm):
    llm, _ = make_llm()
    [out] = llm.beam_search("Once upon a time", BeamSearchParams(beam_width=4, max_tokens=6))
    assert 1 <= len(out.sequences) <= 4
    scores = [s.cum_logprob / (len(s.tokens) - (s.finish_reason == "stop")) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=2, max_tokens=10**6))
    with pytest.raises(InvalidRequest, match="prompts"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=2))
