"""gather_lookback (DESIGN section 1) against its reference and a literal per-element loop."""

import pytest
import torch

from raystate.kernels import gather_lookback, gather_lookback_ref

POISON = 12345


def _history(gen: torch.Generator, num_slots: int, length: int, extra_cols: int) -> torch.Tensor:
    """int32 [S, L] token history whose row stride is L + extra_cols (a view into a wider buffer)."""
    wide = torch.randint(0, 50_000, (num_slots, length + extra_cols), generator=gen, dtype=torch.int32)
    return wide[:, :length]


def _literal(idx_mapping, num_computed, history, num_reqs, num_rows, depth) -> list[list[int]]:
    """DESIGN section 1 word for word, one element at a time."""
    rows = [[-1] * depth for _ in range(num_rows)]
    for b in range(num_reqs):
        slot = int(idx_mapping[b])
        start = int(num_computed[slot])
        for k in range(depth):
            if start - 1 - k >= 0:
                rows[b][k] = int(history[slot, start - 1 - k])
    return rows


def _run_both(on_device, lookback, idx_mapping, num_computed, history, num_reqs):
    """Poisons both outputs, runs the launcher on `device` and the reference on CPU; returns both."""
    lookback.fill_(POISON)
    got = on_device(lookback)
    gather_lookback(got, on_device(idx_mapping), on_device(num_computed), on_device(history), num_reqs)
    expected = lookback.clone()
    gather_lookback_ref(expected, idx_mapping, num_computed, history, num_reqs)
    return got.cpu(), expected


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference_and_spec(on_device, seed, idx_dtype):
    gen = torch.Generator().manual_seed(seed)
    for depth in (1, 3, 6):
        num_slots, length, num_rows = 9, 24, 7
        history = _history(gen, num_slots, length, extra_cols=int(torch.randint(0, 9, (1,), generator=gen)))
        # Chunk starts cover 0, below D and deep into the history.
        num_computed = torch.randint(0, length + 1, (num_slots,), generator=gen, dtype=torch.int32)
        num_computed[:3] = torch.tensor([0, 1, depth - 1], dtype=torch.int32).clamp(min=0)
        num_reqs = int(torch.randint(0, num_rows + 1, (1,), generator=gen))
        # Batch rows map to distinct slots in a random order; entries past num_reqs are stale garbage.
        idx_mapping = torch.randperm(num_slots, generator=gen)[:num_rows].to(idx_dtype)
        lookback = torch.empty(num_rows, depth, dtype=torch.int32)
        got, expected = _run_both(on_device, lookback, idx_mapping, num_computed, history, num_reqs)
        assert torch.equal(got, expected)
        assert got.tolist() == _literal(idx_mapping, num_computed, history, num_reqs, num_rows, depth)


def test_empty_batch_resets_every_row(on_device):
    gen = torch.Generator().manual_seed(7)
    history = _history(gen, 4, 10, extra_cols=3)
    num_computed = torch.full((4,), 8, dtype=torch.int32)
    lookback = torch.empty(5, 3, dtype=torch.int32)
    got, expected = _run_both(
        on_device, lookback, torch.arange(4, dtype=torch.int32), num_computed, history, 0
    )
    assert torch.equal(got, torch.full((5, 3), -1, dtype=torch.int32))
    assert torch.equal(got, expected)


def test_chunk_start_zero_one_and_deep(on_device):
    history = torch.arange(100, 140, dtype=torch.int32).view(2, 20)
    num_computed = torch.tensor([0, 2], dtype=torch.int32)
    idx_mapping = torch.tensor([1, 0, 1], dtype=torch.int64)
    lookback = torch.empty(4, 3, dtype=torch.int32)
    got, expected = _run_both(on_device, lookback, idx_mapping, num_computed, history, 2)
    # Row 0: slot 1 starts at 2, so ids at positions 1 and 0 (newest first), then a block.
    # Row 1: slot 0 starts at 0: nothing before it. Rows 2 and 3 lie past num_reqs.
    assert got.tolist() == [[121, 120, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    assert torch.equal(got, expected)

    num_computed = torch.tensor([20, 5], dtype=torch.int32)
    got, expected = _run_both(on_device, lookback, idx_mapping, num_computed, history, 3)
    assert got.tolist() == [[124, 123, 122], [119, 118, 117], [124, 123, 122], [-1, -1, -1]]
    assert torch.equal(got, expected)


@pytest.mark.gpu
def test_no_host_sync():
    history = torch.randint(0, 100, (8, 32), dtype=torch.int32, device="cuda")
    num_computed = torch.randint(0, 33, (8,), dtype=torch.int32, device="cuda")
    idx_mapping = torch.randperm(8, device="cuda").to(torch.int32)
    lookback = torch.empty(16, 4, dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather_lookback(lookback, idx_mapping, num_computed, history, 6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = torch.empty_like(lookback)
    gather_lookback_ref(expected, idx_mapping, num_computed, history, 6)
    assert torch.equal(lookback, expected)


def test_many_rows_span_several_programs(on_device):
    """R * D = 1500 ids over several 256-id programs, with rows cut by program boundaries (256 is no
    multiple of D = 5) and num_reqs ending inside a program: every program's share matches."""
    gen = torch.Generator().manual_seed(11)
    num_slots, length, num_rows, depth = 320, 40, 300, 5
    history = _history(gen, num_slots, length, extra_cols=3)
    num_computed = torch.randint(0, length + 1, (num_slots,), generator=gen, dtype=torch.int32)
    num_computed[:4] = torch.tensor([0, 1, 2, 4], dtype=torch.int32)
    idx_mapping = torch.randperm(num_slots, generator=gen)[:num_rows]
    lookback = torch.empty(num_rows, depth, dtype=torch.int32)
    for num_reqs in (0, 51, 217, num_rows):
        got, expected = _run_both(on_device, lookback, idx_mapping, num_computed, history, num_reqs)
        assert torch.equal(got, expected)
        assert got.tolist() == _literal(idx_mapping, num_computed, history, num_reqs, num_rows, depth)
