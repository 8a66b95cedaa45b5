"""The one-pass logprob statistics kernel against its torch reference (logsumexp, compare-and-count,
topk of whole rows), on the shapes that stress its chunking: several chunks, a partial last chunk, a
vocabulary smaller than one chunk, ties, -inf logits and rows with fewer finite logits than k."""

import pytest
import torch

from raystate.kernels.logprob_stats import CHUNK, logprob_stats, logprob_stats_ref


def _check(on_device, logits: torch.Tensor, tok: torch.Tensor, k: int) -> None:
    lse, tok_logit, rank, top, ids = logprob_stats(on_device(logits), on_device(tok), k)
    r_lse, r_tok, r_rank, r_top, r_ids = logprob_stats_ref(logits, tok, k)
    torch.testing.assert_close(lse.cpu(), r_lse, atol=1e-5, rtol=1e-6)
    assert torch.equal(tok_logit.cpu(), r_tok)
    assert torch.equal(rank.cpu(), r_rank)
    assert torch.equal(top.cpu(), r_top)  # the same logits, copied, not recomputed
    # Ids: equal to the reference's where the logits are distinct; for equal logits, the lower ids first.
    ids = ids.cpu()
    assert torch.equal(logits.gather(1, ids), top.cpu())
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    for row in range(logits.shape[0]):
        assert len(set(ids[row].tolist())) == k  # no column twice
        for a, b in zip(ids[row, :-1].tolist(), ids[row, 1:].tolist(), strict=True):
            assert logits[row, a] > logits[row, b] or (logits[row, a] == logits[row, b] and a < b)


@pytest.mark.parametrize("v", [300, 2 * CHUNK, 2 * CHUNK + 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows(on_device, v, dtype):
    gen = torch.Generator().manual_seed(v)
    logits = (torch.randn(3, v, generator=gen) * 4).to(dtype)
    tok = torch.tensor([0, v - 1, v // 2])
    _check(on_device, logits, tok, 20)
    _check(on_device, logits, tok, 1)


def test_ties_infinities_and_short_rows(on_device):
    v = CHUNK + 50
    logits = torch.full((4, v), float("-inf"))
    logits[0] = torch.randn(v, generator=torch.Generator().manual_seed(1))
    logits[0, [7, CHUNK + 3, 900]] = 5.0  # a three-way tie at the top, across chunks
    logits[1, [CHUNK + 10, 3, 4000]] = torch.tensor([1.0, 2.0, 3.0])  # three finite logits, k = 20
    logits[2, :] = 0.0  # every logit equal
    # row 3: all -inf (a failed row's shape): lse -inf, the lowest ids
    tok = torch.tensor([CHUNK + 3, 3, 5, 0])
    _check(on_device, logits, tok, 20)
    lse, _, rank, top, ids = logprob_stats(on_device(logits), on_device(tok), 20)
    assert ids[0, :3].tolist() == [7, 900, CHUNK + 3] and rank[0] == 1
    assert ids[1, :3].tolist() == [4000, 3, CHUNK + 10] and ids[1, 3:].tolist() == [0, 1, 2, *range(4, 18)]
    assert ids[2].tolist() == list(range(20)) and rank[2] == 1
    assert lse[3] == float("-inf") and ids[3].tolist() == list(range(20))


def test_a_nan_row_keeps_valid_ids(on_device):
    """A failed row's logits (NaN) give NaN statistics but ids in range, never the -1 of padding."""
    logits = torch.randn(2, CHUNK + 9, generator=torch.Generator().manual_seed(5))
    logits[1] = float("nan")
    _, _, _, _, ids = logprob_stats(on_device(logits), on_device(torch.tensor([0, 1])), 20)
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
