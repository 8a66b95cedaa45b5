"""Split-KV decode attention: the split kernel and its reduction against paged_attention_ref.

Under the interpreter the shapes stay small, so the splits are forced: through an explicit launch
(`AttentionLaunch(kv_splits=...)`) or by making the launch policy believe the GPU has a few
multiprocessors (`device_shape` patched), with small `split_min_keys` so short rows still cover several
splits. Every test checks that the split path really ran (and with how many splits). The cache is
NaN-poisoned outside what each row may read (see test_attention.PagedBatch), so a split reading past its
span, below a floor or outside a window shows up as a non-finite output.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_attention import FP32_TOL, HALF_TOL, PagedBatch, assert_matches_reference, gen

from raystate.kernels import attention, attention_launch
from raystate.kernels.attention_launch import (
    SPLIT_MIN_KEYS,
    SPLIT_PROGRAMS_PER_SM,
    AttentionLaunch,
    decode_kv_splits,
    plan_launch,
)


@pytest.fixture
def split_calls(monkeypatch) -> list[int]:
    """The split counts of every split-path launch in the test (the split path's host function, spied)."""
    calls: list[int] = []
    original = attention._split_attention

    def spy(args, plan, *rest):
        calls.append(plan.kv_splits)
        return original(args, plan, *rest)

    monkeypatch.setattr(attention, "_split_attention", spy)
    return calls


def split_launch(splits: int, block_n: int = 16, min_keys: int = 16, stages: int = 2) -> AttentionLaunch:
    return AttentionLaunch(
        block_n=block_n, num_stages=stages, row_programs=True, kv_splits=splits, split_min_keys=min_keys
    )


def tol_for(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else HALF_TOL[dtype]


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batches(splits, dtype, device, split_calls):
    """Batches of 1..8 decode rows, from 1 key to several splits' worth (and rows with empty splits)."""
    for num_rows in (1, 3, 8):
        seq_lens = [1, 17, 130, 64, 2, 95, 33, 160][:num_rows]
        batch = PagedBatch(
            device,
            gen(num_rows + splits),
            [1] * num_rows,
            seq_lens,
            num_q_heads=8,
            num_kv_heads=2,
            dtype=dtype,
        )
        assert_matches_reference(batch, tol_for(dtype), launch=split_launch(splits), max_query_len=1)
    assert split_calls == [splits] * 3


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_gqa_groups(group, device, split_calls):
    batch = PagedBatch(
        device, gen(30 + group), [1, 1], [150, 41], num_q_heads=2 * group, num_kv_heads=2, head_dim=32
    )
    assert_matches_reference(batch, launch=split_launch(4), max_query_len=1)
    assert split_calls == [4]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims(head_dim, dtype, device, split_calls):
    batch = PagedBatch(
        device,
        gen(head_dim),
        [1, 1],
        [100, 37],
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert_matches_reference(batch, tol_for(dtype), launch=split_launch(3), max_query_len=1)
    assert split_calls == [3]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
def test_sliding_window_and_floor(block_size, window, device, split_calls):
    """Windows shorter than one split, spanning several and longer than the row, with floors inside a
    block, on a block edge and above the window start: nothing below either is read."""
    batch = PagedBatch(
        device,
        gen(window + block_size),
        [1, 1, 1, 1],
        [150, 70, 33, 97],
        num_q_heads=4,
        num_kv_heads=2,
        block_size=block_size,
        window=window,
        floors=[13, 0, 32, 90],
    )
    assert_matches_reference(batch, launch=split_launch(5), max_query_len=1)
    assert split_calls == [5]


@pytest.mark.parametrize("block_size", [16, 32])
def test_floor_without_window(block_size, device, split_calls):
    batch = PagedBatch(device, gen(40), [1, 1, 1], [120, 70, 33], block_size=block_size, floors=[100, 17, 32])
    assert_matches_reference(batch, launch=split_launch(4), max_query_len=1)
    # A floor at the row's last key: one key, in the first split; every other split is empty.
    batch.kv_floor = torch.tensor([119, 69, 32], dtype=torch.int32, device=device)
    assert_matches_reference(batch, launch=split_launch(4), max_query_len=1)
    assert split_calls == [4, 4]


def test_floor_changes_the_result(device, split_calls):
    """The floor is honoured, not merely harmless: raising it over finite KV changes the output."""
    batch = PagedBatch(device, gen(41), [1], [90], floors=[0])
    full = batch.run(launch=split_launch(3), max_query_len=1).clone()
    batch.kv_floor = torch.tensor([50], dtype=torch.int32, device=device)
    floored = assert_matches_reference(batch, launch=split_launch(3), max_query_len=1)
    assert (full[:1] - floored[:1]).abs().max() > 1e-3


def test_more_splits_than_key_steps(device, split_calls):
    """Far more splits than the rows have keys (a graph sized for max_model_len on short rows): the
    surplus splits are empty and weigh nothing; a row with one key is still exactly its value."""
    batch = PagedBatch(device, gen(42), [1, 1, 1], [1, 2, 20], num_q_heads=2, num_kv_heads=2)
    out = assert_matches_reference(batch, launch=split_launch(16), max_query_len=1)
    v_first = batch.v_cache[batch.block_table[0, 0].long(), 0]
    torch.testing.assert_close(out[0], v_first, rtol=1e-6, atol=1e-6)
    assert split_calls == [16]


def test_min_keys_per_split(device, split_calls):
    """split_min_keys rounds up to whole key steps and bounds how thin the splits get: 130 keys over 8
    splits of at least 48 keys (3 steps of 16) fill three splits; the result is the same."""
    batch = PagedBatch(device, gen(43), [1, 1], [130, 20], num_q_heads=4, num_kv_heads=1)
    assert_matches_reference(batch, launch=split_launch(8, min_keys=40), max_query_len=1)
    assert_matches_reference(batch, launch=split_launch(8, block_n=32, min_keys=1), max_query_len=1)


def test_idle_rows_and_padding_are_not_written(device, split_calls):
    """Rows without queries (a CUDA graph's padding rows) and tokens past query_start_loc[-1]."""
    batch = PagedBatch(device, gen(44), [0, 1, 0, 1], [10, 90, 7, 33], padded_tokens=3)
    sentinel = torch.full_like(batch.query, 7.0)
    out = assert_matches_reference(batch, launch=split_launch(3), max_query_len=1, out=sentinel)
    assert out is sentinel
    assert (out[batch.num_real_tokens :] == 7.0).all()
    idle = PagedBatch(device, gen(45), [0, 0], [10, 18], padded_tokens=2)
    sentinel = torch.full_like(idle.query, 7.0)
    assert (idle.run(launch=split_launch(3), max_query_len=1, out=sentinel) == 7.0).all()


def test_multi_query_rows_stay_exact(device, split_calls):
    """max_query_len only shapes tiles: an understated hint (prefill rows in a 'decode' launch) or a
    forced split on a mixed batch still gives the reference, each query token split on its own."""
    batch = PagedBatch(
        device, gen(46), [1, 20, 5, 1], [100, 20, 60, 45], num_q_heads=8, num_kv_heads=2, window=30,
        floors=[0, 0, 10, 3],
    )  # fmt: skip
    assert_matches_reference(batch, launch=split_launch(3), max_query_len=1)
    assert_matches_reference(batch, launch=split_launch(3))
    assert split_calls == [3, 3]


def test_strided_query_and_output(device, split_calls):
    batch = PagedBatch(device, gen(47), [1, 1], [70, 30], num_q_heads=4, num_kv_heads=2, head_dim=32)
    wide = torch.randn(batch.query.shape[0], 6, 32, generator=gen(48)).to(device)
    wide[:, 1:5] = batch.query
    batch.query = wide[:, 1:5]
    out_buffer = torch.zeros(batch.query.shape[0], 4, 64, device=device)
    assert_matches_reference(batch, launch=split_launch(3), max_query_len=1, out=out_buffer[:, :, 16:48])
    assert (out_buffer[:, :, :16] == 0).all() and (out_buffer[:, :, 48:] == 0).all()


def random_decode_batch(seed: int, device) -> tuple[PagedBatch, AttentionLaunch, float]:
    """A random decode batch (rows, heads, head dim, blocks, window, floors, dtype), a random forced
    split launch for it and the dtype's tolerance."""
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2])
    rows = rng.randint(1, 8)
    seq_lens = [rng.randint(1, 200) for _ in range(rows)]
    floors = [rng.randint(0, s - 1) for s in seq_lens]
    dtype = rng.choice([torch.float32, torch.bfloat16])
    batch = PagedBatch(
        device,
        gen(100 + seed),
        [1] * rows,
        seq_lens,
        num_q_heads=num_kv_heads * rng.choice([1, 2, 4, 8]),
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([16, 64, 128]),
        block_size=rng.choice([16, 32]),
        window=rng.choice([0, 1, rng.randint(2, 100), 1000]),
        floors=rng.choice([None, floors]),
        dtype=dtype,
    )
    launch = split_launch(rng.randint(2, 9), block_n=rng.choice([16, 32]), min_keys=rng.choice([1, 16, 64]))
    return batch, launch, tol_for(dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_decode_batches(seed, device, split_calls):
    batch, launch, tol = random_decode_batch(seed, device)
    assert_matches_reference(batch, tol, launch=launch, max_query_len=1)
    assert split_calls == [launch.kv_splits]


@pytest.mark.parametrize("stages", [1, 3])
def test_key_loop_stages(stages, device, split_calls):
    """The key loop's pipelining depth (SPLIT_LAUNCH takes 1 or more) changes nothing but speed."""
    batch, launch, tol = random_decode_batch(300 + stages, device)
    assert_matches_reference(batch, tol, launch=replace(launch, num_stages=stages), max_query_len=1)
    assert split_calls == [launch.kv_splits]


def test_bounds_after_the_wait_change_nothing(device, split_calls, monkeypatch):
    """attention.EARLY_BOUNDS only moves the row's bounds before the PDL wait: with it off both kernels
    give bit for bit what they give as shipped, on rows with one key step, several, empty spans, floors,
    windows, idle rows and multi-query rows."""
    batches = [
        PagedBatch(
            device, gen(47), [1, 20, 5, 1, 0], [100, 20, 60, 45, 9], num_q_heads=8, num_kv_heads=2,
            window=30, floors=[0, 0, 10, 3, 0],
        ),
        PagedBatch(device, gen(48), [1, 1, 1], [1, 17, 200], num_q_heads=4, num_kv_heads=2),
    ]  # fmt: skip
    launches = [split_launch(3), split_launch(16, min_keys=16), split_launch(2, block_n=32, stages=1), None]
    shipped = [[b.run(launch=launch, max_query_len=1).clone() for launch in launches] for b in batches]
    monkeypatch.setattr(attention, "EARLY_BOUNDS", not attention.EARLY_BOUNDS)
    for batch, expected in zip(batches, shipped, strict=True):
        for launch, want in zip(launches, expected, strict=True):
            assert torch.equal(batch.run(launch=launch, max_query_len=1), want), launch


def test_combine_over_more_splits_than_one_chunk(device, split_calls, monkeypatch):
    """More splits than the combine loads at once: it merges them chunk by chunk, in split order."""
    monkeypatch.setattr(attention, "COMBINE_CHUNK_ELEMS", 4 * attention.COMBINE_D_SLICE)  # 4 splits a chunk
    batch = PagedBatch(device, gen(60), [1, 1], [150, 9], num_q_heads=4, num_kv_heads=2, head_dim=64)
    assert_matches_reference(batch, launch=split_launch(11), max_query_len=1)
    assert split_calls == [11]


# -- the launch policy ------------------------------------------------------------------------------------


@pytest.fixture
def small_gpu(monkeypatch):
    """The policy's view of a GPU with `sms` multiprocessors (no shared-memory limit), on any device."""

    def patch(sms: int) -> None:
        monkeypatch.setattr(attention_launch, "device_shape", lambda device: (None, sms))

    return patch


def test_policy_splits_small_decode_batches(device, split_calls, small_gpu, monkeypatch):
    """With 8 multiprocessors, 1 row x 2 kv heads splits into 8 (2 programs per SM); the split path runs
    through the default launch (no override) and matches the reference."""
    small_gpu(8)
    monkeypatch.setattr(attention_launch, "SPLIT_MIN_KEYS", 16)
    batch = PagedBatch(device, gen(50), [1], [200], num_q_heads=8, num_kv_heads=2, window=150, floors=[20])
    assert_matches_reference(batch, max_query_len=1)
    assert split_calls == [SPLIT_PROGRAMS_PER_SM * 8 // 2]
    # Enough rows to fill the GPU: today's one-launch path; so do prefill and unknown query lengths.
    full = PagedBatch(device, gen(51), [1] * 8, [40] * 8, num_q_heads=4, num_kv_heads=2)
    assert_matches_reference(full, max_query_len=1)
    assert_matches_reference(batch)
    assert_matches_reference(batch, max_query_len=4)
    assert split_calls == [8]


def test_decode_kv_splits_rule():
    sms = 132
    target = SPLIT_PROGRAMS_PER_SM * sms
    assert decode_kv_splits(1, 4, 8192, sms) == min(target // 4, 8192 // SPLIT_MIN_KEYS)
    assert decode_kv_splits(1, 4, 40960, sms) == target // 4
    assert decode_kv_splits(8, 4, 8192, sms) == target // 32
    assert decode_kv_splits(64, 4, 8192, sms) == 1  # 256 programs: already ~2 per SM
    assert decode_kv_splits(256, 8, 8192, sms) == 1
    assert decode_kv_splits(1, 4, 100, sms) == 1  # one split holds every key
    assert decode_kv_splits(1, 4, 128, sms, min_keys=16) == 8
    assert decode_kv_splits(1, 1, 0, sms) == 1


def test_plan_launch_splits_only_underfilled_decode(small_gpu):
    """The split count comes from host values only (rows, kv heads, SMs, the key bound and window),
    never from seq_lens, which plan_launch never sees: a CUDA graph replays the plan it captured. Full
    launches keep today's plan exactly (grid (B, H_kv), no split)."""
    small_gpu(132)
    cpu = torch.device("cpu")
    plan = plan_launch(1, 1, 4, 4, 256, cpu, 1, 0, None, 8192)
    assert plan.grid == (1, 4, 64) and plan.kv_splits == 64 and plan.split_min_keys == 128
    assert plan.tile == (4, 16, 128, True) and plan.num_stages == 1  # one 128-key step a split
    plan = plan_launch(8, 8, 4, 4, 256, cpu, 1, 0, None, 40960)
    assert plan.grid == (8, 4, 8) and plan.kv_splits == 8
    assert plan.num_stages == attention_launch.SPLIT_LAUNCH.num_stages  # 40 steps a split: pipelined
    # A window caps the keys: 128 keys fit one split.
    assert plan_launch(8, 8, 4, 4, 256, cpu, 1, 128, None, 8192).kv_splits == 1
    assert plan_launch(8, 8, 4, 4, 256, cpu, 1, 1024, None, 8192).kv_splits == 8
    full = plan_launch(64, 64, 4, 4, 256, cpu, 1, 0, None, 8192)
    assert full.grid == (64, 4) and full.kv_splits == 1 and full.tile == (4, 16, 128, True)
    # Prefill, unknown query lengths and explicit launches without kv_splits: no split.
    assert plan_launch(100, 1, 4, 4, 256, cpu, 100, 0, None, 8192).kv_splits == 1
    assert plan_launch(1, 1, 4, 4, 256, cpu, None, 0, None, 8192).kv_splits == 1
    assert plan_launch(1, 1, 4, 4, 256, cpu, 1, 0, AttentionLaunch(row_programs=True), 8192).kv_splits == 1
    forced = plan_launch(1, 1, 4, 4, 256, cpu, 1, 0, AttentionLaunch(row_programs=True, kv_splits=5), 64)
    assert forced.grid == (1, 4, 5) and forced.split_min_keys == 256  # 256: a multiple of 64-key steps
    with pytest.raises(ValueError, match="row layout"):
        plan_launch(1, 1, 4, 4, 256, cpu, 1, 0, AttentionLaunch(kv_splits=2), 64)


def test_interpreter_policy_never_splits(device, split_calls):
    """Unpatched, the interpreter has no SM count: the default launch never splits there (so the other
    attention tests keep running the one-launch kernel)."""
    batch = PagedBatch(device, gen(52), [1], [40])
    assert_matches_reference(batch, max_query_len=1)
    if not torch.cuda.is_available():
        assert split_calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 1000])
def test_compiled_bf16_long_context(window, device, split_calls):
    """Real sizes on the GPU through the default policy: batch 1 at 8k splits by the SM count."""
    batch = PagedBatch(
        device,
        gen(53),
        [1, 1],
        [8000, 3000],
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        block_size=16,
        window=window,
        floors=[0, 1500],
        dtype=torch.bfloat16,
    )
    assert_matches_reference(batch, HALF_TOL[torch.bfloat16], max_query_len=1)
    assert split_calls and split_calls[0] > 1
