"""FastLaunch (raystate.kernels._launch): a relaunch through the compiled kernel's launcher computes what
Triton's own dispatch computes, for every signature (dtype, alignment), under CUDA graph capture, and
gives way to Triton's dispatch while a launch hook is registered."""

from __future__ import annotations

import pytest
import torch
import triton

from raystate.kernels import gather_lookback, gather_lookback_ref, pad_replayed_slots, pad_replayed_slots_ref
from raystate.kernels._launch import FastLaunch, fast_launch_enabled
from raystate.kernels.lookback import _gather_lookback_kernel, _launch_gather

pytestmark = pytest.mark.gpu


def _lookback_inputs(gen, rows=64, length=300, depth=3, idx_dtype=torch.int64):
    history = torch.randint(0, 1000, (rows + 1, length), generator=gen, dtype=torch.int32)
    num_computed = torch.randint(0, length + 1, (rows + 1,), generator=gen, dtype=torch.int32)
    idx_mapping = torch.randperm(rows, generator=gen).to(idx_dtype)
    lookback = torch.empty(rows, depth, dtype=torch.int32)
    return [t.cuda() for t in (lookback, idx_mapping, num_computed, history)]


def _check_lookback(lookback, idx_mapping, num_computed, history, num_reqs):
    lookback.fill_(12345)
    gather_lookback(lookback, idx_mapping, num_computed, history, num_reqs)
    expected = torch.empty_like(lookback)
    gather_lookback_ref(expected, idx_mapping, num_computed, history, num_reqs)
    torch.cuda.synchronize()
    assert torch.equal(lookback, expected)


def test_enabled_on_the_verified_triton():
    version = ".".join(triton.__version__.split(".")[:2])
    if version == "3.6":
        assert fast_launch_enabled()


def test_every_signature_matches_the_reference():
    """Fresh inputs each call; an int32 idx_mapping and a view 4 bytes off 16-byte alignment are other
    signatures (Triton specializes pointers on 16-byte alignment): each is compiled through Triton's
    dispatch once and relaunched directly afterwards, and every launch is right."""
    gen = torch.Generator().manual_seed(0)
    for idx_dtype in (torch.int64, torch.int32):
        for _ in range(3):
            lookback, idx_mapping, num_computed, history = _lookback_inputs(gen, idx_dtype=idx_dtype)
            for num_reqs in (0, 17, 64):
                _check_lookback(lookback, idx_mapping, num_computed, history, num_reqs)
    lookback, idx_mapping, num_computed, history = _lookback_inputs(gen, idx_dtype=torch.int32)
    wide = torch.zeros(idx_mapping.numel() + 1, dtype=torch.int32, device="cuda")
    wide[1:] = idx_mapping
    misaligned = wide[1:]
    assert misaligned.data_ptr() % 16 != 0
    _check_lookback(lookback, misaligned, num_computed, history, 40)
    if fast_launch_enabled():
        # Keys: (device, then dtype and 16-byte alignment per pointer, ...): [4] is idx_mapping's alignment.
        aligned_flags = {key[4] for key in _launch_gather._compiled}
        assert aligned_flags == {True, False}


def test_replayed_inside_a_cuda_graph():
    """Captured launches read the tensors' addresses at capture; the replay sees new contents."""
    gen = torch.Generator().manual_seed(1)
    lookback, idx_mapping, num_computed, history = _lookback_inputs(gen)
    gather_lookback(lookback, idx_mapping, num_computed, history, 50)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_lookback(lookback, idx_mapping, num_computed, history, 50)
    for _ in range(3):
        history.copy_(torch.randint(0, 1000, history.shape, generator=gen, dtype=torch.int32))
        num_computed.copy_(torch.randint(0, history.shape[1] + 1, num_computed.shape, generator=gen))
        lookback.fill_(-5)
        graph.replay()
        expected = torch.empty_like(lookback)
        gather_lookback_ref(expected, idx_mapping, num_computed, history, 50)
        torch.cuda.synchronize()
        assert torch.equal(lookback, expected)


def test_a_launch_hook_sends_launches_through_triton():
    gen = torch.Generator().manual_seed(2)
    inputs = _lookback_inputs(gen)
    _check_lookback(*inputs, 33)  # compiled: the next calls would be direct
    seen = []

    def hook(metadata):
        seen.append(metadata)

    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(hook)
    try:
        _check_lookback(*inputs, 33)
    finally:
        hooks.remove(hook)
    assert seen, "the registered launch hook was not called"


def test_pad_replayed_slots_through_fast_launch():
    gen = torch.Generator().manual_seed(3)
    rows, chunk = 6, 20
    positions = torch.cat([torch.arange(100 * b, 100 * b + chunk) for b in range(rows)])
    replay_start = torch.tensor([0, 95, 105, 0, 300, 410], dtype=torch.int32)
    qsl = (torch.arange(rows + 1) * chunk).to(torch.int32)
    initial = torch.randint(0, 1 << 20, (3, rows * chunk + 7), generator=gen, dtype=torch.int64)
    expected = initial.clone()
    groups = torch.tensor([0, 2], dtype=torch.int32)
    pad_replayed_slots_ref(expected, groups, qsl, positions, replay_start, 16)
    for _ in range(2):  # compile, then the direct relaunch
        got = initial.cuda()
        pad_replayed_slots(got, (0, 2), qsl.cuda(), positions.cuda(), replay_start.cuda(), 16)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), expected)


def test_rejects_an_int_parameter_that_picks_a_variant():
    @triton.jit
    def specialized(ptr, n):
        triton.language.store(ptr, n)

    if fast_launch_enabled():
        with pytest.raises(ValueError, match="do_not_specialize"):
            FastLaunch(specialized, pointer_args=(0,))
    assert _gather_lookback_kernel.params  # the kernel FastLaunch wraps keeps its parameter table
