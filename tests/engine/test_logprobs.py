"""Logprobs and prompt logprobs: the device function against a per-row reference, and the engine's
values against log_softmax of a cold dense forward (prompt logprobs with a cached prefix they must not
use), on the eager path and the (uncaptured) decode-graph path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystate import LLM, SamplingParams
from raystate.messages import InvalidRequest, pack_logprobs, unpack_logprobs
from raystate.model.reference import dense_forward
from raystate.worker.logprobs import ID_COL, LP_COL, RANK_COL, compute_logprobs, records
from raystate.worker.penalties import LogitControls


def _llm(**kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLM(model="tiny", device="cpu", backend="inprocess", **kw)


def test_device_function_equals_per_row_reference_with_controls():
    torch.manual_seed(0)
    b, v = 6, 300
    raw = torch.randn(b, v) * 3
    controls = LogitControls(b + 1, v, (1,), torch.device("cpu"))
    from raystate.messages import NewRequest

    hist = torch.tensor([5, 6, 7, 7, 9], dtype=torch.int32)
    for slot in (1, 4):  # two rows with controls, the others none
        sp = SamplingParams(repetition_penalty=1.5, logit_bias={3: 5.0}, frequency_penalty=0.5)
        controls.add(slot, NewRequest(f"r{slot}", b"", 3, 0, 0, [], 0, sp), hist)
    slots = torch.arange(b)
    logits = controls.apply(raw, slots, torch.full((b,), 2))
    assert torch.equal(logits[0], raw[0]) and not torch.equal(logits[1], raw[1])
    sampled = torch.tensor([0, 3, 17, 299, 5, -2])  # -2: a failed row
    packed = compute_logprobs(logits, sampled).numpy()
    for i in range(b):
        ref = torch.log_softmax(logits[i].double(), -1)
        tok = max(int(sampled[i]), 0)
        assert packed[i, ID_COL] == int(sampled[i])
        lp = packed[i, LP_COL : LP_COL + 21].view(np.float32)
        assert abs(lp[0] - ref[tok].item()) < 1e-5
        assert packed[i, RANK_COL] == int((ref > ref[tok]).sum()) + 1
        top = torch.topk(ref, 20)
        assert packed[i, ID_COL + 1 : ID_COL + 21].tolist() == top.indices.tolist()
        np.testing.assert_allclose(lp[1:], top.values.numpy(), atol=1e-5)
    # Wire records: k alternatives kept, W = k + 1 entries.
    ids, lps, ranks = unpack_logprobs(records(packed[:2], 3))
    assert ids.shape == (2, 4) and ids[:, 0].tolist() == [0, 3]
    assert ranks.tolist() == packed[:2, RANK_COL].tolist()
    assert unpack_logprobs(pack_logprobs(ids, lps, ranks))[0].tolist() == ids.tolist()


@pytest.mark.parametrize("v", [3 * 4096, 5 * 4096 + 123])  # whole chunks, and a partial last one
def test_device_function_at_a_large_vocabulary_equals_log_softmax(v):
    """Over column chunks (`raystate.kernels.logprob_stats`): the same ids, ranks and values as one
    log_softmax and topk of the whole row, in float64."""
    gen = torch.Generator().manual_seed(v)
    b = 4
    logits = torch.randn(b, v, generator=gen) * 4
    logits[1, v - 5 :] = 30.0 + torch.arange(5.0)  # row 1's top ids all in the tail (or the last chunk)
    logits[2, 100] = float("-inf")
    sampled = torch.tensor([7, v - 1, 100, 4096])
    packed = compute_logprobs(logits, sampled).numpy()
    for i in range(b):
        ref = torch.log_softmax(logits[i].double(), -1)
        tok = int(sampled[i])
        lp = packed[i, LP_COL : LP_COL + 21].view(np.float32)
        assert lp[0] == ref[tok].item() or abs(lp[0] - ref[tok].item()) < 1e-4
        assert packed[i, RANK_COL] == int((ref > ref[tok]).sum()) + 1
        top = torch.topk(ref, 20)
        assert packed[i, ID_COL + 1 : ID_COL + 21].tolist() == top.indices.tolist()
        np.testing.assert_allclose(lp[1:], top.values.numpy(), atol=1e-4)
    assert packed[1, ID_COL + 1] == v - 1 and packed[2, RANK_COL] == v  # -inf ranks last


def test_validation():
    for bad in (-1, 21, 1.5):
        with pytest.raises(InvalidRequest):
            SamplingParams(logprobs=bad).validate(256)
        with pytest.raises(InvalidRequest):
            SamplingParams(prompt_logprobs=bad).validate(256)
    SamplingParams(logprobs=0, prompt_logprobs=20).validate(256)


def _check_output_logprobs(model, prompt, out, k):
    logits = dense_forward(model, prompt + out.token_ids)
    lp = torch.log_softmax(logits.double(), -1)
    assert len(out.logprobs) == len(out.token_ids)
    for j, (tok, d) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = lp[len(prompt) - 1 + j]
        assert abs(d[tok].logprob - row[tok].item()) < 1e-5
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, k).indices.tolist() if k else []
        assert set(d) == {tok, *top}
        for t in top:
            assert abs(d[t].logprob - row[t].item()) < 1e-5


@pytest.mark.parametrize("graph_path", [False, True], ids=["eager", "graph"])
def test_greedy_logprobs_equal_dense_forward(graph_path):
    llm = _llm()
    worker = llm.engine.worker
    if graph_path:
        worker.graphs = worker.new_decode_graphs()  # never captured: replay runs the step eagerly
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, 12 + 5 * i).tolist() for i in range(4)]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=[0, 5, 20, None][i]) for i in range(4)]
    params[3] = SamplingParams(max_tokens=6, ignore_eos=True)  # no logprobs: unaffected
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    model = worker.model
    for prompt, out, sp in zip(prompts[:3], outs[:3], params[:3], strict=True):
        _check_output_logprobs(model, prompt, out, sp.logprobs)
        assert all(isinstance(lp.decoded_token, str) for d in out.logprobs for lp in d.values())
    assert outs[3].logprobs is None
    # The same requests without logprobs sample the same tokens.
    plain = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=[SamplingParams(max_tokens=6, ignore_eos=True)] * 4,
        use_tqdm=False,
    )
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    if graph_path:
        assert worker.graphs.num_eager_steps > 0


@pytest.mark.parametrize("graph_path", [False, True], ids=["eager", "graph"])
def test_logprobs_with_controls_and_sampling(graph_path):
    """Controlled rows: logprobs of the controlled logits (before temperature); sampled rows too."""
    llm = _llm()
    worker = llm.engine.worker
    if graph_path:
        worker.graphs = worker.new_decode_graphs()
    prompt = list(range(40, 60))
    seen = []
    real = worker.controls.apply

    def spy(logits, slots, num_output):
        out = real(logits, slots, num_output)
        seen.append(out.clone())
        return out

    worker.controls.apply = spy
    sp = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={7: 3.0}, logprobs=2)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    # Each step's controlled logits (one row): the token's logprob comes from them.
    for d, tok, logits in zip(out.logprobs, out.token_ids, seen[-4:], strict=True):
        ref = torch.log_softmax(logits[0].double(), -1)
        assert abs(d[tok].logprob - ref[tok].item()) < 1e-5
    worker.controls.apply = real
    sp = SamplingParams(max_tokens=5, temperature=1.3, top_k=5, seed=3, ignore_eos=True, logprobs=1)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
    # Before temperature: log_softmax of the raw logits, whatever was sampled.
    lp = torch.log_softmax(dense_forward(worker.model, prompt + out.token_ids).double(), -1)
    for j, (tok, d) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert abs(d[tok].logprob - lp[len(prompt) - 1 + j, tok].item()) < 1e-5


@pytest.mark.parametrize("budget", [5, 2048])
def test_prompt_logprobs_equal_dense_forward_and_skip_the_prefix_hit(budget):
    llm = _llm(block_size=4, max_num_batched_tokens=budget, swa_bounded_replay=False)
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 256, 24).tolist()
    warm = llm.generate(prompt_token_ids=[prefix + [1, 2, 3]], sampling_params=SamplingParams(max_tokens=2))
    prompt = prefix + rng.integers(0, 256, 9).tolist()
    # The prefix is cached: a request without prompt_logprobs hits it...
    hit = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1))[0]
    assert hit.num_cached_tokens >= 20 and warm[0].finished
    # ...one with prompt_logprobs does not, and gets every prompt position's logprobs.
    sp = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=4, logprobs=1)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    lp = torch.log_softmax(dense_forward(llm.engine.worker.model, prompt).double(), -1)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        d, tok = out.prompt_logprobs[i], prompt[i]
        row = lp[i - 1]
        assert abs(d[tok].logprob - row[tok].item()) < 1e-5
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        assert set(torch.topk(row, 4).indices.tolist()) <= set(d)
    _check_output_logprobs(llm.engine.worker.model, prompt, out, 1)
    # Its blocks were cached for others afterwards.
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens >= 28
    llm.engine.scheduler.check_integrity()


def test_prompt_logprobs_survive_preemption():
    """A request preempted and recomputed sends each prompt position once."""
    llm = _llm(block_size=4, num_blocks=20, max_num_batched_tokens=16, swa_bounded_replay=False)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, 40 + i).tolist() for i in range(5)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    model = llm.engine.worker.model
    for prompt, out in zip(prompts, outs, strict=True):
        lp = torch.log_softmax(dense_forward(model, prompt).double(), -1)
        assert len(out.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[i][prompt[i]].logprob - lp[i - 1, prompt[i]].item()) < 1e-5


def test_prompt_logprobs_chunks_are_cut_to_the_logits_budget(monkeypatch):
    """A request with prompt logprobs takes chunks of at most PROMPT_LOGITS_BYTES of fp32 logits (here
    cut to 16 positions of the tiny vocabulary), and its records stay exact; other requests keep the
    whole token budget."""
    from raystate.scheduler import shard_scheduler

    vocab = 259
    monkeypatch.setattr(shard_scheduler, "PROMPT_LOGITS_BYTES", 16 * 4 * vocab)
    llm = _llm(max_num_batched_tokens=2048)
    sched = llm.engine.scheduler.shards[0]
    assert sched.prompt_logprobs_chunk == 16
    chunks: list[int] = []
    schedule = sched.schedule

    def spy(step_id, lookahead=False):
        msg = schedule(step_id, lookahead)
        if msg is not None:
            chunks.extend(r.num_scheduled for r in msg.new_requests)
            chunks.extend(d.num_scheduled for d in msg.running)
        return msg

    monkeypatch.setattr(sched, "schedule", spy)
    prompt = np.random.default_rng(8).integers(0, 256, 70).tolist()
    sp = SamplingParams(max_tokens=1, prompt_logprobs=2)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
    assert chunks == [16, 16, 16, 16, 6]
    lp = torch.log_softmax(dense_forward(llm.engine.worker.model, prompt).double(), -1)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - lp[i - 1, prompt[i]].item()) < 1e-5
    chunks.clear()
    llm.generate(
        prompt_token_ids=[prompt[::-1]], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert chunks == [70]
