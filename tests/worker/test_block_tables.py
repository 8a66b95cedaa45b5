"""BlockTables.commit: the rows that changed reach the device, the others stay; on a GPU the copy is
queued behind the work in flight rather than waiting for it (async scheduling launches the next step
while the last one runs)."""

from __future__ import annotations

import time

import pytest
import torch

from raystate.worker.block_table import BlockTables


def _tables(device: str) -> BlockTables:
    return BlockTables(
        num_groups=2,
        max_num_reqs=4,
        max_blocks_per_req=6,
        block_size=16,
        max_num_tokens=64,
        device=torch.device(device),
    )


def _expected(tables: BlockTables) -> torch.Tensor:
    want = torch.zeros_like(tables.device_tables, device="cpu")
    want[:, :4] = torch.from_numpy(tables.host)
    return want


def test_commit_copies_the_changed_rows():
    tables = _tables("cpu")
    tables.set_row(1, [[3, 4], [9]])
    tables.set_row(3, [[5], [6, 7, 8]])
    tables.commit()
    assert torch.equal(tables.device_tables, _expected(tables))
    tables.append(1, [[10], []])
    tables.host[0, 3, 0] = 99  # a row not marked dirty is not copied
    tables.commit()
    assert tables.device_tables[0, 1, :3].tolist() == [3, 4, 10]
    assert tables.device_tables[0, 3, 0] == 5
    tables.commit()  # nothing dirty: nothing copied
    assert tables.device_tables[0, 3, 0] == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_commit_does_not_wait_for_the_work_in_flight():
    tables = _tables("cuda")
    # A first commit takes pinned blocks from torch's caching host allocator, whose first cudaHostAlloc of
    # a size synchronizes the device; the decode loop runs on blocks cached by then, as here.
    tables.set_row(2, [[1], [2]])
    tables.commit()
    torch.cuda.synchronize()
    cycles = 200_000_000
    torch.cuda._sleep(cycles)  # what a step in flight is to the stream
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    busy = time.perf_counter() - t0  # how long the host waits when it does wait
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    tables.set_row(2, [[7, 8, 9], [1]])
    tables.commit()
    queued = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert queued < busy / 2, (queued, busy)
    assert torch.equal(tables.device_tables.cpu(), _expected(tables))
