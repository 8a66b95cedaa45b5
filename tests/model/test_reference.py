"""The dense oracles: replay_reference's sanity, and the paged forward after a prefix hit equals it."""

import random

import pytest
import torch
from paged_harness import PagedHarness, max_rel_err, run_chunked
from test_paged_forward import make_sequence

from raystate.model import dense_forward, replay_reference


def test_replay_from_zero_is_the_cold_forward(tiny_model):
    ids = make_sequence(random.Random(0), 45)
    assert torch.equal(replay_reference(tiny_model, ids, 0, 0, None), dense_forward(tiny_model, ids))


def test_dense_forward_kv_is_causal(tiny_model):
    """K/V of a prefix do not depend on what follows: what makes a cold run's cache shareable."""
    rng = random.Random(1)
    prefix = make_sequence(rng, 30)
    _, kv_a = dense_forward(tiny_model, prefix + make_sequence(rng, 10)[1:], return_kv=True)
    _, kv_b = dense_forward(tiny_model, prefix + make_sequence(rng, 20)[1:], return_kv=True)
    for (ka, va), (kb, vb) in zip(kv_a, kv_b, strict=True):
        assert max_rel_err(ka[:30], kb[:30]) < 1e-6 and max_rel_err(va[:30], vb[:30]) < 1e-6


def test_truncated_replay_differs_from_the_cold_run(tiny_model):
    """Replay is an approximation by design: sliding layers lose the keys below replay_start."""
    rng = random.Random(2)
    ids = make_sequence(rng, 70)
    cold_logits, cold_kv = dense_forward(tiny_model, ids, return_kv=True)
    hit, start = 48, 16
    replay = replay_reference(tiny_model, ids, hit, start, cold_kv)
    assert replay.shape == (70 - start, tiny_model.config.vocab_size)
    assert max_rel_err(replay[:1], cold_logits[start : start + 1]) > 1e-3
    # The suffix after the hit need not come from the cold run: only the shared prefix's K/V is read.
    other = ids[:hit] + make_sequence(rng, 30)[1:]
    _, other_kv = dense_forward(tiny_model, other, return_kv=True)
    assert max_rel_err(replay_reference(tiny_model, ids, hit, start, other_kv), replay) < 1e-6


def test_replay_reference_rejects_bad_arguments(tiny_model):
    ids = make_sequence(random.Random(3), 20)
    with pytest.raises(ValueError, match="replay_start"):
        replay_reference(tiny_model, ids, 4, 8, None)
    with pytest.raises(ValueError, match="cold_kv"):
        replay_reference(tiny_model, ids, 8, 4, None)


@pytest.mark.parametrize(
    "block_size,hit_tokens,kernels",
    [(16, 48, "auto"), (4, 40, "reference")],  # "auto": Triton's interpreter on a CPU-only CI
)
def test_paged_prefix_hit_with_bounded_replay_equals_replay_reference(
    tiny_model, monkeypatch, block_size, hit_tokens, kernels
):
    """DESIGN section 4 end to end at the model level: a cold request fills the full group's blocks; a second
    request shares its first hit_tokens blocks, replays from hit - W with padded full-group slots and a
    sliding key floor, batched with a cold request (replay start 0) in the same steps."""
    monkeypatch.setenv("RAYSTATE_KERNELS", kernels)
    monkeypatch.setattr(
        "raystate.kernels._common._reference_forced", kernels == "reference"
    )  # read once per process
    rng = random.Random(block_size)
    cold_ids = make_sequence(rng, 56)
    hit_ids = cold_ids[:hit_tokens] + make_sequence(rng, 72 - hit_tokens + 1)[1:]
    other_ids = make_sequence(rng, 24)
    harness = PagedHarness(
        tiny_model,
        block_size,
        num_blocks=1 + 3 * (-(-72 // block_size)),
        max_reqs=3,
        max_len=72,
        seed=block_size,
    )
    harness.add_request(2, cold_ids)
    run_chunked(harness, {2: cold_ids}, rng, max_chunk=16)
    cached = [t.clone() for pair in harness.kv_caches for t in pair]
    start = harness.add_request(0, hit_ids, hit_from=2, hit_tokens=hit_tokens)
    harness.add_request(1, other_ids)
    assert start == hit_tokens - tiny_model.config.sliding_window
    paged = run_chunked(harness, {0: hit_ids, 1: other_ids}, rng, max_chunk=16, starts={0: start})
    _, cold_kv = dense_forward(tiny_model, cold_ids, return_kv=True)
    want = replay_reference(tiny_model, hit_ids, hit_tokens, start, cold_kv)
    assert max_rel_err(paged[0], want) < 1e-5
    assert max_rel_err(paged[1], dense_forward(tiny_model, other_ids)) < 1e-5
    # The shared blocks' KV stayed bit for bit (the replayed tokens' writes were skipped).
    shared = harness.requests[2].blocks["full"][: hit_tokens // block_size]
    full_layers = [i for i, t in enumerate(tiny_model.config.layer_types) if t == "full"]
    for layer in full_layers:
        for j in range(2):
            assert torch.equal(harness.kv_caches[layer][j][shared], cached[2 * layer + j][shared])
