"""Helpers for the Ray backend tests: deployment options that fit a 2-CPU machine, prompts, the
in-process reference run, and collecting a cluster's stream."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from raystate import LLM, SamplingParams
from raystate.config import EngineConfig
from raystate.engine_args import EngineArgs, build_engine_config

# Worker actors run the kernels' PyTorch references (fast on the CPU).
WORKER_ENV = {"RAYSTATE_KERNELS": "reference"}
# Two shards at half a CPU each plus a zero-CPU scheduler fit in ray.init(num_cpus=2); quick fault checks.
TEST_OPTIONS = dict(
    num_cpus_per_shard=0.5, worker_env=WORKER_ENV, probe_interval_s=1.0, respawn_timeout_s=20.0
)
MAX_MODEL_LEN = 512


def llm_kwargs(swa_bounded_replay: bool = True) -> dict:
    """The engine knobs of these tests, as `LLM(**llm_kwargs())` takes them."""
    return dict(
        model="tiny", device="cpu", max_model_len=MAX_MODEL_LEN, swa_bounded_replay=swa_bounded_replay
    )


def engine_config(swa_bounded_replay: bool = True) -> EngineConfig:
    """The same knobs through the one builder, for `Cluster.start`."""
    return build_engine_config(EngineArgs(**llm_kwargs(swa_bounded_replay)))


def distinct_prompts(seed: int, num: int, low: int = 5, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(low, high))).tolist() for _ in range(num)]


def shared_prefix_prompts(seed: int, num: int, prefix_len: int) -> list[list[int]]:
    """`num` prompts: two families, each sharing about `prefix_len` ids, plus random tails."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, 256, prefix_len).tolist() for _ in range(2)]
    return [
        bases[i % 2][: prefix_len - int(rng.integers(0, 8))]
        + rng.integers(0, 256, int(rng.integers(3, 20))).tolist()
        for i in range(num)
    ]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def inprocess_outputs(calls: list[list[list[int]]], max_tokens: int, swa_bounded_replay: bool = True):
    """The in-process backend's outputs for the same generate calls (each a batch of prompts), in order."""
    assert os.environ.get("RAYSTATE_KERNELS") == "reference"
    llm = LLM(backend="inprocess", **llm_kwargs(swa_bounded_replay))
    return [
        llm.generate(prompt_token_ids=prompts, sampling_params=greedy(max_tokens), use_tqdm=False)
        for prompts in calls
    ]


async def collect(cluster, on_update=None) -> dict[str, list]:
    """Drains `cluster.stream()`: request id -> [token ids, last update]; `on_update(n)` after each."""
    out: dict[str, list] = {}
    n = 0
    async for u in cluster.stream():
        entry = out.setdefault(u.req_id, [[], None])
        entry[0].extend(u.new_token_ids)
        entry[1] = u
        n += 1
        if on_update is not None:
            await on_update(n)
    return out


def run_with_fault(cluster, prompts, max_tokens: int, fault, after_updates: int = 40):
    """Generates `prompts` through `cluster.add_request`, calls `fault()` once `after_updates` updates
    arrived; returns the token ids in prompt order and the seconds from the fault to the last update."""
    fault_at = []

    async def on_update(n):
        if n == after_updates:
            fault_at.append(time.monotonic())
            fault()

    async def run():
        rids = [await cluster.add_request(p, greedy(max_tokens)) for p in prompts]
        out = await collect(cluster, on_update)
        return [out[r][0] for r in rids], [out[r][1] for r in rids]

    tokens, last = asyncio.run(run())
    assert fault_at, "the fault never fired: the run was too short"
    assert all(u.finished and u.finish_reason == "length" for u in last)
    return tokens, time.monotonic() - fault_at[0]
