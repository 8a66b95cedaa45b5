"""Seeded random workloads through the scheduler and the checking fake worker: shared prefixes, chunking,
preemption, aborts and two shards. Every KV read is checked, the pools are checked after every step, and
every request that was not aborted must produce exactly the reference tokens."""

import random

import pytest
from sched_harness import FakeWorker, make_config, new_log, reference_output, step

from raystate.config import EOS_ID
from raystate.messages import SamplingParams
from raystate.scheduler import Scheduler


@pytest.mark.parametrize(
    ("caching", "bounded", "num_shards", "seed"),
    [(True, True, 1, 0), (True, True, 2, 1), (True, False, 1, 2), (False, True, 1, 3), (True, True, 1, 4)],
)
def test_random_workload(caching, bounded, num_shards, seed):
    rng = random.Random(seed)
    config = make_config(
        num_blocks=rng.choice([24, 40]),
        caching=caching,
        bounded_replay=bounded,
        max_num_seqs=rng.choice([3, 6]),
        max_batched=rng.choice([16, 48]),
        threshold=rng.choice([0, 5]),
        max_model_len=96,
    )
    sched = Scheduler(config, num_shards=num_shards)
    workers = [FakeWorker(config) for _ in range(num_shards)]
    prefixes = [[rng.randrange(256) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    log = new_log()
    for n in range(400):
        if len(expected) < 40 and rng.random() < 0.3:
            req_id = f"r{len(expected)}"
            prompt = rng.choice(prefixes)[: rng.randint(4, 30)] + [
                rng.randrange(256) for _ in range(rng.randint(0, 12))
            ]
            sampling = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True)
            sched.add_request(req_id, prompt, sampling)
            expected[req_id] = reference_output(prompt, sampling, EOS_ID)
        if expected and rng.random() < 0.03:
            victim = rng.choice(sorted(expected))
            if sched.abort(victim):
                aborted.add(victim)
        step(sched, workers, log)
        sched.check_integrity()
        if n > 300 and not sched.has_unfinished():
            break
    while sched.has_unfinished():
        assert step(sched, workers, log)
        sched.check_integrity()
    for req_id, tokens in expected.items():
        if req_id not in aborted:
            assert log.outputs[req_id] == tokens, req_id
            assert log.finals[req_id].finish_reason == "length"
    for shard in sched.shards:
        for pool in shard.kv.pools:
            assert pool.num_in_use == 0 and pool.num_free + pool.num_evictable == pool.num_blocks - 1
    stats = sched.stats()
    if caching:
        assert stats.prefix_hit_tokens > 0
    if not bounded or not caching:
        assert stats.replayed_tokens == 0
