"""The checked greedy argmax (raystate.kernels.greedy) against torch.max: ids, ties to the lowest id,
failed rows (NaN, +inf, all -inf), bf16 and fp32 logits, several column chunks; and the decode graph's
plain variant, which reads it from the head's output in the model's dtype."""

import pytest
import torch

from raystate.kernels import _pdl, greedy
from raystate.kernels._common import use_triton

FAILED = -2


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 columns, so a few hundred columns span several (the interpreter stays fast)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(greedy, "CHUNK", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 63, 300, 1000])
def test_matches_torch_max(small_chunks, dtype, vocab):
    assert use_triton(torch.empty(1, device=_device()))  # the kernel runs, not the reference
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen).to(dtype)
    if vocab > 1:
        # Ties: row 1's max at two columns in different chunks, row 2's at two columns of one chunk.
        logits[1, vocab // 3] = logits[1, vocab - 1] = 9.0
        logits[2, 0] = logits[2, 1] = 9.0
        logits[3, vocab - 1] = 50.0  # the max in the last, partial chunk
        logits[4, :] = float("-inf")
        logits[4, vocab // 2] = -3.0  # one finite logit among -inf
    logits = logits.to(_device())
    got = greedy.greedy_checked(logits, FAILED)
    want = greedy.greedy_checked_ref(logits, FAILED)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert (want != FAILED).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_rows_fail_alone(small_chunks, dtype):
    vocab = 200
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 150] = float("nan")  # NaN away from the max
    logits[1, 3] = float("inf")
    logits[2, :] = float("-inf")
    logits[3, 10] = float("nan")
    logits[3, 11] = float("inf")
    logits[4, 199] = 1e4  # a large finite logit is fine
    logits = logits.to(_device())
    got = greedy.greedy_checked(logits, FAILED).tolist()
    assert got[:4] == [FAILED] * 4
    assert got[4] == 199
    assert got[5] == int(torch.argmax(logits[5].float()))
    assert got == greedy.greedy_checked_ref(logits, FAILED).tolist()


def test_empty_batch():
    out = greedy.greedy_checked(torch.zeros(0, 50, device=_device()), FAILED)
    assert out.shape == (0,) and out.dtype == torch.int64


def test_pdl_off_the_gpu():
    """Off Hopper (here: the interpreter or the CPU) kernels are launched plainly, whatever the switch."""
    cpu = torch.zeros(1)
    previous = _pdl.set_enabled(True)
    try:
        assert not _pdl.use_pdl(cpu)
        _pdl.set_enabled(False)
        assert not _pdl.use_pdl(cpu)
        if torch.cuda.is_available():
            assert not _pdl.use_pdl(torch.zeros(1, device="cuda"))
    finally:
        _pdl.set_enabled(previous)
    assert _pdl.launch_options(False) == {}
    assert _pdl.launch_options(True) == {"launch_pdl": True}
