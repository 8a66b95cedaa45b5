"""Logit controls (penalties, logit_bias, min_tokens): the batched device function equals a plain per-row
reference over the token history, rows without controls are untouched bit for bit, and the wire and
validation rules of the new SamplingParams fields."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from logit_reference import reference_row

from raystate.errors import InvalidRequest
from raystate.messages import MAX_BAD_WORD_TOKENS, NewRequest, SamplingParams, ids_to_bytes
from raystate.worker.penalties import LogitControls
from raystate.worker.sampler import Sampler

V = 40
EOS = (3, 7)
NUM_SLOTS = 7  # 6 request slots and the scratch slot


def _new_request(req_id: str, prompt: list[int], output: list[int], p: SamplingParams) -> NewRequest:
    ids = prompt + output
    return NewRequest(req_id, ids_to_bytes(ids), len(prompt), len(ids), 0, [[]], 0, p)


def _controls() -> LogitControls:
    return LogitControls(NUM_SLOTS, V, EOS, torch.device("cpu"))


penalty = st.floats(-2.0, 2.0, allow_nan=False, width=32)
params_st = st.builds(
    SamplingParams,
    max_tokens=st.just(50),
    presence_penalty=st.one_of(st.just(0.0), penalty),
    frequency_penalty=st.one_of(st.just(0.0), penalty),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.0625, 2.0, width=32)),
    logit_bias=st.one_of(
        st.none(), st.dictionaries(st.integers(0, V - 1), st.floats(-100.0, 100.0, width=32), max_size=8)
    ),
    min_tokens=st.one_of(st.just(0), st.integers(0, 6)),
    stop_token_ids=st.lists(st.integers(0, V - 1), max_size=3),
    ignore_eos=st.booleans(),
    allowed_token_ids=st.one_of(st.none(), st.lists(st.integers(0, V - 1), min_size=1, max_size=12)),
    # few distinct ids, so that prefixes often match the output's end
    bad_words_token_ids=st.one_of(
        st.none(), st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=MAX_BAD_WORD_TOKENS), max_size=6)
    ),
)
row_st = st.tuples(
    params_st,
    st.lists(st.integers(0, V - 1), min_size=1, max_size=12),  # prompt
    st.one_of(st.lists(st.integers(0, V - 1), max_size=10), st.lists(st.integers(0, 3), max_size=20)),
)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(row_st, min_size=1, max_size=NUM_SLOTS - 1), seed=st.integers(0, 2**31 - 1))
def test_batched_controls_equal_the_per_row_reference(rows, seed):
    g = torch.Generator().manual_seed(seed)
    controls = _controls()
    slot_order = torch.randperm(NUM_SLOTS - 1, generator=g).tolist()
    slots = slot_order[: len(rows)]
    # A previous request with other controls left its state in every slot: adding must overwrite it.
    for s in range(NUM_SLOTS - 1):
        stale = SamplingParams(
            presence_penalty=1.5,
            logit_bias={1: 50.0},
            min_tokens=3,
            max_tokens=5,
            allowed_token_ids=[2, 3],
            bad_words_token_ids=[[9], [9, 1], [1, 2, 3]],
        )
        controls.add(
            s, _new_request("old", [5, 6], [9, 9], stale), torch.tensor([5, 6, 9, 9], dtype=torch.int32)
        )
    for s, (p, prompt, output) in zip(slots, rows, strict=True):
        req = _new_request(f"r{s}", prompt, output, p)
        controls.add(s, req, torch.tensor(prompt + output, dtype=torch.int32))
    logits = torch.randn(len(rows), V, generator=g) * 5
    logits[:, 0] = float("-inf")  # a masked entry stays masked
    num_output = torch.tensor([len(o) for _, _, o in rows])
    got = controls.apply(logits, torch.tensor(slots), num_output)
    for i, (p, prompt, output) in enumerate(rows):
        want = reference_row(logits[i], p, prompt, output, EOS)
        assert torch.equal(got[i], want), (i, p)
        if not p.has_logit_controls:
            assert torch.equal(got[i], logits[i])  # untouched, bit for bit
    # The steps' sampled ids advance the output counts and tails: each next step equals the reference.
    outputs = [list(o) for _, _, o in rows]
    for step in range(3):
        sampled = torch.randint(0, 4 if step else V, (len(rows),), generator=g)
        controls.count(torch.tensor(slots), sampled)
        for out, t in zip(outputs, sampled.tolist(), strict=True):
            out.append(t)
        got = controls.apply(logits, torch.tensor(slots), torch.tensor([len(o) for o in outputs]))
        for i, (p, prompt, _) in enumerate(rows):
            assert torch.equal(got[i], reference_row(logits[i], p, prompt, outputs[i], EOS)), (step, i, p)


def test_rows_without_controls_are_bit_identical_and_the_scratch_slot_is_off():
    controls = _controls()
    plain = SamplingParams(temperature=0.7, top_k=5, min_p=0.3)  # min_p is the sampler's, not a logit control
    controls.add(0, _new_request("a", [1, 2], [], plain), torch.tensor([1, 2], dtype=torch.int32))
    controls.add(
        1, _new_request("b", [1, 2], [2], SamplingParams(frequency_penalty=1.0)), torch.tensor([1, 2, 2])
    )
    assert not controls.any_enabled(np.array([0, NUM_SLOTS - 1]))
    assert controls.any_enabled(np.array([0, 1]))
    logits = torch.randn(3, V)
    logits[0, 5] = -0.0
    logits[0, 6] = float("nan")
    out = controls.apply(logits, torch.tensor([0, 1, NUM_SLOTS - 1]), torch.tensor([0, 1, 0]))
    assert torch.equal(out[0].nan_to_num(), logits[0].nan_to_num()) and out[0].isnan()[6]
    assert torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])
    controls.remove(1)
    out = controls.apply(logits[1:2], torch.tensor([1]), torch.tensor([1]))
    assert torch.equal(out, logits[1:2])


def test_bad_words_ban_a_last_token_only_after_its_prefix_in_the_output():
    controls = _controls()
    longest = list(range(10, 10 + MAX_BAD_WORD_TOKENS))  # 15 tokens of prefix: the whole tail compared
    p = SamplingParams(bad_words_token_ids=[[1, 2, 3], [4], longest])
    prompt = [5, 1, 2]  # ends with the prefix [1, 2]: the prompt does not count (vLLM's rule)
    controls.add(0, _new_request("a", prompt, [], p), torch.tensor(prompt, dtype=torch.int32))
    logits = torch.zeros(1, V)

    def banned() -> set[int]:
        return set(
            torch.nonzero(controls.apply(logits, torch.tensor([0]), torch.tensor([0]))[0] < -1e30)[
                :, 0
            ].tolist()
        )

    assert banned() == {4}
    for t, want in [(1, {4}), (2, {3, 4}), (9, {4}), (1, {4}), (2, {3, 4}), (2, {4})]:
        controls.count(torch.tensor([0]), torch.tensor([t]))
        assert banned() == want, t
    for t in longest[:-1]:
        controls.count(torch.tensor([0]), torch.tensor([t]))
    assert banned() == {4, longest[-1]}
    # A request that arrives with output already (preemption, migration): its tail comes from the history.
    output = [7, *longest[:-1]]
    controls.add(1, _new_request("b", [5], output, p), torch.tensor([5, *output], dtype=torch.int32))
    out = controls.apply(logits, torch.tensor([1]), torch.tensor([len(output)]))[0]
    assert set(torch.nonzero(out < -1e30)[:, 0].tolist()) == {4, longest[-1]}


def test_min_p_keeps_tokens_near_the_top():
    logits = torch.tensor([[0.0, math.log(0.5), math.log(0.2), 0.0 + math.log(0.09)]])
    sampler = Sampler(torch.device("cpu"), seed=0)
    seen = set()
    for _ in range(200):
        ids, _ = sampler(logits, [SamplingParams(temperature=1.0, min_p=0.3)], [0])
        seen.add(int(ids[0]))
    assert seen == {0, 1}  # p_2 / p_0 = 0.2 < 0.3: dropped, and so is token 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=g)
    ids, _ = sampler(logits, [SamplingParams(temperature=1.3, min_p=1.0)] * 6, [0] * 6)
    assert ids.tolist() == logits.argmax(-1).tolist()  # min_p = 1 is greedy


def test_new_fields_are_off_by_default_and_omitted_on_the_wire():
    enc = msgspec.msgpack.encode
    assert enc(SamplingParams(max_tokens=8)) == enc(SamplingParams(max_tokens=8, repetition_penalty=1.0))
    # A message of a sender that predates the fields (7 entries) decodes with every control off.
    old = msgspec.msgpack.decode(enc([8, 0.0, 1.0, 0, None, [], False]), type=SamplingParams)
    assert old == SamplingParams(max_tokens=8) and not old.has_logit_controls
    p = SamplingParams(presence_penalty=0.5, logit_bias={7: -3.5, 0: 100.0}, min_p=0.1, min_tokens=2)
    back = msgspec.msgpack.decode(enc(p), type=SamplingParams)
    assert back == p and back.logit_bias == {7: -3.5, 0: 100.0}
    assert not SamplingParams(min_p=0.5).has_logit_controls
    assert SamplingParams(min_tokens=1).has_logit_controls


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.5),
        ("logit_bias", {V: 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {i: 1.0 for i in range(301)}),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens
        ("min_tokens", 1.0),
        ("bad_words", ["x"]),  # text: a front end encodes it
        ("bad_words_token_ids", [[]]),
        ("bad_words_token_ids", [[V]]),
        ("bad_words_token_ids", [[1]] * 257),
        ("bad_words_token_ids", [list(range(17))]),
        ("bad_words_token_ids", [1, 2]),
    ],
)
def test_validation_names_the_field(field, value):
    p = SamplingParams(max_tokens=16, **{field: value})
    with pytest.raises(InvalidRequest, match=field):
        p.validate(301 if field == "logit_bias" and len(value) > 300 else V)


def test_valid_extremes_pass():
    SamplingParams(
        max_tokens=4,
        presence_penalty=-2.0,
        frequency_penalty=2,
        repetition_penalty=2.0,
        logit_bias={i: -100.0 for i in range(300)},
        min_p=1.0,
        min_tokens=4,
        bad_words_token_ids=[[299] * 16] * 256,
    ).validate(300)
