"""Launch policy of paged attention: which layout, tile, warps and stages a call gets, and its grid.

Host code only; `attention.py` holds the kernel and asks `plan_launch` how to run it. The kernel has two
layouts, each with the inner loop the H200 sweeps picked for it (BENCHMARKS.md, "Paged attention kernel"):

- tiles (prefill): one program per (query tile, kv head), found by binary search, heaviest (latest,
  causal) tiles first; K loaded as rows, fully visible key blocks unmasked, the softmax scale folded
  into exp2's argument;
- rows (decode): one program per (row, kv head) looping over the row's query tiles; K loaded as columns,
  every key block masked, the scale applied to the scores.

Defaults, measured on an H200 (bf16, heads of 128; bench/results/attention_sweep.log and attention.log):
prefill takes 128 score rows x 128 keys, 8 warps, 3 stages (1.18 / 1.10 / 1.07 / 1.04x flash SDPA at
4k / 8k / 16k / 4 x 4k; the old 64 x 64 tile ran 0.80 / 0.77 / 0.76 / 0.77x). A tile that `max_query_len`
shrinks (decode, short chunks) takes the row layout, with 128-key steps while there are at most
DECODE_MAX_WAVES waves of (row, kv head) programs on the GPU (75.7 against 97.2 us for 64-key steps on 16
q / 4 kv heads at batch 64, 2k context: 256 programs), 64-key steps beyond that (128-key steps ran 4-5%
slower at 512+ programs) and over windows of at most SHORT_WINDOW keys (as fast at B = 64, 11.3 us;
faster at B = 256, 27.7 against 33.2 us).

Split-KV decode: a decode-shaped launch (max_query_len == 1) whose (row, kv head) programs cannot fill
the GPU (fewer than SPLIT_PROGRAMS_PER_SM per multiprocessor; batch 1 or 8 at 4 kv heads gives 4 or 32
programs for 132 SMs) splits each row's key range over `kv_splits` programs, each writing a partial
softmax (max, sum, unnormalised output), and a second small launch combines them (`attention.py`). The
split count is a function of host-known values only (rows, kv heads, the multiprocessor count and the
key bound: the block table's width times the block size, i.e. max_model_len, capped by the window), never
of the device seq_lens, so a CUDA graph captures it; the kernel spreads each row's actual keys over the
splits, leaving the splits a short row does not need empty. Launches that already fill the GPU keep the
one-launch row layout unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from raystate.kernels._common import interpreting, next_pow2


@dataclass(frozen=True)
class AttentionLaunch:
    """How one launch lays out and tiles the kernel: `paged_attention(launch=...)` overrides the policy's
    choice (benchmarks and tests). Every value changes speed only, never the result beyond float
    rounding: the tests run both layouts at several tiles."""

    block_m: int = 64  # most score rows per program; a short-query (decode) tile shrinks below this
    block_n: int = 64  # keys per inner-loop step
    num_warps: int | None = None  # None: 4 for up to 64 score rows, else 8
    num_stages: int = 2  # software-pipelining depth of the key loop
    row_programs: bool = False  # the row layout (decode); False: the tile layout (prefill)
    # Split-KV (row layout only): each row's keys spread over this many programs per kv head, their
    # partials combined afterwards; 1 = one program per (row, kv head). The policy picks it for decode
    # (decode_kv_splits).
    kv_splits: int = 1
    # Fewest keys a split takes (rounded up to whole key steps), so a short row fills few splits; also
    # bounds kv_splits by the key bound (SPLIT_MIN_KEYS for the policy's launches).
    split_min_keys: int = 256

    def tag(self) -> str:
        """A short name for tables: layout, score rows, keys per step, warps, stages."""
        warps = "auto" if self.num_warps is None else self.num_warps
        layout = "rows" if self.row_programs else "tiles"
        split = f" split{self.kv_splits}/{self.split_min_keys}" if self.kv_splits > 1 else ""
        return f"{layout} M{self.block_m} N{self.block_n} w{warps} s{self.num_stages}{split}"


# The defaults (see the module docstring): full-size tiles take PREFILL_LAUNCH; tiles that max_query_len
# shrinks take DECODE_LAUNCH, or DECODE_SHORT_STEP_LAUNCH over a window of at most SHORT_WINDOW keys or
# with more than DECODE_MAX_WAVES waves of programs.
PREFILL_LAUNCH = AttentionLaunch(block_m=128, block_n=128, num_warps=8, num_stages=3)
DECODE_LAUNCH = AttentionLaunch(block_n=128, row_programs=True)
DECODE_SHORT_STEP_LAUNCH = AttentionLaunch(block_n=64, row_programs=True)
DECODE_MAX_WAVES = 2
SHORT_WINDOW = 128
# Split-KV decode (decode_kv_splits): split while rows x kv heads give fewer than SPLIT_PROGRAMS_PER_SM
# programs per multiprocessor, into at most that many programs in all, each taking >= SPLIT_MIN_KEYS keys,
# with SPLIT_LAUNCH's key step and stages.
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_MIN_KEYS = 128
SPLIT_LAUNCH = AttentionLaunch(block_n=128, num_stages=2, row_programs=True)


class LaunchPlan(NamedTuple):
    """What one kernel launch takes from the policy."""

    grid: tuple[int, ...]  # split-KV: (B, H_kv, kv_splits)
    tile: tuple[int, int, int, bool]  # the kernel's TILE: (BLOCK_Q, BLOCK_M, BLOCK_N, ROW_PROGRAMS)
    num_warps: int
    num_stages: int
    kv_splits: int = 1  # > 1: the split-KV kernel and its reduction instead of the one-launch kernel
    split_min_keys: int = 0  # keys a split takes at least (a multiple of BLOCK_N); split-KV only


def decode_kv_splits(
    num_rows: int, num_kv_heads: int, key_bound: int, sms: int, min_keys: int = SPLIT_MIN_KEYS
) -> int:
    """How many programs per (row, kv head) a decode launch splits each row's keys over: as many as keep
    rows x kv heads x splits within SPLIT_PROGRAMS_PER_SM programs per multiprocessor (so 1 once the
    batch alone fills the GPU to that share), and no more than `key_bound` (the most keys a row can
    read: the block table's width times the block size, capped by the window) holds splits of
    `min_keys`. Host values only: the same for every replay of a CUDA graph."""
    splits = (SPLIT_PROGRAMS_PER_SM * sms) // max(1, num_rows * num_kv_heads)
    return max(1, min(splits, -(-max(key_bound, 1) // max(min_keys, 1))))


def tile_shape(group: int, max_query_len: int | None, max_block_m: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per tile and its padded score-row count.

    Known short queries (decode) get one token per tile with its GROUP heads packed into the rows, so a
    decode step reads each KV tile once for the whole group. Sizes are powers of two (given a
    power-of-two GROUP) so the number of compiled variants stays small. A tile shrunk below max_block_m
    holds max_query_len tokens: BLOCK_M >= next_pow2(max_query_len * GROUP).
    """
    block_m = max(max_block_m, next_pow2(group))
    if max_query_len is not None:
        block_m = min(block_m, max(16, next_pow2(max(1, max_query_len) * group)))
    return max(1, block_m // group), block_m


def launch_config(
    group: int,
    max_query_len: int | None,
    launch: AttentionLaunch | None,
    sliding_window: int = 0,
    key_row_bytes: int = 0,
    smem_limit: int | None = None,
    decode_waves: float = 0.0,
    split: bool = False,
) -> tuple[int, AttentionLaunch]:
    """(BLOCK_Q, the launch with block_m and num_warps resolved) for this call.

    Without an explicit `launch`: PREFILL_LAUNCH, or for a tile that max_query_len shrinks the row layout
    (DECODE_SHORT_STEP_LAUNCH for a short window or more than DECODE_MAX_WAVES `decode_waves`: rows x kv
    heads over the GPU's multiprocessors, else DECODE_LAUNCH), made to fit `smem_limit` bytes of shared
    memory for keys of `key_row_bytes` (the defaults are sized for bf16: fp32 caches of D = 128 would not
    compile). A policy split (`split`) takes SPLIT_LAUNCH the same way. An explicit one applies as given
    (its block_m still caps the tile, which short queries shrink).
    """
    short = 0 < sliding_window <= SHORT_WINDOW or decode_waves > DECODE_MAX_WAVES
    decode = SPLIT_LAUNCH if split else DECODE_SHORT_STEP_LAUNCH if short else DECODE_LAUNCH
    return _resolve_launch(group, max_query_len, launch, decode, key_row_bytes, smem_limit)


def _key_loop_smem(launch: AttentionLaunch, key_row_bytes: int) -> int:
    """A bound on the shared memory the pipelined key loop takes: max(num_stages, 2) buffered K and V
    tiles. (Triton 3.6 asked 262656 bytes for 128-key fp32 tiles of D = 128 at 3 stages and 262144 at 2,
    of the H200's 232448; the bf16 defaults stay within it as tuned.)"""
    return max(launch.num_stages, 2) * 2 * launch.block_n * key_row_bytes


@functools.lru_cache(maxsize=512)
def _resolve_launch(
    group: int,
    max_query_len: int | None,
    launch: AttentionLaunch | None,
    decode: AttentionLaunch,
    key_row_bytes: int,
    smem_limit: int | None,
) -> tuple[int, AttentionLaunch]:
    """launch_config's work, cached: it runs on every launch and builds a dataclass."""
    if launch is None:
        launch = PREFILL_LAUNCH
        block_q, block_m = tile_shape(group, max_query_len, launch.block_m)
        if block_m < launch.block_m:
            # Shrunk: max_query_len is known and one tile holds every row's queries (tile_shape), so
            # one program per row covers the row.
            launch = decode
            block_q, block_m = tile_shape(group, max_query_len, launch.block_m)
        # Fewer stages first (down to 2), then fewer keys per step, until the key loop fits.
        halved = False
        while smem_limit is not None and _key_loop_smem(launch, key_row_bytes) > smem_limit:
            if launch.num_stages > 2:
                launch = replace(launch, num_stages=launch.num_stages - 1)
            elif launch.block_n > 16:
                launch = replace(launch, block_n=launch.block_n // 2)
                halved = True
            else:
                break
        # A decode loop whose key step had to halve takes a third stage back where it fits: heads of
        # D = 256 (Gemma 3) at batch 64, 4k context ran 0.271 ms with 64-key steps at 3 stages against
        # 0.288 ms at 2 (H200, bench_attention --head-dim 256 --sweep).
        deeper = replace(launch, num_stages=3)
        if halved and launch.row_programs and _key_loop_smem(deeper, key_row_bytes) <= smem_limit:
            launch = deeper
    else:
        block_q, block_m = tile_shape(group, max_query_len, launch.block_m)
    num_warps = launch.num_warps if launch.num_warps is not None else (4 if block_m <= 64 else 8)
    return block_q, replace(launch, block_m=block_m, num_warps=num_warps)


@functools.lru_cache(maxsize=16)
def device_limits(device_index: int) -> tuple[int, int]:
    """(bytes of shared memory a program may take, less 8 KiB for the kernel's own scratch; the number of
    multiprocessors) of this GPU."""
    props = torch.cuda.get_device_properties(device_index)
    limit = getattr(props, "shared_memory_per_block_optin", 0)
    if not limit:  # an older torch: ask Triton's driver
        import triton.runtime

        limit = triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
    return int(limit) - 8192, max(1, props.multi_processor_count)


def device_shape(device: torch.device) -> tuple[int | None, int | None]:
    """(shared memory bytes a program may take, multiprocessors) of `device`, or (None, None) under
    Triton's interpreter (no limit, no program-count rules). Tests patch it to try the GPU rules."""
    if interpreting():
        return None, None
    return device_limits(device.index or 0)


def plan_launch(
    num_tokens: int,
    num_rows: int,
    num_kv_heads: int,
    group: int,
    key_row_bytes: int,
    device: torch.device,
    max_query_len: int | None,
    sliding_window: int,
    launch: AttentionLaunch | None,
    key_bound: int = 0,
) -> LaunchPlan:
    """The grid, tile and compile options of one launch over `num_rows` rows of `num_tokens` queries.

    The tile layout numbers the query tiles of the whole batch without a host-side table (row b owns the
    ids from query_start_loc[b] // BLOCK_Q + b on), so num_tokens // BLOCK_Q + num_rows ids cover every
    row; its one grid axis runs tiles x kv heads, kv heads fastest. Without an explicit `launch`, a
    decode launch (max_query_len == 1) too small to fill the GPU splits its keys (decode_kv_splits, over
    `key_bound` keys: the block table's width times the block size); an explicit launch splits by its
    kv_splits.
    """
    smem, sms = device_shape(device)
    explicit = launch
    bound = min(key_bound, sliding_window) if sliding_window > 0 else key_bound  # most keys a row reads
    waves = 0.0 if sms is None else num_rows * num_kv_heads / sms
    splits = 1
    min_keys = SPLIT_MIN_KEYS
    if launch is None and max_query_len == 1 and sms is not None:
        splits = decode_kv_splits(num_rows, num_kv_heads, bound, sms, min_keys)
        waves *= splits
    elif launch is not None and launch.kv_splits > 1:
        if not launch.row_programs:
            raise ValueError("kv_splits > 1 needs the row layout (row_programs=True)")
        splits, min_keys = launch.kv_splits, launch.split_min_keys
    block_q, launch = launch_config(
        group, max_query_len, launch, sliding_window, key_row_bytes, smem, waves, split=splits > 1
    )
    if splits > 1 and not launch.row_programs:  # a policy split only applies to the decode (row) layout
        splits = 1
    if splits > 1:
        grid: tuple[int, ...] = (num_rows, num_kv_heads, splits)
    elif launch.row_programs:
        grid = (num_rows, num_kv_heads)
    else:
        grid = ((num_tokens // block_q + num_rows) * num_kv_heads,)
    tile = (block_q, launch.block_m, launch.block_n, launch.row_programs)
    min_chunk = -(-max(min_keys, 1) // launch.block_n) * launch.block_n
    stages = launch.num_stages
    if splits > 1 and explicit is None and -(-max(bound, 1) // splits) <= launch.block_n:
        # A policy split of one key step: nothing to pipeline, and the pipelined loop's prologue costs
        # (H200, batch 1 at 8k: 11.6 us at 1 stage against 11.9 at 2; 8 steps a split at batch 8 want 2:
        # 41.5 us against 52.5 at 1).
        stages = 1
    return LaunchPlan(
        grid,
        tile,
        launch.num_warps,
        stages,
        splits,
        min_chunk if splits > 1 else 0,
    )
