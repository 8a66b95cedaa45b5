"""raystate.beam_search on synthetic next-token distributions (EOS often likely, so beams end early) equals
the plain reference search, for several widths, length penalties and ignore_eos; and its parameter checks
name the field."""

from __future__ import annotations

import pytest
import torch
from beam_reference import reference_beam_search

from raystate.beam_search import BeamSearch, BeamSearchBatch, BeamSearchParams, ranked_alternatives
from raystate.errors import InvalidRequest

V = 12
EOS = 3


def _synthetic(seed: int, eos_boost: float):
    """Deterministic log-probabilities from the last two tokens."""

    def next_logprobs(tokens: list[int]) -> torch.Tensor:
        key = (seed * 1_000_003 + 31 * tokens[-1] + 7 * (tokens[-2] if len(tokens) > 1 else 0)) % (2**31)
        logits = torch.randn(V, generator=torch.Generator().manual_seed(key), dtype=torch.float64) * 2
        logits[EOS] += eos_boost
        return torch.log_softmax(logits, -1)

    return next_logprobs


def _run(next_logprobs, prompt, width, max_tokens, ignore_eos, length_penalty):
    search = BeamSearch(prompt, width, max_tokens, frozenset({EOS}), ignore_eos, length_penalty)
    while beams := search.pending():
        results = []
        for tokens in beams:
            lp = next_logprobs(tokens)
            top = torch.topk(lp, search.num_candidates)
            greedy = int(lp.argmax())
            # the wire's record: the sampled (greedy) token, then the alternatives best first
            ids = [greedy, *top.indices.tolist()]
            lps = [float(lp[greedy]), *top.values.tolist()]
            results.append(ranked_alternatives(ids, lps, search.num_candidates))
        search.advance(results)
    return search


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize(
    ("ignore_eos", "length_penalty", "eos_boost"),
    [(False, 1.0, 1.5), (False, 0.5, 2.5), (True, 2.0, 1.5), (False, -1.0, 0.0)],
)
def test_equals_the_reference_search(width, ignore_eos, length_penalty, eos_boost):
    ended = 0
    for seed in range(6):
        f = _synthetic(seed, eos_boost)
        prompt = [seed % V, (seed * 5 + 1) % V]
        search = _run(f, prompt, width, 6, ignore_eos, length_penalty)
        got = search.best()
        want = reference_beam_search(f, prompt, width, 6, {EOS}, ignore_eos, length_penalty)
        assert [(b.tokens, b.ended) for b in got] == [(t, e) for t, _, e in want]
        assert [b.cum_logprob for b in got] == pytest.approx([c for _, c, _ in want], abs=1e-9)
        assert all(len(b.output_ids) <= 6 for b in got)
        ended += len(search.finished)
    if ignore_eos:
        assert ended == 0
    elif eos_boost:
        assert ended > 0  # the finished path is exercised


def test_params_are_checked_by_name():
    for bad, field in [
        (BeamSearchParams(beam_width=11, max_tokens=4), "beam_width"),
        (BeamSearchParams(beam_width=0, max_tokens=4), "beam_width"),
        (BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens"),
        (BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    ]:
        with pytest.raises(InvalidRequest, match=field):
            bad.validate()


def test_a_batch_steps_each_search_as_it_would_run_alone():
    f = _synthetic(9, 1.5)
    prompts = [[1, 2], [5], [7, 7, 7]]
    searches = [BeamSearch(p, 3, 5 + i, frozenset({EOS})) for i, p in enumerate(prompts)]
    batch = BeamSearchBatch(searches)
    while flat := batch.pending():
        alternatives = []
        for tokens in flat:
            top = torch.topk(f(tokens), 6)
            alternatives.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
        batch.advance(alternatives)
    for i, (p, search) in enumerate(zip(prompts, searches, strict=True)):
        alone = _run(f, p, 3, 5 + i, False, 1.0)
        assert [b.tokens for b in search.best()] == [b.tokens for b in alone.best()]
