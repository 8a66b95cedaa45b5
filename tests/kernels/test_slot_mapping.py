"""compute_slot_mappings and pad_replayed_slots (DESIGN section 4) against their references and by hand."""

import numpy as np
import pytest
import torch

from raystate.kernels import (
    PAD_SLOT_ID,
    compute_slot_mappings,
    compute_slot_mappings_ref,
    pad_replayed_slots,
    pad_replayed_slots_ref,
)
from raystate.kernels.slot_mapping import cacheable_group_indices


def _batch(chunks: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_start_loc int32 [B + 1], positions int64 [T]) for rows given as (chunk start, chunk length)."""
    lengths = [n for _, n in chunks]
    qsl = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = [torch.arange(start, start + n) for start, n in chunks]
    return qsl, torch.cat(positions).long() if positions else torch.zeros(0, dtype=torch.int64)


def _run_both(on_device, slot_mappings, cacheable, qsl, positions, replay_start, window):
    """Runs the launcher on a device copy and the reference on a CPU copy of the same slot mappings.

    The launcher takes the cacheable groups as host ints (fixed per model), the reference as a tensor.
    """
    got = on_device(slot_mappings)
    args = (qsl, positions, replay_start)
    pad_replayed_slots(got, tuple(cacheable.tolist()), *(on_device(a) for a in args), window)
    expected = slot_mappings.clone()
    pad_replayed_slots_ref(expected, cacheable, *args, window)
    return got.cpu(), expected


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_match_reference(on_device, seed):
    gen = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=gen))

    for _ in range(3):
        num_groups, window = draw(1, 5), draw(1, 20)
        num_rows = draw(1, 9)
        chunks, replay_start = [], []
        for _ in range(num_rows):
            start, length = draw(0, 60), draw(0, 25)
            chunks.append((start, length))
            # A third of the rows replay; their replay start lies before, inside or after the chunk.
            replay_start.append(draw(1, start + length + 5) if draw(0, 3) == 0 else 0)
        qsl, positions = _batch(chunks)
        max_tokens = int(qsl[-1]) + draw(0, 40)  # padded tail: never touched
        slot_mappings = torch.randint(0, 10_000, (num_groups, max_tokens), generator=gen, dtype=torch.int64)
        cacheable = torch.randperm(num_groups, generator=gen)[: draw(0, num_groups + 1)].to(torch.int32)
        rs = torch.tensor(replay_start, dtype=torch.int32)
        got, expected = _run_both(on_device, slot_mappings, cacheable, qsl, positions, rs, window)
        assert torch.equal(got, expected)
        # What may change: only cacheable groups, only replaying rows' tokens, only to PAD_SLOT_ID.
        changed = got != slot_mappings
        window_groups = [g for g in range(num_groups) if g not in cacheable.tolist()]
        assert not changed[window_groups].any()
        assert (got[changed] == PAD_SLOT_ID).all()
        assert not changed[:, int(qsl[-1]) :].any()


def test_straddling_replay_ranges(on_device):
    # P = 8. Row 0: rs = 10 lies in an earlier chunk and rs + P = 18 past this chunk's last token (16).
    # Row 1: no replay. Row 2: the chunk straddles rs + P = 28. Row 3: the chunk starts at rs itself.
    # Row 4: the chunk lies wholly past rs + P. Row 5: an empty chunk.
    chunks = [(14, 3), (30, 4), (25, 6), (40, 10), (70, 3), (5, 0)]
    replay = torch.tensor([10, 0, 20, 40, 50, 3], dtype=torch.int32)
    qsl, positions = _batch(chunks)
    slot_mappings = torch.arange(3 * 30, dtype=torch.int64).view(3, 30)
    cacheable = torch.tensor([2, 0], dtype=torch.int32)
    got, expected = _run_both(on_device, slot_mappings, cacheable, qsl, positions, replay, 8)
    assert torch.equal(got, expected)

    padded = positions.clone().fill_(0).bool()
    padded[0:3] = True  # positions 14..16, all inside [10, 18)
    padded[7:10] = True  # positions 25..27 of row 2; 28..30 write every group
    padded[13:21] = True  # positions 40..47 of row 3; 48, 49 write every group
    want = slot_mappings.clone()
    for g in (0, 2):
        want[g, : positions.shape[0]][padded] = PAD_SLOT_ID
    assert torch.equal(got, want)


def test_empty_batch_and_no_cacheable_group_change_nothing(on_device):
    slot_mappings = torch.arange(2 * 8, dtype=torch.int64).view(2, 8)
    group_0, no_group = torch.tensor([0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    no_rows, one_replaying_row = torch.zeros(0, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    got, _ = _run_both(on_device, slot_mappings, group_0, *_batch([]), no_rows, 4)
    assert torch.equal(got, slot_mappings)
    got, _ = _run_both(on_device, slot_mappings, no_group, *_batch([(3, 5)]), one_replaying_row, 4)
    assert torch.equal(got, slot_mappings)


def test_rows_without_replay_are_untouched(on_device):
    # Positions inside [0, P) of a row with rs = 0 must keep their slots (0 means "no replay").
    qsl, positions = _batch([(0, 6), (2, 4)])
    slot_mappings = torch.arange(12, dtype=torch.int64).view(1, 12)
    group_0, no_replay = torch.tensor([0], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    got, expected = _run_both(on_device, slot_mappings, group_0, qsl, positions, no_replay, 16)
    assert torch.equal(got, slot_mappings)
    assert torch.equal(expected, slot_mappings)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(3))
def test_slot_mappings_from_block_tables(on_device, seed, idx_dtype):
    gen = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=gen))

    for _ in range(3):
        num_groups, num_slots, max_blocks, block_size = draw(1, 4), 6, 8, draw(1, 6)
        block_tables = torch.randint(
            0, 500, (num_groups, num_slots, max_blocks), generator=gen, dtype=torch.int32
        )
        num_rows = draw(0, num_slots + 1)
        chunks = []
        for _ in range(num_rows):
            start = draw(0, max_blocks * block_size)
            chunks.append((start, draw(0, max_blocks * block_size - start + 1)))
        qsl, positions = _batch(chunks)
        idx_mapping = torch.randperm(num_slots, generator=gen)[: num_rows + 1].to(idx_dtype)
        max_tokens = int(qsl[-1]) + draw(0, 9)
        slot_mappings = torch.randint(0, 9, (num_groups, max_tokens), generator=gen, dtype=torch.int64)

        got = on_device(slot_mappings)
        args = (block_tables, idx_mapping, qsl, positions)
        compute_slot_mappings(*(on_device(a) for a in args), block_size, got)
        expected = slot_mappings.clone()
        compute_slot_mappings_ref(*args, block_size, expected)
        assert torch.equal(got.cpu(), expected)
        want = torch.full_like(slot_mappings, PAD_SLOT_ID)
        for b, (start, length) in enumerate(chunks):
            for j in range(length):
                pos = start + j
                table = block_tables[:, int(idx_mapping[b]), pos // block_size].long()
                want[:, int(qsl[b]) + j] = table * block_size + pos % block_size
        assert torch.equal(got.cpu(), want)


def test_many_rows_and_long_rows_span_token_blocks(on_device):
    """Hundreds of rows over several 256-token programs: one row longer than a program, rows cut by
    program boundaries, empty rows (also first and last) and a padded tail. Each token finds its row by
    binary search, so this covers searches over a non-power-of-two row count."""
    gen = torch.Generator().manual_seed(3)
    chunks = [(0, 0), (5, 600)]  # an empty first row, then one row spanning three programs
    for _ in range(330):
        kind = int(torch.randint(0, 10, (1,), generator=gen))
        start = int(torch.randint(0, 200, (1,), generator=gen))
        chunks.append(
            (start, 0 if kind == 0 else 1 if kind < 7 else int(torch.randint(2, 40, (1,), generator=gen)))
        )
    chunks.append((9, 0))  # an empty last row
    qsl, positions = _batch(chunks)
    num_rows, num_tokens = len(chunks), int(qsl[-1])
    max_tokens = num_tokens + 77
    assert max_tokens > 4 * 256

    num_groups, num_slots, max_blocks, block_size = 3, num_rows + 5, 64, 16
    block_tables = torch.randint(
        0, 5000, (num_groups, num_slots, max_blocks), generator=gen, dtype=torch.int32
    )
    idx_mapping = torch.randperm(num_slots, generator=gen)[:num_rows]
    got = on_device(torch.randint(0, 9, (num_groups, max_tokens), generator=gen, dtype=torch.int64))
    args = (block_tables, idx_mapping, qsl, positions)
    compute_slot_mappings(*(on_device(a) for a in args), block_size, got)
    expected = torch.empty(num_groups, max_tokens, dtype=torch.int64)
    compute_slot_mappings_ref(*args, block_size, expected)
    assert torch.equal(got.cpu(), expected)

    # Every other row replays from somewhere around its chunk; groups 0 and 2 are cacheable.
    replay_start = torch.tensor(
        [max(1, start - 3) if b % 2 else 0 for b, (start, _) in enumerate(chunks)], dtype=torch.int32
    )
    before = expected
    got, expected = _run_both(
        on_device, before, torch.tensor([0, 2], dtype=torch.int32), qsl, positions, replay_start, 6
    )
    assert torch.equal(got, expected)
    changed = got != before
    assert changed[[0, 2]].sum() > 100 and not changed[1].any()  # many tokens padded, window group kept


@pytest.mark.gpu
def test_no_host_sync():
    qsl, positions = _batch([(14, 3), (30, 4), (25, 6)])
    block_tables = torch.randint(0, 100, (2, 4, 12), dtype=torch.int32, device="cuda")
    idx_mapping = torch.tensor([3, 0, 2], dtype=torch.int32, device="cuda")
    replay_start = torch.tensor([10, 0, 20], dtype=torch.int32, device="cuda")
    qsl, positions = qsl.cuda(), positions.cuda()
    got = torch.zeros(2, 16, dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        compute_slot_mappings(block_tables, idx_mapping, qsl, positions, 4, got)
        pad_replayed_slots(got, (1,), qsl, positions, replay_start, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = torch.zeros(2, 16, dtype=torch.int64)
    cpu = [t.cpu() for t in (block_tables, idx_mapping, qsl, positions, replay_start)]
    compute_slot_mappings_ref(*cpu[:4], 4, expected)
    pad_replayed_slots_ref(expected, torch.tensor([1], dtype=torch.int32), cpu[2], cpu[3], cpu[4], 8)
    assert torch.equal(got.cpu(), expected)


# -- the forms of cacheable_groups ---------------------------------------------------------------------------


def _replay_batch():
    """Four groups; rows 0 and 2 replay (P = 6), rows 1 and 3 do not; a padded tail of 5 columns."""
    chunks = [(10, 7), (0, 4), (30, 9), (3, 3)]
    qsl, positions = _batch(chunks)
    replay_start = torch.tensor([8, 0, 33, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(11)
    slot_mappings = torch.randint(0, 10_000, (4, int(qsl[-1]) + 5), generator=gen, dtype=torch.int64)
    return slot_mappings, qsl, positions, replay_start, 6


# Each form names groups {0, 2} (or {1} for the single-entry ones, a lone tensor([1]) used to be read as
# the truth value True and [0] as False, which skipped the launch), in any order and with repeats.
_FORMS = {
    "tuple": ((2, 0), [0, 2]),
    "list": ([0, 2, 2], [0, 2]),
    "numpy_ints": ([np.int64(2), np.int32(0)], [0, 2]),
    "tuple_one": ((1,), [1]),
    "empty_tuple": ((), []),
    "int32_tensor": (torch.tensor([2, 0], dtype=torch.int32), [0, 2]),
    "int64_tensor": (torch.tensor([0, 2, 0], dtype=torch.int64), [0, 2]),
    "one_int_tensor_0": (torch.tensor([0], dtype=torch.int32), [0]),
    "one_int_tensor_1": (torch.tensor([1], dtype=torch.int64), [1]),
    "empty_int_tensor": (torch.zeros(0, dtype=torch.int32), []),
    "bool_mask": (torch.tensor([True, False, True, False]), [0, 2]),
    "bool_mask_one": (torch.tensor([False, True, False, False]), [1]),
    "bool_mask_none": (torch.zeros(4, dtype=torch.bool), []),
}


def _copy_form(form, copy):
    return copy(form) if isinstance(form, torch.Tensor) else form


@pytest.mark.parametrize("name", list(_FORMS))
def test_every_form_of_cacheable_groups_pads_the_same(on_device, name, monkeypatch):
    """Host ints, index tensors and bool masks pad the same groups on the Triton path (tensors also on the
    device), on the reference, and on the launcher's reference branch (RAYSTATE_KERNELS=reference)."""
    form, groups = _FORMS[name]
    slot_mappings, qsl, positions, replay_start, window = _replay_batch()
    expected = slot_mappings.clone()
    pad_replayed_slots_ref(
        expected, torch.tensor(groups, dtype=torch.int32), qsl, positions, replay_start, window
    )
    if groups:
        assert not torch.equal(expected, slot_mappings)  # the batch does pad something
    args = (qsl, positions, replay_start)

    got = on_device(slot_mappings)
    pad_replayed_slots(got, _copy_form(form, on_device), *(on_device(a) for a in args), window)
    assert torch.equal(got.cpu(), expected)

    ref = slot_mappings.clone()
    pad_replayed_slots_ref(ref, form, *args, window)
    assert torch.equal(ref, expected)

    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    forced = slot_mappings.clone()
    pad_replayed_slots(forced, form, *args, window)
    assert torch.equal(forced, expected)


@pytest.mark.parametrize(
    ("form", "error", "match"),
    [
        (None, TypeError, "got NoneType"),
        (1, TypeError, "got int"),
        ({0, 2}, TypeError, "got set"),
        (np.array([0, 2]), TypeError, "got ndarray"),
        ((True, False), TypeError, "got bool"),
        ([0, 1.0], TypeError, "got float"),
        (("0",), TypeError, "got str"),
        ((torch.tensor(0),), TypeError, "got Tensor"),
        (torch.tensor([0.0, 2.0]), TypeError, "torch.float32"),
        ((0, 4), IndexError, "4 outside"),
        ([-1], IndexError, "-1 outside"),
        (torch.tensor([0, 9]), IndexError, "9 outside"),
        (torch.tensor([True, False]), ValueError, "one entry per group"),
        (torch.tensor([[0, 2]]), ValueError, "1-D"),
    ],
)
def test_bad_cacheable_groups_are_rejected_on_every_path(on_device, form, error, match, monkeypatch):
    """Any other type is a TypeError and an index outside [0, G) an IndexError, both naming the argument,
    raised before anything is written (a negative index would wrap in the reference and write before the
    buffer in the kernel)."""
    slot_mappings, qsl, positions, replay_start, window = _replay_batch()
    args = (qsl, positions, replay_start)
    got = on_device(slot_mappings)
    with pytest.raises(error, match=f"cacheable_groups.*{match}"):
        pad_replayed_slots(got, _copy_form(form, on_device), *(on_device(a) for a in args), window)
    assert torch.equal(got.cpu(), slot_mappings)
    ref = slot_mappings.clone()
    with pytest.raises(error, match=f"cacheable_groups.*{match}"):
        pad_replayed_slots_ref(ref, form, *args, window)
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)
    with pytest.raises(error, match=f"cacheable_groups.*{match}"):
        pad_replayed_slots(ref, form, *args, window)
    assert torch.equal(ref, slot_mappings)


def test_checked_tuples_are_cached_by_identity():
    """A checked tuple is cached, but only for itself: an equal tuple of bools or floats is still refused,
    and a tuple checked against G groups is checked again against fewer."""
    groups = (1, 3)
    assert cacheable_group_indices(groups, 4) == (1, 3)
    assert cacheable_group_indices(groups, 4) == (1, 3)  # the cached answer
    with pytest.raises(TypeError, match="cacheable_groups"):
        cacheable_group_indices((True,), 4)  # == (1,), which may be cached
    cacheable_group_indices((1,), 4)
    with pytest.raises(TypeError, match="cacheable_groups"):
        cacheable_group_indices((True,), 4)
    with pytest.raises(IndexError, match="3 outside"):
        cacheable_group_indices(groups, 3)


@pytest.mark.gpu
def test_every_form_through_the_compiled_kernel_and_fast_launch():
    """On CUDA every form reaches the compiled kernel (the second launch of a signature through FastLaunch)
    as the same constexpr groups; a host tuple needs no sync."""
    slot_mappings, qsl, positions, replay_start, window = _replay_batch()
    args = [t.cuda() for t in (qsl, positions, replay_start)]
    for form, groups in _FORMS.values():
        expected = slot_mappings.clone()
        pad_replayed_slots_ref(expected, list(groups), qsl, positions, replay_start, window)
        for _ in range(2):  # compile, then the direct relaunch
            got = slot_mappings.cuda()
            pad_replayed_slots(got, _copy_form(form, lambda t: t.cuda()), *args, window)
            assert torch.equal(got.cpu(), expected)
    got = slot_mappings.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pad_replayed_slots(got, (2, 0), *args, window)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = slot_mappings.clone()
    pad_replayed_slots_ref(expected, (0, 2), qsl, positions, replay_start, window)
    assert torch.equal(got.cpu(), expected)
