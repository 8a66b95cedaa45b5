"""Async scheduling: a decode step planned on top of the step in flight (`schedule(lookahead=True)`).

The random workloads run through the real step loop with lookahead (`StepDriver`, as the in-process
engine and the scheduler actor run it): step N+1 is launched before step N's answer is applied. The
checking fake worker verifies every KV read and the outputs must equal the reference tokens, with EOS and
stop ids (a row planned for a request that then stops is dropped), max_tokens, preemption, aborts and two
shards."""

import random

import pytest
from sched_harness import FakeWorker, driver, make_config, new_log, record, reference_output

from raystate.config import EOS_ID
from raystate.messages import SamplingParams
from raystate.scheduler import Scheduler


def async_step(loop, sched, workers, log) -> bool:
    """One pass of the loop, checked; True when it planned a step on top of one in flight."""
    done = loop.step()
    record(done, sched, workers, log)
    sched.check_integrity()
    return done.lookahead


def _decode_ready(sched, workers, prompts):
    """Admits the prompts and runs synchronously until every request is decoding."""
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True))
    while True:
        msg = sched.schedule()[0]
        sched.update(0, workers[0].execute(msg))
        if not msg.new_requests and all(d.num_scheduled == 1 for d in msg.running):
            return


def test_lookahead_plans_one_decode_row_per_steady_request():
    config = make_config(max_num_seqs=4)
    sched = Scheduler(config)
    workers = [FakeWorker(config)]
    _decode_ready(sched, workers, [[5] * 9, [7] * 13])
    first = sched.schedule()[0]
    assert [d.num_scheduled for d in first.running] == [1, 1]
    ahead = sched.schedule(lookahead=True)[0]  # r0 and r1 are in flight: one more token each
    assert [(d.req_id, d.num_scheduled) for d in ahead.running] == [("r0", 1), ("r1", 1)]
    assert sched.schedule(lookahead=True) == {}  # one step of lookahead at most
    assert sched.schedule() == {}  # and none without lookahead while steps are in flight
    for msg in (first, ahead):
        sched.update(0, workers[0].execute(msg))
    sched.check_integrity()


def test_no_lookahead_while_a_waiting_request_could_start():
    config = make_config(max_num_seqs=4)
    sched = Scheduler(config)
    workers = [FakeWorker(config)]
    _decode_ready(sched, workers, [[5] * 9])
    msg = sched.schedule()[0]
    sched.add_request("late", [3] * 6, SamplingParams(max_tokens=2))
    assert sched.schedule(lookahead=True) == {}  # the admission waits for a normal step
    sched.update(0, workers[0].execute(msg))
    assert [r.req_id for r in sched.schedule()[0].new_requests] == ["late"]


def test_a_request_whose_token_in_flight_is_its_last_gets_no_lookahead_row():
    config = make_config()
    sched = Scheduler(config)
    workers = [FakeWorker(config)]
    sched.add_request("short", [4] * 5, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add_request("long", [6] * 5, SamplingParams(max_tokens=9, ignore_eos=True))
    msg = sched.schedule()[0]  # prefills: each samples its first token
    sched.update(0, workers[0].execute(msg))
    msg = sched.schedule()[0]  # decode: "short" samples its second and last token here
    ahead = sched.schedule(lookahead=True)[0]
    assert [d.req_id for d in ahead.running] == ["long"]


@pytest.mark.parametrize(
    ("num_shards", "seed", "answer_behind"),
    [(1, 0, False), (2, 1, False), (1, 2, False), (1, 3, False), (1, 4, True), (2, 5, True)],
)
def test_random_workload_with_lookahead_matches_the_reference(num_shards, seed, answer_behind):
    """`answer_behind`: the workers answer each step with the next message (as over Ray's compiled graph,
    `PipelinedDispatch`), and the dispatcher flushes when nothing follows a held step."""
    rng = random.Random(seed)
    config = make_config(
        num_blocks=rng.choice([24, 40]),
        max_num_seqs=rng.choice([3, 6]),
        max_batched=rng.choice([16, 48]),
        threshold=rng.choice([0, 5]),
        max_model_len=96,
    )
    sched = Scheduler(config, num_shards=num_shards)
    scripts: dict[str, list[int]] = {}
    workers = [FakeWorker(config) for _ in range(num_shards)]
    for w in workers:
        w.scripts = scripts  # filled as requests arrive
    prefixes = [[rng.randrange(256) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    log = new_log()
    loop = driver(sched, workers, lookahead=True, answer_behind=answer_behind)
    lookaheads = 0
    for n in range(600):
        if len(expected) < 40 and rng.random() < 0.2:
            req_id = f"r{len(expected)}"
            prompt = rng.choice(prefixes)[: rng.randint(4, 30)] + [
                rng.randrange(256) for _ in range(rng.randint(0, 12))
            ]
            kind = rng.random()
            if kind < 0.3:  # stops on EOS after a few tokens
                scripts[req_id] = [rng.randrange(256) for _ in range(rng.randint(0, 6))] + [EOS_ID]
                sampling = SamplingParams(max_tokens=30)
            elif kind < 0.5:  # stops on a stop id
                stop = rng.randrange(256)
                scripts[req_id] = [(stop + 1) % 256] * rng.randint(0, 5) + [stop]
                sampling = SamplingParams(max_tokens=30, stop_token_ids=[stop])
            else:
                sampling = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True)
            sched.add_request(req_id, prompt, sampling)
            expected[req_id] = reference_output(prompt, sampling, EOS_ID, scripts.get(req_id, ()))
        if expected and rng.random() < 0.02:
            victim = rng.choice(sorted(expected))
            if sched.abort(victim):
                aborted.add(victim)
        lookaheads += async_step(loop, sched, workers, log)
        if n > 400 and not sched.has_unfinished() and not loop.in_flight:
            break
    while sched.has_unfinished() or loop.in_flight:
        async_step(loop, sched, workers, log)
    for req_id, tokens in expected.items():
        if req_id not in aborted:
            assert log.outputs[req_id] == tokens, req_id
    assert lookaheads >= 10  # the workload really exercised planning on top of a step in flight
    if answer_behind:  # messages answered nothing (the first after a flush), a held step, or held + flush
        assert set(loop.dispatcher.held_counts) == {0, 1, 2}
        # A step's answer comes with the next message only when that one was planned on top of it (a
        # lookahead step); every other step sent is flushed once.
        sent = sum(1 for msgs in log.messages if msgs)
        assert loop.dispatcher.flushes == sent - lookaheads
    for shard in sched.shards:
        for pool in shard.kv.pools:
            assert pool.num_in_use == 0 and pool.num_free + pool.num_evictable == pool.num_blocks - 1
