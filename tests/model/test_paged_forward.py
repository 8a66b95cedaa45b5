"""The paged, chunked forward equals the dense cold forward, whatever the chunking, batching and blocks."""

import random

import pytest
import torch
from paged_harness import PagedHarness, max_rel_err, run_chunked

from raystate.config import BOS_ID
from raystate.model import dense_forward

TEXT_BYTES = list(b"the cat sat on The Mat. a an and")  # a small alphabet: n-grams repeat


def make_sequence(rng: random.Random, length: int) -> list[int]:
    return [BOS_ID] + [rng.choice(TEXT_BYTES) for _ in range(length - 1)]


def check_paged_equals_dense(
    model, block_size: int, lengths: list[int], max_chunk: int, seed: int, tol: float = 1e-5
) -> None:
    rng = random.Random(seed)
    harness = PagedHarness(
        model,
        block_size,
        num_blocks=1 + sum(-(-n // block_size) for n in lengths) + 3,
        max_reqs=len(lengths) + 2,
        max_len=max(lengths),
        seed=seed,
    )
    # State slots deliberately not 0..B-1, so batch rows and slots differ.
    slots = rng.sample(range(len(lengths) + 2), len(lengths))
    sequences = {s: make_sequence(rng, n) for s, n in zip(slots, lengths, strict=True)}
    for s, ids in sequences.items():
        harness.add_request(s, ids)
    paged = run_chunked(harness, sequences, rng, max_chunk)
    for s, ids in sequences.items():
        want = dense_forward(model, ids)
        assert paged[s].shape == want.shape
        assert max_rel_err(paged[s], want) < tol, f"slot {s}: {max_rel_err(paged[s], want)}"


def test_paged_forward_matches_dense_on_default_kernels(tiny_model):
    """Runs whatever the launchers pick: Triton's interpreter on a CPU-only CI (TRITON_INTERPRET=1)."""
    # 40 > W = 32: the window slides; block size 4: chunks cross many block boundaries.
    check_paged_equals_dense(tiny_model, block_size=4, lengths=[40, 9, 23], max_chunk=9, seed=1)


def test_paged_forward_with_split_k_projections_matches_dense(tiny_model, monkeypatch):
    """Every o projection as 2 split-K partial sums, summed by the norm after it (forced here: the GPU's
    decode steps choose it for narrow projections): the same logits, through the default kernels."""
    from raystate.model import layers

    monkeypatch.setattr(layers, "splits_for", lambda x, weight: 2)
    check_paged_equals_dense(tiny_model, block_size=4, lengths=[40, 9], max_chunk=9, seed=5)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("seed", [2, 3])
def test_paged_forward_matches_dense_any_chunking(tiny_model, monkeypatch, block_size, seed):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    check_paged_equals_dense(tiny_model, block_size, lengths=[90, 1, 37, 66], max_chunk=20, seed=seed)


def test_decode_steps_match_dense(tiny_model, monkeypatch):
    """A prefill chunk then one token per step, the way generation runs, batched with another request."""
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    rng = random.Random(4)
    a, b = make_sequence(rng, 50), make_sequence(rng, 45)
    harness = PagedHarness(tiny_model, 16, num_blocks=16, max_reqs=2, max_len=50, seed=4)
    harness.add_request(0, a)
    harness.add_request(1, b)
    out_a, out_b = harness.step([(0, 30), (1, 40)])
    chunks_a, chunks_b = [out_a], [out_b]
    for _ in range(5):
        la, lb = harness.step([(1, 1), (0, 1)])[::-1]
        chunks_a.append(la)
        chunks_b.append(lb)
    assert max_rel_err(torch.cat(chunks_a), dense_forward(tiny_model, a)[:35]) < 1e-5
    assert max_rel_err(torch.cat(chunks_b), dense_forward(tiny_model, b)) < 1e-5


def test_engram_lookback_is_exercised(tiny_model, monkeypatch):
    """Negative control: with the lookback all -1, logits change at a later chunk's start but not in the
    first chunk (whose true lookback is all -1 anyway). So the paged test above really checks it."""
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    rng = random.Random(5)
    ids = make_sequence(rng, 30)
    want = dense_forward(tiny_model, ids)
    results = {}
    for blind in (False, True):
        harness = PagedHarness(tiny_model, 4, num_blocks=12, max_reqs=1, max_len=30, seed=5)
        harness.add_request(0, ids)
        override = torch.full_like(harness.lookback, -1) if blind else None
        first = harness.step([(0, 12)], lookback_override=override)[0]
        second = harness.step([(0, 18)], lookback_override=override)[0]
        results[blind] = (first, second)
    (first, second), (blind_first, blind_second) = results[False], results[True]
    assert torch.equal(blind_first, first)
    assert max_rel_err(torch.cat([first, second]), want) < 1e-5
    assert max_rel_err(blind_second[:1], want[12:13]) > 1e-3  # the chunk start's n-grams were cut
