"""Penalties, logit_bias, allowed_token_ids, min_tokens and min_p end to end through the in-process
engine: each greedy token is the argmax of the raw logits the worker computed with the request's controls
applied by a plain per-token reference, a +100 bias forces its token, allowed_token_ids keeps every token
(sampled too) in its list, min_tokens holds EOS and stop ids back (on the device and in the scheduler's
finishing rule), min_p = 1 is greedy."""

from __future__ import annotations

import numpy as np
from logit_reference import reference_row

from raystate import SamplingParams


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(5, 30))).tolist() for _ in range(n)]


def test_greedy_tokens_follow_the_reference_controls(make_llm):
    llm, log = make_llm()
    eos = llm.engine.worker.controls.eos_token_ids
    prompts = _prompts(0, 6)
    params = [
        SamplingParams(max_tokens=14, repetition_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=14, frequency_penalty=2.0, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=14, ignore_eos=True),  # plain, in the same batch
        SamplingParams(
            max_tokens=14, presence_penalty=-2.0, logit_bias={65: 3.0, 66: -100.0}, ignore_eos=True
        ),
        SamplingParams(max_tokens=14, repetition_penalty=0.5, frequency_penalty=-0.5, min_tokens=5),
        SamplingParams(max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.3),
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    plain = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=[SamplingParams(max_tokens=14, ignore_eos=p.ignore_eos) for p in params],
        use_tqdm=False,
    )
    for out, p, prompt in zip(outs, params, prompts, strict=True):
        rows = log.rows[out.request_id]
        for k, token in enumerate(out.token_ids):
            raw = rows[len(prompt) + k - 1]
            want = reference_row(raw, p, prompt, out.token_ids[:k], eos)
            assert int(want.argmax()) == token, (p, k)
    assert outs[2].token_ids == plain[2].token_ids
    changed = [o.token_ids != q.token_ids for o, q in zip(outs, plain, strict=True)]
    assert changed[0] and changed[3]


def test_large_penalties_stop_repeats(make_llm):
    llm, _ = make_llm()
    prompts = _prompts(0, 6)
    plain = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=14, ignore_eos=True),
        use_tqdm=False,
    )
    assert any(len(set(o.token_ids)) < len(o.token_ids) for o in plain)  # greedy alone repeats
    p = SamplingParams(max_tokens=14, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
    for o in outs:
        assert len(set(o.token_ids)) == len(o.token_ids), o.token_ids


def test_logit_bias_forces_a_token(make_llm):
    llm, _ = make_llm()
    prompts = _prompts(1, 3)
    params = [
        SamplingParams(max_tokens=6, logit_bias={42: 100.0}, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias={43: 100.0}, ignore_eos=True),
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert outs[0].token_ids == [42] * 6
    assert outs[1].token_ids == [43] * 6
    assert outs[2].token_ids != [42] * 6


def test_min_tokens_holds_back_stop_ids(make_llm):
    llm, _ = make_llm()
    prompt = _prompts(2, 1)
    first = llm.generate(
        prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False
    )
    t0 = first[0].token_ids[0]
    stopped = llm.generate(
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=8, stop_token_ids=[t0]),
        use_tqdm=False,
    )[0]
    assert stopped.token_ids == [t0] and stopped.finish_reason == "stop"
    held = llm.generate(
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=8, stop_token_ids=[t0], min_tokens=4),
        use_tqdm=False,
    )[0]
    assert t0 not in held.token_ids[:4]
    assert len(held.token_ids) >= 5
    assert held.finish_reason == "length" or held.token_ids[-1] == t0


def test_scheduler_does_not_stop_before_min_tokens(make_llm):
    """Without the device mask (bypassed here), the stop id is sampled at once: the finishing rule alone
    keeps the request going until it has min_tokens tokens."""
    llm, _ = make_llm()
    prompt = _prompts(2, 1)
    t0 = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    t0 = t0[0].token_ids[0]
    llm.engine.worker.controls.apply = lambda logits, slots, num_output: logits
    out = llm.generate(
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=8, stop_token_ids=[t0], min_tokens=3),
        use_tqdm=False,
    )[0]
    assert out.token_ids[0] == t0
    assert len(out.token_ids) >= 3
    assert out.finish_reason == "length" or (out.token_ids[-1] == t0 and len(out.token_ids) >= 3)


def test_min_p_one_is_greedy(make_llm):
    llm, _ = make_llm()
    prompts = _prompts(3, 4)
    greedy = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    min_p = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=10, temperature=1.5, min_p=1.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.token_ids for o in min_p] == [o.token_ids for o in greedy]


def test_allowed_token_ids_keep_every_token_in_the_list(make_llm):
    llm, log = make_llm()
    eos = llm.engine.worker.controls.eos_token_ids
    prompts = _prompts(4, 4)
    allowed = [65, 66, 67, 32]
    params = [
        SamplingParams(max_tokens=10, allowed_token_ids=allowed),  # greedy: EOS not listed, so never
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, allowed_token_ids=allowed),
        SamplingParams(max_tokens=10, temperature=1.0, seed=6, allowed_token_ids=[*allowed, *eos]),
        SamplingParams(max_tokens=10, ignore_eos=True),  # plain, in the same batch
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for out in outs[:2]:
        assert len(out.token_ids) == 10 and set(out.token_ids) <= set(allowed), out.token_ids
    assert set(outs[2].token_ids) <= {*allowed, *eos}
    assert not set(outs[3].token_ids) <= set(allowed)
    rows = log.rows[outs[0].request_id]
    for k, token in enumerate(outs[0].token_ids):
        want = reference_row(rows[len(prompts[0]) + k - 1], params[0], prompts[0], outs[0].token_ids[:k], eos)
        assert int(want.argmax()) == token


def test_bad_words_never_end_the_output_and_follow_the_reference(make_llm):
    """bad_words_token_ids: the plain output's own pairs and single tokens are banned, so each choice
    avoids them (greedy and sampled); every greedy token is the reference's argmax. bad_words text goes
    through the model's tokenizer (the byte model: its UTF-8 bytes) into the same ids."""
    llm, log = make_llm()
    eos = llm.engine.worker.controls.eos_token_ids
    prompts = _prompts(5, 3)
    plain = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    params = []
    for out in plain:
        t = out.token_ids
        # a pair that the plain output writes at 2..3, a single token of it, a 3-token sequence
        banned = [t[2:4], [t[6]], t[8:11]]
        params.append(SamplingParams(max_tokens=12, ignore_eos=True, bad_words_token_ids=banned))
    params.append(SamplingParams(max_tokens=12, temperature=1.0, seed=3, bad_words_token_ids=[[t[0]]]))
    outs = llm.generate(prompt_token_ids=[*prompts, prompts[-1]], sampling_params=params, use_tqdm=False)
    for out, p, prompt in zip(outs, params, [*prompts, prompts[-1]], strict=True):
        got = out.token_ids
        for seq in p.bad_words_token_ids:
            windows = [got[i : i + len(seq)] for i in range(len(got) - len(seq) + 1)]
            assert seq not in windows, (seq, got)
        if p.temperature == 0:
            rows = log.rows[out.request_id]
            for k, token in enumerate(got):
                want = reference_row(rows[len(prompt) + k - 1], p, prompt, got[:k], eos)
                assert int(want.argmax()) == token, (p, k)
    assert all(o.token_ids != q.token_ids for o, q in zip(outs[:3], plain, strict=True))
    # text: encoded with the byte tokenizer, the same ids as bad_words_token_ids
    assert llm.text.bad_words_token_ids(["  ab", "c"]) == [[97, 98], [99]]
    printable = [t for out in plain for t in out.token_ids if 33 <= t < 127]
    assert printable  # the fixed prompts' plain outputs write some ASCII character
    word = chr(printable[0])
    i = next(k for k, out in enumerate(plain) if printable[0] in out.token_ids)
    banned = llm.generate(
        prompt_token_ids=prompts[i : i + 1],
        sampling_params=SamplingParams(max_tokens=12, ignore_eos=True, bad_words=[word]),
        use_tqdm=False,
    )[0]
    assert printable[0] not in banned.token_ids and banned.token_ids != plain[i].token_ids
