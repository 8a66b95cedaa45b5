"""The Ray backend through its client APIs on one 2-shard deployment: the `Client` contract front ends rely
on, `Cluster.add_request` / `stream`, named actors, a torch-free scheduler, and routing (issue 4, test 4)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import ray
from ray_harness import (
    TEST_OPTIONS,
    collect,
    distinct_prompts,
    engine_config,
    greedy,
    inprocess_outputs,
    llm_kwargs,
)

from raystate import LLM, InvalidRequest, SamplingParams
from raystate.cluster import Cluster
from raystate.fanout import child_requests

NAME = "test-cluster"


@pytest.fixture(scope="module")
def cluster(local_ray):
    cluster = Cluster.start(engine_config(), name=NAME, num_shards=2, **TEST_OPTIONS)
    yield cluster
    cluster.stop()


def _idle(cluster: Cluster, timeout_s: float = 10.0) -> dict:
    """Waits until no request runs or waits; returns the status."""

    async def wait() -> dict:
        for _ in range(int(timeout_s / 0.05)):
            status = await cluster.status()
            if not any(status["num_running"]) and not any(status["num_waiting"]):
                return status
            await asyncio.sleep(0.05)
        raise AssertionError(f"still busy: {status}")

    return asyncio.run(wait())


def test_actors_are_named_in_the_deployment_namespace(cluster):
    assert cluster.deployment.dispatch == "compiled"
    scheduler = ray.get_actor("scheduler", namespace=NAME)
    where = [ray.get(ray.get_actor(f"worker-{i}", namespace=NAME).where.remote()) for i in range(2)]
    assert [w["shard"] for w in where] == [0, 1]
    assert all(w["device"] == "cpu" for w in where)
    assert ray.get(scheduler.get_config.remote()) == cluster.config


def test_scheduler_actor_never_imports_torch(cluster):
    heavy = ["torch", "triton", "raystate.model", "raystate.worker.worker", "raystate.kernels"]
    assert ray.get(cluster.scheduler.loaded_modules.remote([*heavy, "ray", "msgspec"])) == ["ray", "msgspec"]


def test_client_side_modules_never_import_torch():
    """Front ends import the cluster and launch modules; the model stays in the worker actors."""
    code = (
        "import sys, raystate.cluster, raystate.launch, raystate.scheduler.actor, raystate.worker.actor;"
        "print(','.join(m for m in ('torch', 'triton', 'raystate.model') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_generate_streams_in_order_and_equals_inprocess(cluster):
    prompts = distinct_prompts(seed=1, num=5)
    (want,) = inprocess_outputs([prompts], max_tokens=6)

    async def one(prompt):
        updates = [u async for u in cluster.generate(prompt, greedy(6))]
        return updates

    async def run_all():
        return await asyncio.gather(*(one(p) for p in prompts))

    for updates, w in zip(asyncio.run(run_all()), want, strict=True):
        assert [u.finished for u in updates] == [False] * 5 + [True]
        assert [t for u in updates for t in u.new_token_ids] == w.token_ids
        assert updates[-1].finish_reason == "length"
        assert len({u.req_id for u in updates}) == 1


def test_invalid_request_raises_before_anything_is_queued(cluster):
    async def bad(prompt, params):
        async for _ in cluster.generate(prompt, params):
            pass

    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        asyncio.run(bad([1, 2, 259], greedy(4)))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        asyncio.run(bad([1] * 100, greedy(1000)))
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        asyncio.run(bad([1, "x"], greedy(4)))

    async def duplicate_id():
        first = cluster.generate([1, 2, 3], greedy(50), request_id="dup")
        await first.__anext__()
        try:
            with pytest.raises(InvalidRequest, match="request_id"):
                await cluster.generate([4, 5], greedy(4), request_id="dup").__anext__()
        finally:
            await first.aclose()

    asyncio.run(duplicate_id())
    _idle(cluster)


def test_closing_a_stream_early_aborts_and_abort_ends_a_stream(cluster):
    async def run():
        gen = cluster.generate([5, 6, 7], greedy(400))
        first = [await gen.__anext__(), await gen.__anext__()]
        await gen.aclose()  # the caller went away
        updates = []
        async for u in cluster.generate([8, 9, 10], greedy(400), request_id="to-abort"):
            updates.append(u)
            if len(updates) == 2:
                await cluster.abort("to-abort")
        return first, updates

    first, updates = asyncio.run(run())
    assert not any(u.finished for u in first)
    assert updates[-1].finished and updates[-1].finish_reason == "abort"
    assert 2 <= len(updates) < 400
    _idle(cluster)


def test_health_runs_a_step_on_every_shard_and_status_reports(cluster):
    before = asyncio.run(cluster.status())
    assert asyncio.run(cluster.health())
    status = asyncio.run(cluster.status())
    assert status["backend"] == "ray" and status["num_shards"] == 2 and status["live_shards"] == [0, 1]
    assert status["dispatch"] == "compiled" and status["error"] is None
    assert status["steps"] > before.get("steps", 0)
    assert status["step_time_p50_us"] > 0 and "dispatch_time_p50_us" in status


def test_connect_by_name_streams_outputs_and_leaves_the_deployment_running(cluster):
    with pytest.raises(InvalidRequest, match="name"):
        Cluster.connect("no-such-deployment")
    other = Cluster.connect(NAME)
    assert other.config == cluster.config
    prompts = distinct_prompts(seed=2, num=3)

    async def run():
        rids = [await other.add_request(p, greedy(5)) for p in prompts]
        return rids, await collect(other)

    rids, out = asyncio.run(run())
    assert sorted(out) == sorted(rids)
    assert all(len(tokens) == 5 and last.finished for tokens, last in out.values())
    asyncio.run(other.shutdown())  # a connected client closes; the deployment stays
    assert asyncio.run(cluster.health())


def test_requests_follow_their_cached_prefix_while_distinct_ones_spread(cluster):
    """Routing: saved prefill tokens on a shard minus 128 tokens per request it holds (router.py)."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 256, 320).tolist()  # 20 blocks: a hit saves 320 - W = 288 tokens of prefill

    async def run():
        owner_id = await cluster.add_request(prefix + [1, 2, 3, 4, 5], greedy(40))
        owner_shard = await cluster.request_shard(owner_id)
        await collect(cluster)  # the owner finishes; its prefix stays cached on its shard
        flood = [await cluster.add_request(p, greedy(300)) for p in distinct_prompts(seed=6, num=8)]
        flood_shards = [await cluster.request_shard(r) for r in flood]
        followers = [await cluster.add_request(prefix + [9, i], greedy(4)) for i in range(2)]
        follower_shards = [await cluster.request_shard(r) for r in followers]
        for r in flood:
            await cluster.abort(r)
        out = await collect(cluster)
        return owner_shard, flood_shards, follower_shards, [out[r][1] for r in followers]

    owner_shard, flood_shards, follower_shards, follower_last = asyncio.run(run())
    assert sorted(np.bincount(flood_shards, minlength=2)) == [4, 4]  # least loaded wins without hits
    assert follower_shards == [owner_shard, owner_shard]
    assert [(u.num_cached_tokens, u.replay_start) for u in follower_last] == [(320, 288)] * 2
    _idle(cluster)


def test_generate_group_forks_a_prompts_choices_on_its_shard(cluster):
    """n = 3 choices submitted as one group: the later two are forked from the first on its shard (two
    shards here: a fork needs them on one) and each equals its seed's in-process choice."""
    prompt = distinct_prompts(seed=9, num=1, low=100, high=101)[0]
    params = SamplingParams(n=3, max_tokens=5, temperature=0.9, seed=3, ignore_eos=True)
    children = child_requests("fork-group", prompt, params)
    before = asyncio.run(cluster.status())["forked_tokens"]

    async def run():
        streams = await cluster.generate_group(children)
        return [[t async for u in s for t in u.new_token_ids] for s in streams]

    outs = asyncio.run(run())
    assert asyncio.run(cluster.status())["forked_tokens"] - before == 2 * (99 // 16 * 16)
    (want,) = LLM(backend="inprocess", **llm_kwargs()).generate(
        prompt_token_ids=prompt, sampling_params=params, use_tqdm=False
    )
    assert outs == [o.token_ids for o in want.outputs]
    _idle(cluster)


def test_a_reader_behind_gets_the_queued_updates_as_one_delta(cluster):
    """The served path over this backend: a `Generation` whose reader fell behind (here: it waits until
    the request finished) gets every queued update merged into one delta, tokens and logprob records
    those of the in-process run."""
    from raystate.fanout import ChildRequest
    from raystate.messages import unpack_logprobs
    from raystate.serve.generation import Generation, Prepared, PromptPart
    from raystate.serve.metrics import ServeMetrics

    prompt = distinct_prompts(seed=11, num=1)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    prep = Prepared("behind", "completions", [PromptPart(prompt, params)], None, True, False)

    async def run():
        child = ChildRequest("behind", prompt, params, None, 0)
        (updates,) = await cluster.generate_group([child])
        gen = Generation(cluster, prep, ServeMetrics(), set(), child, updates, text=None)
        await gen.start()
        for _ in range(1000):  # the last update was handed over: the rest lies queued
            if "behind" not in cluster._sinks:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return [d async for d in gen.deltas()], gen

    deltas, gen = asyncio.run(run())
    (want,) = LLM(backend="inprocess", **llm_kwargs()).generate(
        prompt_token_ids=prompt, sampling_params=params, use_tqdm=False
    )
    assert len(deltas) == 1 and deltas[0].finish_reason == "length"  # the first update's, and the rest
    assert deltas[0].token_ids == gen.token_ids == want.outputs[0].token_ids
    ids, _, _ = unpack_logprobs(bytes(gen.logprobs))
    assert ids.shape == (8, 3) and ids[:, 0].tolist() == gen.token_ids
    _idle(cluster)
