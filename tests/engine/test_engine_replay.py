"""SWA bounded replay end to end (DESIGN sections 3 and 4) on the in-process engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystate import SamplingParams
from raystate.model.reference import dense_forward, replay_reference

W = 32  # the tiny model's sliding window
BLOCK = 16


def _prompts(prefix_len: int, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 256, prefix_len).tolist()
    return prefix + rng.integers(0, 256, 12).tolist(), prefix + rng.integers(0, 256, 17).tolist()


def _full_group_blocks(llm, req_id: str) -> list[int]:
    worker = llm.engine.worker
    g = [s.name for s in worker.groups].index("full")
    slot = worker.states.slot_of[req_id]
    return worker.block_tables.host[g, slot, : worker.block_tables.num_blocks[g, slot]].tolist()


@pytest.mark.parametrize("prefix_len", [100, 70])
def test_hit_replays_from_h_minus_w_and_matches_truncated_reference(make_llm, prefix_len):
    cold, hit = _prompts(prefix_len, seed=prefix_len)
    llm, log = make_llm(block_size=BLOCK, max_num_batched_tokens=40)
    worker = llm.engine.worker
    model = worker.model
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = llm.generate(prompt_token_ids=cold, sampling_params=params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and first.replay_start == 0

    h = (prefix_len // BLOCK) * BLOCK
    full_layers = [i for i, t in enumerate(model.config.layer_types) if t == "full"]
    sliding_layers = [i for i, t in enumerate(model.config.layer_types) if t == "sliding"]
    before = {i: worker.kv_caches[i][0].clone() for i in full_layers}
    before_v = {i: worker.kv_caches[i][1].clone() for i in full_layers}
    # Poison every sliding-window slot: the hit request must read none of them below replay_start.
    for i in sliding_layers:
        worker.kv_caches[i][0].fill_(float("nan"))
        worker.kv_caches[i][1].fill_(float("nan"))
    seen_blocks: dict[str, list[int]] = {}
    recorder = log

    def record(req_id, start, logits):
        seen_blocks.setdefault(req_id, _full_group_blocks(llm, req_id))
        recorder(req_id, start, logits)

    worker.logit_recorder = record
    second = llm.generate(prompt_token_ids=hit, sampling_params=params, use_tqdm=False)[0]

    assert second.num_cached_tokens == h
    assert second.replay_start == h - W
    rs = second.replay_start
    seq = hit + second.token_ids[:-1]
    _, cold_kv = dense_forward(model, cold + first.token_ids, return_kv=True)
    want = replay_reference(model, seq, h, rs, cold_kv)
    got = log.stacked(second.request_id, rs, len(seq))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert second.token_ids == want[len(hit) - 1 - rs :].argmax(-1).tolist()
    # The full-attention KV of the hit blocks is bit-for-bit what the cold run cached.
    shared = seen_blocks[second.request_id][: h // BLOCK]
    for i in full_layers:
        assert torch.equal(worker.kv_caches[i][0][shared], before[i][shared])
        assert torch.equal(worker.kv_caches[i][1][shared], before_v[i][shared])
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("prefix_len", [40, 20])
def test_hit_of_at_most_w_is_dropped(make_llm, prefix_len):
    cold, hit = _prompts(prefix_len, seed=1 + prefix_len)
    llm, _ = make_llm(block_size=BLOCK)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate(prompt_token_ids=cold, sampling_params=params, use_tqdm=False)
    second = llm.generate(prompt_token_ids=hit, sampling_params=params, use_tqdm=False)[0]
    assert (prefix_len // BLOCK) * BLOCK <= W
    assert second.num_cached_tokens == 0 and second.replay_start == 0
    # Dropped hit: recomputed from 0, so it equals a cold run exactly.
    model = llm.engine.worker.model
    seq = hit + second.token_ids[:-1]
    assert second.token_ids == dense_forward(model, seq)[len(hit) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("share_replay", [True, False])
def test_burst_of_hits_matches_truncated_reference(make_llm, share_replay):
    """Three requests hit one cached prefix in the same step. With shared replay the first rebuilds the
    window over [h - W, h) and the others read it (they start at h); without, each replays. Either way
    every request's logits equal DESIGN 4's truncated-replay reference, with every window slot poisoned
    before the burst, so a read of anything the step did not write shows up as NaN."""
    prefix_len = 100
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 256, prefix_len).tolist()
    cold = prefix + rng.integers(0, 256, 9).tolist()
    burst = [prefix + rng.integers(0, 256, 5 + 4 * i).tolist() for i in range(3)]
    llm, log = make_llm(block_size=BLOCK, max_num_batched_tokens=256, share_replay=share_replay)
    worker = llm.engine.worker
    model = worker.model
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llm.generate(prompt_token_ids=cold, sampling_params=params, use_tqdm=False)[0]
    for i, t in enumerate(model.config.layer_types):
        if t == "sliding":
            worker.kv_caches[i][0].fill_(float("nan"))
            worker.kv_caches[i][1].fill_(float("nan"))
    before = llm.engine.scheduler.stats()
    outs = llm.generate(prompt_token_ids=burst, sampling_params=params, use_tqdm=False)

    h = (prefix_len // BLOCK) * BLOCK
    _, cold_kv = dense_forward(model, cold + first.token_ids, return_kv=True)
    for prompt, out in zip(burst, outs, strict=True):
        assert (out.num_cached_tokens, out.replay_start) == (h, h - W)
        seq = prompt + out.token_ids[:-1]
        want = replay_reference(model, seq, h, h - W, cold_kv)  # positions [h - W, len(seq))
        got = log.stacked(out.request_id, len(prompt) - 1, len(seq))
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want[len(prompt) - 1 - (h - W) :], rtol=1e-5, atol=1e-5)
        assert out.token_ids == want[len(prompt) - 1 - (h - W) :].argmax(-1).tolist()
    after = llm.engine.scheduler.stats()
    shared = after.shared_replay_tokens - before.shared_replay_tokens
    replayed = after.replayed_tokens - before.replayed_tokens
    assert (replayed, shared) == ((W, 2 * W) if share_replay else (3 * W, 0))
    llm.engine.scheduler.check_integrity()
