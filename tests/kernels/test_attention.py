"""Paged attention: the Triton kernel against paged_attention_ref.

The `device` fixture (tests/kernels/conftest.py) asserts the Triton path runs: compiled on CUDA, else
through Triton's CPU interpreter, so sizes stay small. Every cache slot a row may not read (below its
floor, outside its queries' windows, past its length, and every spare block) holds NaN, so a stray read
shows up as a non-finite output; block table entries for blocks no query can see hold out-of-range ids.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from raystate.kernels import cdiv, paged_attention, paged_attention_ref
from raystate.kernels.attention_launch import AttentionLaunch, launch_config, plan_launch, tile_shape

FP32_TOL = 1e-5
HALF_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


class PagedBatch:
    """A batch over a paged, NaN-poisoned cache with shuffled, non-contiguous block ids."""

    def __init__(
        self,
        device: str,
        gen: torch.Generator,
        q_lens: list[int],
        seq_lens: list[int],
        *,
        num_q_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 32,
        block_size: int = 16,
        window: int = 0,
        floors: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        padded_tokens: int = 0,
    ):
        assert len(q_lens) == len(seq_lens) and all(q <= s for q, s in zip(q_lens, seq_lens, strict=True))
        num_rows = len(seq_lens)
        self.window = window
        self.scale = head_dim**-0.5
        blocks_per_row = [cdiv(s, block_size) for s in seq_lens]
        max_blocks = max(blocks_per_row, default=0) + 2  # trailing columns stay garbage
        num_blocks = sum(blocks_per_row) + 3  # spare blocks stay NaN
        block_ids = torch.randperm(num_blocks, generator=gen).tolist()
        garbage = num_blocks + 10_000  # out of range: reading it would fault or return junk
        block_table = torch.full((max(num_rows, 0), max_blocks), garbage, dtype=torch.int32)
        kv_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.full(kv_shape, math.nan)
        v_cache = torch.full(kv_shape, math.nan)
        for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
            lo = self.row_lo(q_len, seq_len, floors[b] if floors is not None else 0)
            for j in range(lo // block_size, blocks_per_row[b]):
                block_table[b, j] = block_ids.pop()
            for pos in range(lo, seq_len):
                block, offset = block_table[b, pos // block_size], pos % block_size
                k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
                v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
        num_tokens = sum(q_lens) + padded_tokens
        self.query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(device, dtype)
        self.k_cache = k_cache.to(device, dtype)
        self.v_cache = v_cache.to(device, dtype)
        self.block_table = block_table.to(device)
        starts = [0]
        for q_len in q_lens:
            starts.append(starts[-1] + q_len)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.kv_floor = None if floors is None else torch.tensor(floors, dtype=torch.int32, device=device)
        self.num_real_tokens = starts[-1]

    def row_lo(self, q_len: int, seq_len: int, floor: int) -> int:
        """Lowest key position any query of the row reads."""
        lo = floor
        if self.window:
            lo = max(lo, seq_len - q_len - self.window + 1)
        return max(lo, 0)

    def args(self) -> tuple:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            self.scale,
            self.window,
            self.kv_floor,
        )

    def run(self, **kwargs) -> torch.Tensor:
        return paged_attention(*self.args(), **kwargs)

    def reference(self) -> torch.Tensor:
        return paged_attention_ref(*self.args())


def assert_matches_reference(batch: PagedBatch, tol: float = FP32_TOL, **kwargs) -> torch.Tensor:
    out = batch.run(**kwargs)
    ref = batch.reference()
    n = batch.num_real_tokens
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert torch.isfinite(ref[:n].float()).all(), "test set-up leaked poison into the reference"
    assert torch.isfinite(out[:n].float()).all(), "kernel read a poisoned (unreadable) cache slot"
    err = (out[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm().clamp(min=1e-30)
    assert err <= tol, f"relative error {err:.3g} > {tol}"
    return out


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_mixed_batch(seed: int, device: str) -> PagedBatch:
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2])
    block_size = rng.choice([16, 32, 64])
    rows = rng.randint(1, 6)
    seq_lens = [rng.randint(1, 90) for _ in range(rows)]
    # Each row is a decode, a whole prompt or a chunk ending at its length.
    q_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
    floors = [rng.randint(0, s - q) for s, q in zip(seq_lens, q_lens, strict=True)]
    return PagedBatch(
        device,
        gen(seed),
        q_lens,
        seq_lens,
        num_q_heads=num_kv_heads * rng.choice([1, 2, 4]),
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([16, 32, 64]),
        block_size=block_size,
        window=rng.choice([0, 1, rng.randint(2, 40), 1000]),
        floors=rng.choice([None, floors]),
    )


@pytest.mark.parametrize("seed", range(20))
def test_random_mixed_batches(seed, device):
    assert_matches_reference(random_mixed_batch(seed, device))


@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [0, 5])
def test_gqa_ratios(group, window, device):
    batch = PagedBatch(
        device,
        gen(group),
        [1, 20, 7],
        [33, 20, 50],
        num_q_heads=2 * group,
        num_kv_heads=2,
        window=window,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("max_query_len", [None, 1])
def test_pure_decode(max_query_len, device):
    batch = PagedBatch(device, gen(1), [1] * 5, [1, 17, 40, 64, 65], num_q_heads=8, num_kv_heads=2)
    assert_matches_reference(batch, max_query_len=max_query_len)


def test_many_rows(device):
    """Enough rows that each program's binary search for its row takes several steps."""
    rng = random.Random(0)
    seq_lens = [rng.randint(1, 40) for _ in range(37)]
    q_lens = [rng.choice([0, 1, 1, s]) for s in seq_lens]
    batch = PagedBatch(
        device, gen(0), q_lens, seq_lens, num_q_heads=2, num_kv_heads=1, head_dim=16, window=11
    )
    assert_matches_reference(batch)
    assert_matches_reference(batch, max_query_len=max(q_lens))


def test_pure_prefill_spanning_several_query_tiles(device):
    # 70 tokens x 4 heads per kv head exceed one 64-row tile several times over.
    batch = PagedBatch(device, gen(2), [70, 3, 16], [70, 3, 16], num_q_heads=8, num_kv_heads=2)
    assert_matches_reference(batch)


def test_chunk_in_the_middle_of_a_sequence(device):
    # Rows resume at positions 30 and 47: earlier KV is cached, later positions do not exist yet.
    batch = PagedBatch(device, gen(3), [12, 9], [42, 56], block_size=16)
    assert_matches_reference(batch)


@pytest.mark.parametrize("window", [1, 3, 16, 17, 200])
def test_sliding_window(window, device):
    batch = PagedBatch(device, gen(4), [1, 25, 40], [60, 25, 80], window=window, block_size=16)
    assert_matches_reference(batch)


def test_window_one_attends_only_to_itself(device):
    batch = PagedBatch(device, gen(5), [6, 1], [30, 9], window=1, num_q_heads=2, num_kv_heads=2)
    out = assert_matches_reference(batch)
    # With W = 1 each query reads one key, so its output is exactly that key's value.
    v_first = batch.v_cache[batch.block_table[1, 0].long(), 8]  # row 1, position 8
    torch.testing.assert_close(out[6], v_first, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [0, 8])
def test_kv_floor(window, device):
    # Floors 0, inside a block, on a block edge, and at the chunk start; everything below them is NaN.
    batch = PagedBatch(
        device, gen(6), [4, 10, 1, 5], [40, 30, 70, 21], floors=[0, 13, 32, 16], window=window, block_size=16
    )
    assert_matches_reference(batch)


def test_floor_changes_the_result(device):
    """The floor is honoured, not merely harmless: raising it over finite KV changes the output."""
    batch = PagedBatch(device, gen(7), [3], [40], floors=[0])
    full = batch.run().clone()
    batch.kv_floor = torch.tensor([20], dtype=torch.int32, device=device)
    floored = assert_matches_reference(batch)
    assert (full[:3] - floored[:3]).abs().max() > 1e-3


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 64, 128])
def test_block_sizes(block_size, device):
    batch = PagedBatch(
        device, gen(8), [1, 9, 20], [45, 9, 70], block_size=block_size, window=23, floors=[5, 0, 31]
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_head_dims(head_dim, device):
    batch = PagedBatch(device, gen(9), [1, 6], [20, 19], head_dim=head_dim, num_q_heads=2, num_kv_heads=1)
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    batch = PagedBatch(device, gen(10), [1, 12, 5], [33, 12, 40], dtype=dtype, window=20, floors=[0, 0, 4])
    assert_matches_reference(batch, tol=HALF_TOL[dtype])


def test_empty_batch(device):
    batch = PagedBatch(device, gen(11), [], [])
    out = batch.run()
    assert out.shape == (0, 4, 32)


def test_rows_without_queries_and_padded_tokens_are_not_written(device):
    # Rows 0 and 2 schedule nothing this step; tokens past query_start_loc[-1] are padding.
    batch = PagedBatch(device, gen(12), [0, 5, 0, 1], [10, 18, 7, 33], padded_tokens=3)
    sentinel = torch.full_like(batch.query, 7.0)
    out = assert_matches_reference(batch, out=sentinel)
    assert out is sentinel
    assert (out[batch.num_real_tokens :] == 7.0).all()

    idle = PagedBatch(device, gen(13), [0, 0], [10, 18], padded_tokens=4)
    sentinel = torch.full_like(idle.query, 7.0)
    assert (idle.run(out=sentinel) == 7.0).all()


def test_strided_query_and_output(device):
    """query and out may be views into wider buffers (e.g. a fused qkv projection)."""
    batch = PagedBatch(device, gen(14), [1, 8], [25, 30], num_q_heads=4, num_kv_heads=2, head_dim=32)
    wide = torch.randn(batch.query.shape[0], 6, 32, generator=gen(15)).to(device)
    wide[:, 1:5] = batch.query
    batch.query = wide[:, 1:5]
    out_buffer = torch.zeros(batch.query.shape[0], 4, 64, device=device)
    assert_matches_reference(batch, out=out_buffer[:, :, 16:48])
    assert (out_buffer[:, :, :16] == 0).all() and (out_buffer[:, :, 48:] == 0).all()


def test_max_query_len_hint_matches_default_tiling(device):
    batch = PagedBatch(device, gen(16), [1, 30, 2], [20, 41, 50], num_q_heads=8, num_kv_heads=2, window=9)
    hinted = assert_matches_reference(batch, max_query_len=30)
    torch.testing.assert_close(hinted, batch.run(), rtol=1e-6, atol=1e-6)
    # The hint only shapes tiles: an understated one is still correct.
    assert_matches_reference(batch, max_query_len=1)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 512])
def test_compiled_bf16_long_context(window, device):
    """Real sizes on the GPU: long rows, many query tiles and KV tiles, bf16 caches."""
    batch = PagedBatch(
        device,
        gen(17),
        [1, 1, 700, 300],
        [3000, 17, 700, 2100],
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        block_size=16,
        window=window,
        floors=[0, 0, 0, 1500],
        dtype=torch.bfloat16,
    )
    assert_matches_reference(batch, tol=HALF_TOL[torch.bfloat16])


# Both layouts at several tiles, on shapes small enough for the interpreter. Small BLOCK_N and BLOCK_M
# give each tile several key blocks, so the tile layout's three loops (window edge, fully visible middle,
# causal diagonal) all run, and many query tiles, so its reversed (heaviest first) order matters.
VARIANTS = {
    "tiles": AttentionLaunch(),
    "tiles_m16_n16": AttentionLaunch(block_m=16, block_n=16),
    "tiles_m128_n32": AttentionLaunch(block_m=128, block_n=32, num_warps=8, num_stages=3),
    "tiles_m64_n128": AttentionLaunch(block_n=128, num_stages=4),
    # One program per row looping over its query tiles (the decode layout), forced on mixed batches too.
    "rows": AttentionLaunch(row_programs=True),
    "rows_m16_n128": AttentionLaunch(block_m=16, block_n=128, row_programs=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
class TestVariants:
    """Each variant against the reference: layout and tile may only change speed."""

    @pytest.mark.parametrize("seed", [0, 11])
    def test_random_mixed_batches(self, variant, seed, device):
        assert_matches_reference(random_mixed_batch(seed, device), launch=VARIANTS[variant])

    @pytest.mark.parametrize("window", [0, 37])
    def test_long_rows(self, variant, window, device):
        """A prompt, a chunk resuming mid-sequence and two decodes, with floors: tiles reach past BLOCK_N
        keys, so fully visible blocks sit between the window edge and the diagonal."""
        batch = PagedBatch(
            device,
            gen(20 + window),
            [80, 40, 1, 1],
            [80, 130, 150, 97],
            num_q_heads=8,
            num_kv_heads=2,
            window=window,
            floors=[0, 19, 70, 0],
        )
        launch = VARIANTS[variant]
        assert_matches_reference(batch, launch=launch)
        # The decode-tile path (max_query_len=1 shrinks BLOCK_M) stays exact for the single-token rows.
        decode = PagedBatch(
            device, gen(21), [1, 1, 1], [150, 97, 33], num_q_heads=8, num_kv_heads=2, window=window
        )
        assert_matches_reference(decode, launch=launch, max_query_len=1)

    def test_odd_group_head_dim_and_block_sizes(self, variant, device):
        """GQA group 3 (padded score rows), D = 48 (padded head dim), blocks of 1 and 64 tokens."""
        for block_size in (1, 64):
            batch = PagedBatch(
                device,
                gen(22 + block_size),
                [70, 1, 9],
                [70, 90, 40],
                num_q_heads=6,
                num_kv_heads=2,
                head_dim=48,
                block_size=block_size,
                window=29,
                floors=[0, 10, 0],
            )
            assert_matches_reference(batch, launch=VARIANTS[variant])

    def test_half_precision(self, variant, device):
        batch = PagedBatch(
            device, gen(23), [1, 80, 5], [90, 80, 40], dtype=torch.bfloat16, window=50, floors=[0, 0, 4]
        )
        assert_matches_reference(batch, tol=HALF_TOL[torch.bfloat16], launch=VARIANTS[variant])


def test_launch_config_defaults_and_overrides():
    """No override: the swept prefill tile (tile layout, 128 x 128, 8 warps, 3 stages); decode shrinks to
    16 score rows in the row layout. An override keeps its knobs, is still shrunk for short queries, and
    gets 8 warps for 128 rows when it names none."""
    block_q, launch = launch_config(4, None, None)
    assert (block_q, launch.block_m, launch.block_n, launch.num_warps, launch.num_stages) == (
        32,
        128,
        128,
        8,
        3,
    )
    assert not launch.row_programs
    block_q, launch = launch_config(4, 1, None)
    assert (block_q, launch.block_m, launch.block_n, launch.num_warps) == (4, 16, 128, 4)
    assert launch.row_programs  # one tile holds each decode row: one program per row
    # A short window takes 64-key steps; a longer one the full-attention tile; so do more than two
    # waves of (row, kv head) programs.
    assert launch_config(4, 1, None, sliding_window=128)[1].block_n == 64
    assert launch_config(4, 1, None, sliding_window=1024)[1].block_n == 128
    assert launch_config(4, 1, None, decode_waves=1.9)[1].block_n == 128
    assert launch_config(4, 1, None, decode_waves=3.9)[1].block_n == 64

    big = AttentionLaunch(block_m=128, block_n=128, num_stages=3)
    block_q, launch = launch_config(4, 4096, big)
    assert (block_q, launch.block_m, launch.block_n, launch.num_warps, launch.num_stages) == (
        32,
        128,
        128,
        8,
        3,
    )
    block_q, launch = launch_config(4, 1, big)
    assert (block_q, launch.block_m, launch.block_n, launch.row_programs) == (4, 16, 128, False)


def test_decode_launch_fits_wide_heads_with_three_stages():
    """Keys of D = 256 (bf16, 512 bytes a row) do not fit 128-key steps in the H200's 232448 bytes of
    shared memory: the decode loop halves its key step and then takes a third stage back (it fits);
    the prefill loop only shrinks."""
    smem = 232448
    _, decode = launch_config(2, 1, None, key_row_bytes=512, smem_limit=smem)
    assert (decode.block_n, decode.num_stages, decode.row_programs) == (64, 3, True)
    _, narrow = launch_config(2, 1, None, key_row_bytes=256, smem_limit=smem)  # D = 128: as tuned
    assert (narrow.block_n, narrow.num_stages) == (128, 2)
    _, prefill = launch_config(2, None, None, key_row_bytes=512, smem_limit=smem)
    assert not prefill.row_programs and prefill.num_stages == 2


@pytest.mark.parametrize("group", range(1, 9))
def test_shrunk_tiles_hold_the_longest_row(group):
    """The default picks the row layout only for tiles that max_query_len shrinks; such a tile always
    holds max_query_len queries, so one program per row covers the row in one tile."""
    for max_query_len in range(1, 130):
        block_q, launch = launch_config(group, max_query_len, None)
        assert launch.row_programs == (launch.block_m < 128)
        assert block_q == tile_shape(group, max_query_len, launch.block_m)[0]
        if launch.row_programs:
            assert max_query_len <= block_q


def test_plan_launch_grids():
    """Tile layout: one axis of (T // BLOCK_Q + B) tile ids times the kv heads; row layout: (B, H_kv)."""
    cpu = torch.device("cpu")
    prefill = plan_launch(1000, 3, 2, 4, 256, cpu, None, 0, None)
    assert prefill.grid == ((1000 // 32 + 3) * 2,) and prefill.tile == (32, 128, 128, False)
    assert (prefill.num_warps, prefill.num_stages) == (8, 3)
    decode = plan_launch(64, 64, 2, 4, 256, cpu, 1, 0, None)
    assert decode.grid == (64, 2) and decode.tile == (4, 16, 128, True)
    assert (decode.num_warps, decode.num_stages) == (4, 2)


def test_default_launch_fits_shared_memory():
    """The defaults are sized for bf16 keys; fp32 keys of D = 128 need 262656 bytes at 3 stages and
    262144 at 2 (more than an H200's 232448), so the launcher drops a stage, then halves the key step."""
    limit = 232448 - 8192
    _, bf16 = launch_config(4, None, None, 0, 128 * 2, limit)
    assert (bf16.block_n, bf16.num_stages) == (128, 3)
    _, fp32 = launch_config(4, None, None, 0, 128 * 4, limit)
    assert (fp32.block_n, fp32.num_stages) == (64, 2)
    _, small = launch_config(4, 1, None, 0, 128 * 4, 64 * 1024)  # a GPU with 64 KiB per program
    assert small.block_n == 32 and small.num_stages == 2
    explicit = AttentionLaunch(block_n=128, num_stages=4)
    assert launch_config(4, None, explicit, 0, 128 * 4, limit)[1].num_stages == 4  # taken as given
