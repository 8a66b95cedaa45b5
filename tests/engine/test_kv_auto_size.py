"""KV cache sized from the device's memory (CUDA with no num_blocks / kv_cache_bytes): each worker takes
gpu_memory_utilization of its device less what the device already holds, splits it as a kv_cache_bytes
budget is, and the engine runs the blocks it measured. The CPU has no device memory to measure; the
end-to-end tests here stand in a device of a given size (`fake_device`)."""

from __future__ import annotations

import pytest
import torch

from raystate import LLM, SamplingParams
from raystate.cli import build_parser
from raystate.config import DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig, EngineConfig, ModelConfig
from raystate.engine_args import EngineArgs, build_engine_config
from raystate.errors import InvalidRequest
from raystate.kv_layout import kv_block_bytes, plan_group_blocks
from raystate.launch import smallest_blocks
from raystate.worker.actor import shared_gpu_config
from raystate.worker.kv_cache import MAX_AUTO_BLOCKS, auto_group_blocks, auto_kv_budget, kv_cache_bytes

GiB = 2**30
TINY = ModelConfig.named("tiny")


def cuda_config(**cache) -> EngineConfig:
    return EngineConfig(model=TINY, cache=CacheConfig(**cache), device="cuda")


def test_the_budget_is_the_share_less_what_this_worker_holds():
    # 80 GiB device, the worker's weights and buffers 20 GiB: 0.9 * 80 - 20 = 52 GiB, if that much is free.
    assert auto_kv_budget(0.9, 80 * GiB, 59 * GiB, 20 * GiB) == int(0.9 * 80 * GiB) - 20 * GiB
    assert auto_kv_budget(1.0, 80 * GiB, 60 * GiB, 20 * GiB) == 60 * GiB
    # Other processes' memory does not change the budget (only whether it is free).
    assert auto_kv_budget(0.5, 80 * GiB, 30 * GiB, 10 * GiB) == 30 * GiB
    with pytest.raises(InvalidRequest, match=r"gpu_memory_utilization: must be above 0\.500") as e:
        auto_kv_budget(0.5, 80 * GiB, 40 * GiB, 40 * GiB)  # the weights alone fill the share
    assert "weights and buffers hold 40.0 GiB" in str(e.value)
    # The share asks more than is free (another process holds 30 GiB): at most (20 + 30) / 80.
    with pytest.raises(InvalidRequest, match=r"gpu_memory_utilization: must be at most 0\.625") as e:
        auto_kv_budget(0.9, 80 * GiB, 30 * GiB, 20 * GiB)
    assert "30.0 GiB free" in str(e.value)


def test_blocks_are_the_budget_split_as_kv_cache_bytes_is():
    config = cuda_config()
    groups = config.kv_groups
    budget = int(0.9 * 8 * GiB) - 3 * GiB
    counts = auto_group_blocks(config, groups, 8 * GiB, 5 * GiB, 3 * GiB)
    assert counts == plan_group_blocks(groups, budget, 2, True, 64, 2048)
    used = sum(kv_block_bytes(g, 2) * n for g, n in zip(groups, counts, strict=True))
    assert used <= budget
    # Room for less than two blocks a group: the error names the share, not kv_cache_bytes.
    total = 8 * GiB
    with pytest.raises(InvalidRequest, match="gpu_memory_utilization: must be a share that leaves"):
        auto_group_blocks(config, groups, total, GiB, int(0.9 * total) - 1000)


def test_shards_sharing_a_gpu_split_the_default_share():
    config = cuda_config()
    assert shared_gpu_config(config, 0.25).gpu_memory_utilization == pytest.approx(0.225)
    assert shared_gpu_config(config, 1.0) is config
    assert shared_gpu_config(config, 0.0) is config  # no GPU reserved: the whole default
    own = cuda_config(gpu_memory_utilization=0.3)
    assert shared_gpu_config(own, 0.25) is own  # the user's share is each shard's, as given
    sized = cuda_config(num_blocks=64)
    assert shared_gpu_config(sized, 0.25) is sized


def test_a_toy_model_on_a_big_device_stops_at_the_block_cap():
    config = cuda_config()  # tiny: 0.9 of 200 GiB would be ~26M blocks of its full-attention group
    counts = auto_group_blocks(config, config.kv_groups, 200 * GiB, 199 * GiB, GiB // 2)
    assert max(counts) == MAX_AUTO_BLOCKS
    assert counts == tuple(
        min(n, MAX_AUTO_BLOCKS)
        for n in plan_group_blocks(config.kv_groups, int(0.9 * 200 * GiB), 2, True, 64, 2048)
    )


def test_config_on_cuda_unsized_waits_for_the_workers_measure():
    config = cuda_config()
    assert config.kv_sized_at_start and config.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION
    with pytest.raises(RuntimeError, match="sized by its workers at start"):
        _ = config.group_num_blocks
    assert "sized by each worker at start, 0.9 of the device's memory" in config.kv_summary()
    fixed = config.with_group_blocks((300, 120))
    assert not fixed.kv_sized_at_start and fixed.group_num_blocks == (300, 120)
    assert fixed.num_blocks == 300 and "300 blocks" in fixed.kv_summary()
    with pytest.raises(InvalidRequest, match="group_blocks: must be one count per KV cache group"):
        config.with_group_blocks((300,))
    # Sized by the user, or on the CPU: nothing to measure.
    assert not cuda_config(num_blocks=64).kv_sized_at_start
    assert not cuda_config(kv_cache_bytes=GiB).kv_sized_at_start
    assert not EngineConfig(model=TINY).kv_sized_at_start


def test_bad_utilizations_are_refused_naming_the_field():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(InvalidRequest, match=r"gpu_memory_utilization: must be in \(0, 1\]"):
            CacheConfig(gpu_memory_utilization=bad)
    with pytest.raises(InvalidRequest, match="gpu_memory_utilization: must be unset when num_blocks"):
        CacheConfig(num_blocks=64, gpu_memory_utilization=0.8)
    with pytest.raises(InvalidRequest, match="gpu_memory_utilization: must be unset on the CPU"):
        EngineConfig(model=TINY, cache=CacheConfig(gpu_memory_utilization=0.8))
    with pytest.raises(InvalidRequest, match="group_blocks: must be each >= 2"):
        CacheConfig(group_blocks=(10, 1))


def test_the_knob_reaches_the_config_from_every_front_end():
    args = EngineArgs(device="cuda", gpu_memory_utilization=0.75)
    config = build_engine_config(args)
    assert config.gpu_memory_utilization == 0.75 and config.kv_sized_at_start
    flags = build_parser().parse_args(["serve", "--device", "cuda", "--gpu-memory-utilization", "0.6"])
    assert flags.gpu_memory_utilization == 0.6


def test_shards_run_the_smallest_count_of_each_group():
    assert smallest_blocks([(500, 90), (480, 95), (510, 90)]) == (480, 90)
    assert smallest_blocks([(7,)]) == (7,)


@pytest.fixture
def fake_device(monkeypatch):
    """Makes a CPU engine size its KV cache as a CUDA one does, on a device of `total` bytes of which
    `free` are free and `own` are this process's once the weights and buffers are loaded."""

    def install(total: int, free: int, own: int) -> None:
        monkeypatch.setattr(
            EngineConfig,
            "kv_sized_at_start",
            property(
                lambda c: (
                    c.cache.num_blocks is None and c.cache.kv_cache_bytes is None and not c.cache.group_blocks
                )
            ),
        )
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: own)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    return install


def test_an_engine_runs_the_blocks_its_worker_measured(fake_device):
    """Worker -> engine config -> scheduler pools -> KV tensors: one count everywhere, and requests run."""
    total = 4 * GiB
    own = int(0.9 * total) - (6 << 20)  # the weights and buffers leave 6 MiB of the share
    fake_device(total, 2 * GiB, own)
    llm = LLM(model="tiny", backend="inprocess", max_model_len=256, max_num_seqs=4)
    worker = llm.engine.worker
    counts = llm.config.group_num_blocks
    assert llm.config.cache.group_blocks == counts == worker.config.group_num_blocks
    groups = llm.config.kv_groups
    assert counts == plan_group_blocks(groups, 6 << 20, 4, True, 4, 2048)  # float32 on the CPU
    assert [p.num_blocks for p in llm.engine.scheduler.shards[0].kv.pools] == list(counts)
    assert kv_cache_bytes(groups, counts, torch.float32) <= 6 << 20
    for g, n in zip(groups, counts, strict=True):
        assert worker.kv_caches[g.layer_ids[0]][0].shape[0] == n
    outs = llm.generate(
        prompt_token_ids=[[1, 2, 3, 4] * 10, [9, 8, 7] * 20],
        sampling_params=SamplingParams(max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(o.token_ids) for o in outs] == [8, 8]


def test_a_device_already_full_fails_the_start_naming_the_field(fake_device):
    fake_device(4 * GiB, GiB // 8, 3 * GiB + 4 * GiB // 5)  # the weights and buffers hold 0.95 of it
    with pytest.raises(InvalidRequest, match=r"gpu_memory_utilization: must be above 0\.950"):
        LLM(model="tiny", backend="inprocess", max_model_len=256, max_num_seqs=4)


@pytest.mark.gpu
@pytest.mark.triton_kernels
def test_a_cuda_engine_sizes_its_cache_from_the_device(monkeypatch):
    """The real CUDA path (empty_cache, mem_get_info, allocation, graph capture over the sized cache),
    with the device's reading replaced so the size does not depend on what other test processes hold."""
    total = 80 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GiB, total))
    # This worker's weights and buffers leave 64 MiB of the 0.9 share for the KV cache.
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(0.9 * total) - (64 << 20))
    llm = LLM(model="tiny", backend="inprocess", device="cuda", max_model_len=256, max_num_seqs=8)
    counts = llm.config.group_num_blocks
    assert counts == plan_group_blocks(llm.config.kv_groups, 64 << 20, 2, True, 8, 2048)
    assert kv_cache_bytes(llm.config.kv_groups, counts, torch.bfloat16) <= 64 << 20
    assert llm.engine.worker.graphs is not None
    outs = llm.generate(
        prompt_token_ids=[[5, 6, 7] * 30], sampling_params=SamplingParams(max_tokens=16, ignore_eos=True)
    )
    assert len(outs[0].token_ids) == 16
