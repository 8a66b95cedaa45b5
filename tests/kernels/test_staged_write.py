"""apply_staged_writes against its reference and a hand-built expectation."""

import pytest
import torch

from raystate.kernels import apply_staged_writes, apply_staged_writes_ref


def _staged(gen: torch.Generator, num_rows: int, num_cols: int, dtype: torch.dtype, max_len: int):
    """Random non-overlapping writes (at most one per row), some running past the row's end."""
    rows = torch.randperm(num_rows, generator=gen)[: int(torch.randint(0, num_rows + 1, (1,), generator=gen))]
    col_starts = torch.randint(0, num_cols, (rows.shape[0],), generator=gen)
    lengths = torch.randint(0, max_len + 1, (rows.shape[0],), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(-1000, 1000, (int(offsets[-1]),), generator=gen).to(dtype)
    return rows.to(torch.int32), col_starts.to(torch.int32), offsets.to(torch.int32), values


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("seed", range(3))
def test_random_writes_match_reference(on_device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    for num_cols, max_len in ((7, 5), (40, 600)):  # the second runs over several blocks of one program
        dst = torch.randint(0, 99, (9, num_cols + 3), generator=gen).to(dtype)[:, :num_cols]
        rows, cols, offsets, values = _staged(gen, 9, num_cols, dtype, max_len)
        got = on_device(dst)
        apply_staged_writes(got, on_device(rows), on_device(cols), on_device(offsets), on_device(values))
        expected = dst.clone()
        apply_staged_writes_ref(expected, rows, cols, offsets, values)
        assert torch.equal(got.cpu(), expected)
        want = dst.clone()
        for k in range(rows.shape[0]):
            for i in range(int(offsets[k]), int(offsets[k + 1])):
                col = int(cols[k]) + i - int(offsets[k])
                if col < num_cols:
                    want[int(rows[k]), col] = values[i]
        assert torch.equal(got.cpu(), want)


def test_no_writes_change_nothing(on_device):
    dst = torch.arange(12, dtype=torch.int32).view(3, 4)
    empty = torch.zeros(0, dtype=torch.int32)
    got = on_device(dst)
    apply_staged_writes(got, empty, empty, on_device(torch.zeros(1, dtype=torch.int32)), empty)
    assert torch.equal(got.cpu(), dst)


@pytest.mark.gpu
def test_no_host_sync():
    dst = torch.zeros(4, 6, dtype=torch.int32, device="cuda")
    rows, cols = (torch.tensor(v, dtype=torch.int32, device="cuda") for v in ([2, 0], [1, 4]))
    offsets = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    values = torch.arange(1, 8, dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_staged_writes(dst, rows, cols, offsets, values)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert dst.cpu().tolist() == [[0, 0, 0, 0, 4, 5], [0] * 6, [0, 1, 2, 3, 0, 0], [0] * 6]
