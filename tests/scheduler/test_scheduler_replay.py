"""DESIGN section 3 through the Scheduler, with a fake worker that checks every KV read."""

from sched_harness import (
    FakeWorker,
    blocks_sent,
    group_index,
    make_config,
    new_log,
    one_shard,
    reference_output,
    run,
    step,
)

from raystate.config import EOS_ID
from raystate.messages import SamplingParams, bytes_to_ids
from raystate.scheduler import Scheduler

W = 8  # sliding window = P, with block_size 4
PROMPT = list(range(1, 21))  # 20 tokens: 5 whole blocks


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def first_new_request(msgs, req_id):
    return next(r for m in msgs.values() for r in m.new_requests if r.req_id == req_id)


def cold_then_hit(config, suffix=(50, 51, 52)):
    """Runs "a" (PROMPT) to the end, then admits "b" (PROMPT + suffix); returns what that took."""
    sched = Scheduler(config)
    worker = FakeWorker(config)
    sched.add_request("a", PROMPT, greedy(3))
    log_a = run(sched, [worker])
    a_blocks = blocks_sent(log_a, "a")
    sched.add_request("b", PROMPT + list(suffix), greedy(3))
    log_b = new_log()
    msgs = step(sched, [worker], log_b)
    return sched, worker, a_blocks, first_new_request(msgs, "b"), log_b


def test_hit_longer_than_window_is_replayed():
    config = make_config()
    full, sliding = group_index(config, "full"), group_index(config, "sliding")
    sched, worker, a_blocks, new_b, log = cold_then_hit(config)
    assert new_b.num_computed == new_b.replay_start == 20 - W
    assert new_b.block_ids[full][:5] == a_blocks[full][:5]  # every hit block shared, replayed ones too
    assert new_b.block_ids[sliding][:3] == [0, 0, 0]  # null below replay_start
    assert all(new_b.block_ids[sliding][3:])  # fresh from there on
    assert new_b.num_scheduled == 23 - 12
    run(sched, [worker], log)  # the fake worker checked every read against the cold run's KV
    assert log.outputs["b"] == reference_output(PROMPT + [50, 51, 52], greedy(3), EOS_ID)
    final = log.finals["b"]
    assert (final.num_cached_tokens, final.replay_start) == (20, 12)
    stats = sched.stats()
    assert stats.prefix_hit_tokens == 20 and stats.replayed_tokens == W
    sched.check_integrity()


def test_replayed_rows_are_padded_in_cacheable_groups_only():
    config = make_config()
    sched, worker, _, new_b, log = cold_then_hit(config)
    run(sched, [worker], log)
    rows = [r for r in worker.log if r[0] == "b"]
    assert rows[0] == ("b", 12, 11, 12)  # prefill row: rs = replay_start
    assert all(rs == 0 for _, _, n, rs in rows[1:])  # decode rows run with 0


def test_chunk_inside_the_replay_range_allocates_no_cacheable_block():
    config = make_config(threshold=4)
    full, sliding = group_index(config, "full"), group_index(config, "sliding")
    sched, worker, a_blocks, new_b, log = cold_then_hit(config)
    assert new_b.num_scheduled == 4  # [12, 16): inside [replay_start, h) = [12, 20)
    assert new_b.block_ids[full] == a_blocks[full][:5]  # no new full block
    assert new_b.block_ids[sliding][:3] == [0, 0, 0] and len(new_b.block_ids[sliding]) == 4
    msgs = step(sched, [worker], log)  # [16, 20): still inside, still advances
    (delta,) = msgs[0].running
    assert (
        delta.num_scheduled == 4
        and delta.new_block_ids[full] == []
        and len(delta.new_block_ids[sliding]) == 1
    )
    msgs = step(sched, [worker], log)  # [20, 23): past h, new blocks in both groups
    (delta,) = msgs[0].running
    assert len(delta.new_block_ids[full]) == 1 and len(delta.new_block_ids[sliding]) == 1
    run(sched, [worker], log)
    assert log.outputs["b"] == reference_output(PROMPT + [50, 51, 52], greedy(3), EOS_ID)


def burst_after_cold(config, n=4, first_step_only=True):
    """Runs "a" (PROMPT) to the end, then adds b0..b{n-1} (PROMPT + a tail each) at once; returns the
    NewRequests of the step that admitted them."""
    sched = Scheduler(config)
    worker = FakeWorker(config)
    sched.add_request("a", PROMPT, greedy(3))
    run(sched, [worker])
    tails = {f"b{i}": [60 + i, 70 + i, 80] for i in range(n)}
    for req_id, tail in tails.items():
        sched.add_request(req_id, PROMPT + tail, greedy(3))
    log = new_log()
    msgs = step(sched, [worker], log)
    news = [first_new_request(msgs, req_id) for req_id in tails]
    return sched, worker, news, log, tails


def test_a_burst_with_one_hit_rebuilds_the_window_once():
    """Shared replay: the first request replays [12, 20), the others borrow those window blocks and start
    at the hit; the fake worker checks that every window read finds that prefix's KV."""
    config = make_config()
    sliding = group_index(config, "sliding")
    sched, worker, news, log, tails = burst_after_cold(config)
    donor, *borrowers = news
    assert donor.num_computed == donor.replay_start == 20 - W and donor.num_scheduled == 23 - 12
    window = donor.block_ids[sliding][3:5]  # the blocks over [replay_start, h) = [12, 20)
    assert all(window)
    for new in borrowers:
        assert (new.num_computed, new.replay_start, new.num_scheduled) == (20, 12, 3)
        assert new.block_ids[sliding][:5] == [0, 0, 0, *window]
        assert new.block_ids[sliding][5] not in window  # its own tokens get fresh blocks
    sched.check_integrity()  # a borrowed block counts one reference per holder
    run(sched, [worker], log)
    for req_id, tail in tails.items():
        assert log.outputs[req_id] == reference_output(PROMPT + tail, greedy(3), EOS_ID)
        assert (log.finals[req_id].num_cached_tokens, log.finals[req_id].replay_start) == (20, 12)
    stats = sched.stats()
    assert stats.replayed_tokens == W and stats.shared_replay_tokens == 3 * W
    sched.check_integrity()


def test_share_replay_off_replays_every_request():
    sched, worker, news, log, tails = burst_after_cold(make_config(share_replay=False))
    assert all(new.num_computed == new.replay_start == 12 for new in news)
    run(sched, [worker], log)
    for req_id, tail in tails.items():
        assert log.outputs[req_id] == reference_output(PROMPT + tail, greedy(3), EOS_ID)
    stats = sched.stats()
    assert stats.replayed_tokens == 4 * W and stats.shared_replay_tokens == 0


def test_a_donor_must_replay_the_whole_hit_in_its_first_chunk():
    """Chunks of 4 tokens end inside [12, 20): no request rebuilds the window in one step, so none can
    lend it and each replays its own."""
    sched, worker, news, log, tails = burst_after_cold(make_config(threshold=4))
    assert all((new.num_computed, new.num_scheduled) == (12, 4) for new in news)
    run(sched, [worker], log)
    for req_id, tail in tails.items():
        assert log.outputs[req_id] == reference_output(PROMPT + tail, greedy(3), EOS_ID)
    assert sched.stats().shared_replay_tokens == 0


def test_a_later_step_never_borrows():
    """The donor's window blocks are released as it advances, so only its own step may borrow them."""
    sched, worker = one_shard()
    sched.add_request("a", PROMPT, greedy(3))
    run(sched, [worker])
    log = new_log()
    sched.add_request("b0", PROMPT + [1, 2, 3], greedy(6))
    step(sched, [worker], log)
    sched.add_request("b1", PROMPT + [4, 5, 6], greedy(6))
    new_b1 = first_new_request(step(sched, [worker], log), "b1")
    assert new_b1.num_computed == new_b1.replay_start == 12
    run(sched, [worker], log)
    assert log.outputs["b1"] == reference_output(PROMPT + [4, 5, 6], greedy(6), EOS_ID)
    sched.check_integrity()


def test_hit_of_exactly_the_window_is_ignored():
    sched, worker = one_shard()
    sched.add_request("a", PROMPT[:8] + [90, 91], greedy(2))  # caches 2 blocks = W tokens
    run(sched, [worker])
    sched.add_request("b", PROMPT[:8] + [70, 71, 72], greedy(2))
    log = new_log()
    new_b = first_new_request(step(sched, [worker], log), "b")
    assert (new_b.num_computed, new_b.replay_start) == (0, 0)
    run(sched, [worker], log)
    assert log.finals["b"].num_cached_tokens == 0 and sched.stats().prefix_hit_tokens == 0


def test_full_prompt_hit_computes_the_last_token():
    sched, worker = one_shard()
    prompt = PROMPT[:16]
    sched.add_request("a", prompt, greedy(2))
    log = run(sched, [worker])
    sched.add_request("b", prompt, greedy(2))
    msgs = step(sched, [worker], log)
    new_b = first_new_request(msgs, "b")
    assert new_b.num_computed == new_b.replay_start == 12 - W  # h capped to 12 < 16
    run(sched, [worker], log)
    assert log.outputs["b"] == log.outputs["a"]


def test_window_blocks_are_released_while_decoding():
    config = make_config(num_blocks=64)
    full, sliding = group_index(config, "full"), group_index(config, "sliding")
    sched = Scheduler(config)
    worker = FakeWorker(config)
    sched.add_request("a", PROMPT, greedy(40))
    step(sched, [worker])
    for _ in range(30):
        step(sched, [worker])
        computed = sched.get_request("a").num_computed
        in_use = [63 - n for n in sched.stats().num_free_blocks[0]]
        assert in_use[full] == -(-computed // 4)  # full attention keeps every block
        assert in_use[sliding] <= W // 4 + 2
    run(sched, [worker])
    sched.check_integrity()


def test_bounded_replay_off_caches_everything():
    config = make_config(bounded_replay=False)
    full, sliding = group_index(config, "full"), group_index(config, "sliding")
    sched, worker, a_blocks, new_b, log = cold_then_hit(config)
    assert (new_b.num_computed, new_b.replay_start) == (20, 0)
    assert new_b.block_ids[sliding][:5] == a_blocks[sliding][:5]  # window blocks shared too
    assert new_b.block_ids[full][:5] == a_blocks[full][:5]
    run(sched, [worker], log)
    assert log.outputs["b"] == reference_output(PROMPT + [50, 51, 52], greedy(3), EOS_ID)
    assert sched.stats().replayed_tokens == 0


def test_prefix_caching_off_recomputes():
    config = make_config(caching=False)
    sched, worker, _, new_b, log = cold_then_hit(config)
    assert (new_b.num_computed, new_b.replay_start) == (0, 0)
    run(sched, [worker], log)
    assert log.finals["b"].num_cached_tokens == 0 and sched.stats().prefix_hit_tokens == 0


def test_preemption_then_readmission_with_a_fresh_replay_start():
    sched, worker = one_shard(num_blocks=17)  # 16 blocks per group: a and b cannot both reach 42 tokens
    prompts = {"a": list(range(1, 13)), "b": list(range(20, 32))}
    for req_id, prompt in prompts.items():
        sched.add_request(req_id, prompt, greedy(30))
    log = new_log()
    preempted_at = readmitted = None
    while sched.has_unfinished():
        msgs = step(sched, [worker], log)
        msg = msgs.get(0)
        if msg is None:
            continue
        if msg.preempted_ids:
            assert msg.preempted_ids == ["b"]  # the latest arrival goes first
            preempted_at = list(log.outputs["b"])
            assert sched.get_request("b").num_computed == 0
        if preempted_at is not None and readmitted is None:
            readmitted = next((r for r in msg.new_requests if r.req_id == "b"), None)
    assert preempted_at is not None and readmitted is not None
    # Sent anew with its whole history, from a fresh DESIGN 3 admission (its own prefix is still cached).
    assert bytes_to_ids(readmitted.token_ids) == prompts["b"] + preempted_at
    assert readmitted.num_prompt_tokens == 12
    assert readmitted.replay_start > 0 and readmitted.num_computed == readmitted.replay_start
    assert log.finals["b"].replay_start == readmitted.replay_start
    assert log.finals["b"].num_cached_tokens == readmitted.replay_start + W
    for req_id, prompt in prompts.items():
        assert log.outputs[req_id] == reference_output(prompt, greedy(30), EOS_ID)
    assert sched.stats().num_preemptions == 1
    sched.check_integrity()


def test_routing_prefers_the_shard_holding_the_prefix():
    config = make_config()
    sched = Scheduler(config, num_shards=2)
    workers = [FakeWorker(config), FakeWorker(config)]
    sched.add_request("x", [200] * 6, greedy(1))  # least loaded: shard 0
    sched.add_request("a", PROMPT, greedy(2))  # shard 1
    assert [sched.get_request(r).shard for r in ("x", "a")] == [0, 1]
    run(sched, workers)
    sched.add_request("y", [201] * 6, greedy(50))  # ties go to shard 0
    sched.add_request("b", PROMPT + [7], greedy(2))  # 12 saved tokens on shard 1 vs one request on shard 0
    assert sched.get_request("y").shard == 0 and sched.get_request("b").shard == 1
    msgs = step(sched, workers)
    assert set(msgs) == {0, 1}
    assert first_new_request(msgs, "b").replay_start == 20 - W
    run(sched, workers)
    sched.check_integrity()


def test_reset_shard_resends_requests_in_full():
    config = make_config()
    sched = Scheduler(config)
    worker = FakeWorker(config)
    sched.add_request("a", PROMPT, greedy(10))
    log = new_log()
    for _ in range(4):
        step(sched, [worker], log)
    assert sched.reset_shard(0) == ["a"]
    sched.check_integrity()
    worker = FakeWorker(config)  # the restarted worker knows nothing
    outputs = list(log.outputs["a"])
    msgs = step(sched, [worker], log)
    new = first_new_request(msgs, "a")
    assert bytes_to_ids(new.token_ids) == PROMPT + outputs and new.num_computed == 0
    run(sched, [worker], log)
    assert log.outputs["a"] == reference_output(PROMPT, greedy(10), EOS_ID)
