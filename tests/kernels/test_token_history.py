"""write_token_ids (raystate.kernels.token_history) against its reference and a literal loop: each id
lands at its row's (slot, position + offset) of the history, failed (negative) ids as 0, nothing else
written; offset 0 (the worker's host-sampled ids) and 1 (the decode graph's, one past the input)."""

import pytest
import torch

from raystate.kernels._common import use_triton
from raystate.kernels.token_history import write_token_ids, write_token_ids_ref


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("num_rows", [1, 5, 64, 300])
def test_matches_reference_and_literal(num_rows, offset):
    dev = _device()
    assert use_triton(torch.empty(1, device=dev))  # the kernel runs, not the reference
    gen = torch.Generator().manual_seed(num_rows)
    num_slots, length = num_rows + 3, 40
    wide = torch.randint(0, 1000, (num_slots, length + 7), generator=gen, dtype=torch.int32)
    history = wide[:, :length]  # rows strided wider than they are long
    slots = torch.randperm(num_slots, generator=gen)[:num_rows]
    positions = torch.randint(0, length - offset, (num_rows,), generator=gen)
    ids = torch.randint(0, 262_000, (num_rows,), generator=gen)
    ids[::4] = -2  # failed rows: stored as 0
    want = history.clone()
    for b in range(num_rows):
        want[slots[b], positions[b] + offset] = max(int(ids[b]), 0)
    ref = history.clone()
    write_token_ids_ref(ref, slots, positions, ids, offset)
    assert torch.equal(ref, want)
    got_wide = wide.clone().to(dev)  # a copy on the CPU too, so the check below compares two buffers
    got = got_wide[:, :length]
    write_token_ids(got, slots.to(dev), positions.to(dev), ids.to(dev), offset)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got_wide[:, length:].cpu(), wide[:, length:])  # the columns past L untouched


def test_no_rows_launches_nothing():
    history = torch.zeros(2, 4, dtype=torch.int32, device=_device())
    empty = torch.zeros(0, dtype=torch.int64, device=_device())
    write_token_ids(history, empty, empty, empty)
    assert not history.any()
