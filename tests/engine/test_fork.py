"""n > 1 choices on the in-process engine: the later siblings of a prompt are forked from the first when
its last prompt chunk is scheduled (raystate.scheduler.kv_manager.KVManager.fork) and each choice equals
the same request run cold on its own; when a fork cannot happen, siblings take the queue's way."""

from __future__ import annotations

import numpy as np
import pytest

from raystate import SamplingParams
from raystate.fanout import child_requests

BLOCK = 16
W = 32  # the tiny model's sliding window
PROMPT = np.random.default_rng(5).integers(0, 256, 150).tolist()  # 9 whole blocks and 6 tokens
FORK_AT = (len(PROMPT) - 1) // BLOCK * BLOCK  # 144


def _sampling(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 6)
    return SamplingParams(temperature=0.8, seed=11, ignore_eos=True, **kw)


def _cold(make_llm, sampling: SamplingParams) -> list[list[int]]:
    """Each choice run alone on a fresh engine without prefix caching: the reference."""
    llm, _ = make_llm(block_size=BLOCK, enable_prefix_caching=False)
    outs = []
    for child in child_requests("cold", PROMPT, sampling):
        (out,) = llm.generate(prompt_token_ids=PROMPT, sampling_params=child.sampling, use_tqdm=False)
        outs.append(out.token_ids)
    return outs


def _run(llm, sampling: SamplingParams, on_step=None) -> dict[str, list[int]]:
    """Submits one prompt's n choices as the front ends do and steps the engine to the end, checking the
    pools' bookkeeping after every step."""
    engine = llm.engine
    children = child_requests("r", PROMPT, sampling)
    for c in children:
        engine.add_request(c.req_id, PROMPT, c.sampling, fork_of=c.fork_of)
    tokens: dict[str, list[int]] = {c.req_id: [] for c in children}
    while engine.has_unfinished():
        for u in engine.step():
            tokens[u.req_id] += u.new_token_ids
        engine.scheduler.check_integrity()
        if on_step is not None:
            on_step(engine)
    return tokens


@pytest.mark.parametrize(
    "budget, caching",
    [
        (64, True),  # chunks [0, 64), [64, 128), [128, 150): the last chunk starts before f = 144
        (73, True),  # chunks [0, 73), [73, 146), [146, 150): it starts past f (window blocks released)
        (256, True),  # the whole prompt in one step
        (64, False),  # prefix caching off: plain groups share too
    ],
)
def test_siblings_fork_and_equal_cold_runs(make_llm, budget, caching):
    sampling = _sampling(n=3)
    llm, _ = make_llm(block_size=BLOCK, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    worker = llm.engine.worker
    full = [s.name for s in worker.groups].index("full")
    seen = {}

    def blocks(engine):  # the full-attention blocks of the three after the step that forked
        reqs = [engine.scheduler.get_request(rid) for rid in ("r-0", "r-1", "r-2")]
        if not seen and all(r is not None and r.block_ids for r in reqs):
            seen.update({r.req_id: list(r.block_ids[full]) for r in reqs})

    tokens = _run(llm, sampling, on_step=blocks)
    assert list(tokens.values()) == _cold(make_llm, sampling)
    stats = llm.engine.scheduler.stats()
    assert stats.forked_tokens == 2 * FORK_AT
    assert stats.prefix_hit_tokens == 0 and stats.replayed_tokens == 0
    # The siblings share the first one's blocks below the fork point and own the block holding the last
    # prompt token.
    shared = FORK_AT // BLOCK
    assert seen["r-1"][:shared] == seen["r-0"][:shared] == seen["r-2"][:shared]
    assert len({seen[r][shared] for r in seen}) == 3
    llm.engine.scheduler.shards[0].kv.check_integrity(idle=True)


def test_greedy_choices_are_identical(make_llm):
    llm, _ = make_llm(block_size=BLOCK, max_num_batched_tokens=64)
    params = SamplingParams(n=4, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=PROMPT, sampling_params=params, use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(o.token_ids == out.token_ids for o in out.outputs)
    assert llm.engine.scheduler.stats().forked_tokens == 3 * FORK_AT


def test_parent_aborted_mid_prompt_hands_the_prompt_to_a_sibling(make_llm):
    sampling = _sampling(n=3)
    llm, _ = make_llm(block_size=BLOCK, max_num_batched_tokens=64, enable_prefix_caching=False)
    engine = llm.engine
    children = child_requests("r", PROMPT, sampling)
    for c in children:
        engine.add_request(c.req_id, PROMPT, c.sampling, fork_of=c.fork_of)
    tokens: dict[str, list[int]] = {c.req_id: [] for c in children}
    engine.step()  # r-0 computes its first chunk; r-1 and r-2 wait on it
    assert engine.scheduler.stats().num_waiting == [2]
    engine.abort("r-0")
    while engine.has_unfinished():
        for u in engine.step():
            tokens[u.req_id] += u.new_token_ids
        engine.scheduler.check_integrity()
    cold = _cold(make_llm, sampling)
    assert [tokens["r-1"], tokens["r-2"]] == cold[1:]
    assert engine.scheduler.stats().forked_tokens == 0  # each computed the prompt itself


def test_parked_sibling_abort(make_llm):
    sampling = _sampling(n=3)
    llm, _ = make_llm(block_size=BLOCK, max_num_batched_tokens=64)
    engine = llm.engine
    for c in child_requests("r", PROMPT, sampling):
        engine.add_request(c.req_id, PROMPT, c.sampling, fork_of=c.fork_of)
    engine.step()
    engine.abort("r-1")
    engine.scheduler.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check_integrity()
    assert engine.scheduler.stats().forked_tokens == FORK_AT  # r-2 alone


def test_no_room_to_fork_takes_the_queue(make_llm):
    """One sequence slot: the siblings cannot join the first's last chunk; they run after it from the
    queue (here with prefix caching off, so each recomputes the prompt and stays exact)."""
    sampling = _sampling(n=3)
    llm, _ = make_llm(block_size=BLOCK, max_num_seqs=1, enable_prefix_caching=False)
    tokens = _run(llm, sampling)
    assert list(tokens.values()) == _cold(make_llm, sampling)
    assert llm.engine.scheduler.stats().forked_tokens == 0


def test_prompt_logprobs_choices_compute_their_own_prompt(make_llm):
    llm, _ = make_llm(block_size=BLOCK)
    params = SamplingParams(n=2, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    (out,) = llm.generate(prompt_token_ids=PROMPT, sampling_params=params, use_tqdm=False)
    assert llm.engine.scheduler.stats().forked_tokens == 0
    assert len(out.prompt_logprobs) == len(PROMPT)


def test_the_engine_takes_one_choice_per_request(make_llm):
    llm, _ = make_llm()
    with pytest.raises(ValueError, match="n"):
        llm.engine.add_request("x", PROMPT[:10], SamplingParams(n=2))
    with pytest.raises(ValueError, match=r"\[1, 128\]"):
        llm.generate(prompt_token_ids=PROMPT[:10], sampling_params=SamplingParams(n=0), use_tqdm=False)
    assert not llm.engine.has_unfinished()
