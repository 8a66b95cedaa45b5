"""The model on a CUDA device: compiled Triton kernels, bf16, and the ~1B "bench" config's fast init."""

import random
import time

import pytest
import torch
from paged_harness import PagedHarness, max_rel_err, run_chunked
from test_paged_forward import check_paged_equals_dense, make_sequence

from raystate.model import dense_forward, load_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_paged_forward_on_cuda_matches_dense(dtype, tol):
    model = load_model("tiny", device="cuda", dtype=dtype)
    for block_size in (16, 4):
        check_paged_equals_dense(model, block_size, lengths=[90, 1, 37, 66], max_chunk=20, seed=7, tol=tol)


def test_bench_initialises_fast_on_gpu_and_runs():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = load_model("bench", device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    assert seconds < 30, f"bench init took {seconds:.1f} s"
    assert 0.9e9 < sum(p.numel() for p in model.parameters()) < 1.3e9
    rng = random.Random(8)
    ids = make_sequence(rng, 200)  # 200 > W = 128
    harness = PagedHarness(model, 16, num_blocks=32, max_reqs=1, max_len=200, seed=8)
    harness.add_request(0, ids)
    paged = run_chunked(harness, {0: ids}, rng, max_chunk=64)[0]
    want = dense_forward(model, ids)
    assert torch.isfinite(paged).all()
    assert max_rel_err(paged, want) < 5e-2
