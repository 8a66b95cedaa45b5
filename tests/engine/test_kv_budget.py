"""A KV byte budget split across groups: under bounded replay the window group gets only its working set
and the prefix-cacheable group the rest, so the same bytes keep more cached prefixes than "cache
everything" does (DESIGN section 3: window KV is never cached)."""

from __future__ import annotations

import numpy as np
import pytest

from raystate import LLM, SamplingParams
from raystate.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from raystate.errors import InvalidRequest
from raystate.kv_layout import kv_block_bytes, kv_cache_group_specs, plan_group_blocks

BENCH = ModelConfig.named("bench")


def test_plan_gives_window_groups_their_working_set_and_the_rest_to_full_attention():
    groups = kv_cache_group_specs(BENCH, 16, swa_bounded_replay=True)
    full, sliding = (g.name for g in groups)
    assert (full, sliding) == ("full", "sliding")
    budget = 64 * 2**30
    counts = plan_group_blocks(groups, budget, 2, True, max_num_seqs=64, max_num_batched_tokens=8192)
    # Window: 64 requests x (128 / 16 + 2) blocks + 8192 / 16 chunk blocks + the null block.
    assert counts[1] == 1 + 64 * 10 + 512
    used = sum(kv_block_bytes(g, 2) * n for g, n in zip(groups, counts, strict=True))
    assert used <= budget < used + kv_block_bytes(groups[0], 2)  # the rest, to the last whole block
    # Cache everything: both groups cache, so they share the budget block for block.
    everything = kv_cache_group_specs(BENCH, 16, swa_bounded_replay=False)
    even = plan_group_blocks(everything, budget, 2, True, max_num_seqs=64, max_num_batched_tokens=8192)
    assert even[0] == even[1] == budget // sum(kv_block_bytes(g, 2) for g in everything)
    # Bench: 6 of 24 layers are full attention, so nearly 4x the cached tokens in the same bytes.
    assert counts[0] / even[0] > 3.9
    # Prefix caching off: nothing is cached, windows still hold only their working set.
    off = plan_group_blocks(groups, budget, 2, False, max_num_seqs=64, max_num_batched_tokens=8192)
    assert off == counts


def test_a_budget_too_small_is_refused_with_the_field_and_limit():
    groups = kv_cache_group_specs(BENCH, 16)
    with pytest.raises(InvalidRequest, match="kv_cache_bytes"):
        plan_group_blocks(groups, 1000, 2, True, 64, 2048)
    with pytest.raises(InvalidRequest, match="kv_cache_bytes"):
        CacheConfig(num_blocks=100, kv_cache_bytes=10**9)


def test_engine_config_sizes_pools_from_the_budget():
    config = EngineConfig(
        cache=CacheConfig(kv_cache_bytes=4 << 20),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    )
    full, sliding = config.group_num_blocks
    assert sliding == 1 + 4 * (32 // 16 + 2) + 256 // 16
    assert full > sliding and config.num_blocks == full


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch):
    monkeypatch.setenv("RAYSTATE_KERNELS", "reference")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", True)


def _first_prefix_still_cached(replay: bool, budget: int, prefixes: list[list[int]]) -> int:
    llm = LLM(
        backend="inprocess",
        kv_cache_bytes=budget,
        swa_bounded_replay=replay,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        max_model_len=512,
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for p in prefixes:  # one conversation per prefix, one after the other
        llm.generate(prompt_token_ids=[p + [1, 2, 3]], sampling_params=params, use_tqdm=False)
    again = llm.generate(prompt_token_ids=[prefixes[0] + [4, 5, 6]], sampling_params=params, use_tqdm=False)
    return again[0].num_cached_tokens


def test_same_bytes_keep_more_cached_prefixes_with_bounded_replay():
    # tiny: 2 full + 2 sliding layers, so a block of either group costs the same bytes.
    block = kv_block_bytes(kv_cache_group_specs(ModelConfig(), 16)[0], 4)
    budget = 100 * block  # cache everything: 50 blocks per group; replay: 25 window, 75 full
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 256, 160).tolist() for _ in range(6)]  # 10 blocks each
    # Six prefixes of 10 blocks: only the last few fit in 49 usable blocks, all of them in 74.
    assert _first_prefix_still_cached(False, budget, prefixes) == 0
    assert _first_prefix_still_cached(True, budget, prefixes) == 160
