"""Token ids outside [0, vocab_size) never reach a kernel: the engine refuses them at intake.

Prompt ids are checked in Scheduler.add_request and stop ids in SamplingParams.validate, both raising
InvalidRequest naming the field; the in-process and Ray paths both go through Scheduler.add_request.
This file drives the public LLM API with the ids the engram hash kernel once read out of bounds on, and
spies on every engram_hash call to prove that only in-range ids (and the lookback's -1) got there.
tests/engine/test_bad_input.py and tests/scheduler/test_scheduler.py cover the other fields.
"""

from __future__ import annotations

import pytest

import raystate.model.engram as engram_module
from raystate import InvalidRequest, SamplingParams
from raystate.config import BYTE_VOCAB_SIZE

VOCAB = BYTE_VOCAB_SIZE  # the "tiny" model's vocabulary
OUT_OF_RANGE = [-1, VOCAB, VOCAB + 1000, 2**31 - 1, 2**31, 2**63]


@pytest.fixture
def hashed_ids(monkeypatch):
    """(smallest, largest) input id and largest lookback id seen by any engram_hash call."""
    seen = {"input": [], "lookback": []}
    real = engram_module.engram_hash

    def spy(input_ids, query_start_loc, lookback, *rest, **kw):
        if input_ids.numel():
            seen["input"] += [int(input_ids.min()), int(input_ids.max())]
        if lookback.numel():
            seen["lookback"] += [int(lookback.min()), int(lookback.max())]
        return real(input_ids, query_start_loc, lookback, *rest, **kw)

    monkeypatch.setattr(engram_module, "engram_hash", spy)
    return seen


def _bad_cases():
    for bad in OUT_OF_RANGE:
        yield pytest.param([5, bad, 7], SamplingParams(max_tokens=2), "prompt_token_ids", id=f"prompt[{bad}]")
    for bad in OUT_OF_RANGE:
        yield pytest.param(
            [5, 6, 7],
            SamplingParams(max_tokens=2, stop_token_ids=[3, bad]),
            "stop_token_ids",
            id=f"stop[{bad}]",
        )


@pytest.mark.parametrize(("prompt", "params", "field"), list(_bad_cases()))
def test_out_of_range_ids_are_refused_before_any_kernel(make_llm, hashed_ids, prompt, params, field):
    llm, _ = make_llm()
    engine = llm.engine
    with pytest.raises(InvalidRequest) as err:
        llm.generate(prompt_token_ids=[[9, 9, 9], prompt], sampling_params=params, use_tqdm=False)
    assert err.value.field == field and field in str(err.value)
    assert not engine.has_unfinished()  # the whole call was withdrawn, nothing queued
    # The edges of the range are accepted and served; only in-range ids were ever hashed.
    outs = llm.generate(
        prompt_token_ids=[[0, VOCAB - 1, 5]],
        sampling_params=SamplingParams(max_tokens=3, stop_token_ids=[0, VOCAB - 1]),
        use_tqdm=False,
    )
    assert len(outs[0].token_ids) >= 1
    assert hashed_ids["input"], "the spy saw no engram_hash call: the model has no engram layer?"
    assert min(hashed_ids["input"]) >= 0 and max(hashed_ids["input"]) < VOCAB
    assert min(hashed_ids["lookback"]) >= -1 and max(hashed_ids["lookback"]) < VOCAB


def test_ids_of_other_integer_types_are_refused_too(make_llm):
    """bool is an int subclass and 2.5 is no id: neither passes as a token id."""
    llm, _ = make_llm()
    with pytest.raises(InvalidRequest) as err:
        llm.generate(
            prompt_token_ids=[[5, 6]],
            sampling_params=SamplingParams(stop_token_ids=[True]),
            use_tqdm=False,
        )
    assert err.value.field == "stop_token_ids"
    with pytest.raises(InvalidRequest) as err:
        llm.generate(prompt_token_ids=[[5, 6, 2.5]], sampling_params=SamplingParams(), use_tqdm=False)
    assert err.value.field == "prompt_token_ids"
