"""Scheduler step policy, finishing rules, abort, validation and the wire messages it produces."""

import pytest
from sched_harness import FakeWorker, make_config, new_log, one_shard, reference_output, run, step

from raystate.config import EOS_ID
from raystate.errors import InvalidRequest
from raystate.messages import SamplingParams, StepMessage, StepResult, decode_step, encode, ids_to_bytes
from raystate.scheduler import RequestStatus, Scheduler


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def prompt(start: int, n: int) -> list[int]:
    return [(start + i) % 200 for i in range(n)]


def rows(msg: StepMessage) -> list[tuple[str, int]]:
    """(req_id, num_scheduled) of the message's batch rows, in row order."""
    new = [(r.req_id, r.num_scheduled) for r in msg.new_requests if r.num_scheduled]
    return new + [(d.req_id, d.num_scheduled) for d in msg.running]


# -- end to end --------------------------------------------------------------------------------------------


def test_many_requests_produce_the_reference_tokens_and_leave_the_pools_clean():
    sched, worker = one_shard(max_num_seqs=4, max_batched=24, threshold=8, num_blocks=40)
    prompts = [prompt(7 * i, 5 + 6 * i) for i in range(8)]
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", p, greedy(6 + i))
    log = run(sched, [worker])
    for i, p in enumerate(prompts):
        assert log.outputs[f"r{i}"] == reference_output(p, greedy(6 + i), EOS_ID)
        assert log.finals[f"r{i}"].finish_reason == "length"
    assert not sched.has_unfinished()
    sched.check_integrity()
    for pool in sched.shards[0].kv.pools:  # free + cached == total - 1
        assert pool.num_in_use == 0 and pool.num_free + pool.num_evictable == pool.num_blocks - 1
    # The last requests' finished ids still travel with the next message.
    msgs = sched.schedule()
    assert msgs[0].finished_ids and not rows(msgs[0])


def test_step_messages_survive_msgspec():
    config = make_config(threshold=4)
    sched = Scheduler(config)
    sched.add_request("a", prompt(0, 10), greedy(3, stop_token_ids=[5], seed=3))
    sched.add_request("b", prompt(50, 3), greedy(3))
    msg = sched.schedule()[0]
    assert msg.new_requests and decode_step(encode(msg)) == msg
    worker = FakeWorker(config)
    sched.update(0, worker.execute(msg))
    sched.abort("b")
    msg = sched.schedule()[0]
    assert msg.running and msg.finished_ids == ["b"]
    assert decode_step(encode(msg)) == msg


# -- budgets and order -------------------------------------------------------------------------------------


def test_max_num_seqs_limits_running_requests():
    sched, worker = one_shard(max_num_seqs=2)
    for i in range(3):
        sched.add_request(f"r{i}", prompt(i, 4), greedy(3))
    msgs = step(sched, [worker])
    assert [r.req_id for r in msgs[0].new_requests] == ["r0", "r1"]
    while sched.get_request("r0") is not None:
        msgs = step(sched, [worker])
        assert sum(s for _, s in rows(msgs[0])) and len(rows(msgs[0])) <= 2
    assert sched.get_request("r2").status == RequestStatus.WAITING
    msgs = step(sched, [worker])
    assert [r.req_id for r in msgs[0].new_requests] == ["r2"]


def test_token_budget_chunks_prefills():
    sched, worker = one_shard(max_batched=10)
    sched.add_request("a", prompt(0, 8), greedy(2))
    sched.add_request("b", prompt(30, 8), greedy(2))
    log = new_log()
    msgs = step(sched, [worker], log)
    assert rows(msgs[0]) == [("a", 8), ("b", 2)]
    msgs = step(sched, [worker], log)
    assert rows(msgs[0]) == [("a", 1), ("b", 6)]  # a decodes, b finishes its prompt
    run(sched, [worker], log)
    assert log.outputs["b"] == reference_output(prompt(30, 8), greedy(2), EOS_ID)


def test_long_prefill_threshold_caps_every_chunk():
    sched, worker = one_shard(max_batched=100, threshold=3)
    sched.add_request("a", prompt(0, 10), greedy(2))
    log = run(sched, [worker])
    chunks = [n for req_id, _, n, _ in worker.log if req_id == "a"]
    assert chunks == [3, 3, 3, 1, 1]
    assert log.outputs["a"] == reference_output(prompt(0, 10), greedy(2), EOS_ID)


def test_decodes_first_then_partial_prefills_then_waiting():
    sched, worker = one_shard(max_batched=3, threshold=1)
    sched.add_request("long", prompt(0, 10), greedy(2))
    sched.add_request("d1", prompt(40, 1), greedy(5))
    sched.add_request("d2", prompt(60, 1), greedy(5))
    msgs = step(sched, [worker])
    assert rows(msgs[0]) == [("long", 1), ("d1", 1), ("d2", 1)]
    sched.add_request("late", prompt(80, 1), greedy(2))
    msgs = step(sched, [worker])
    # Decodes (d1, d2) before the earlier-arrived partial prefill; nothing left for "late".
    assert rows(msgs[0]) == [("d1", 1), ("d2", 1), ("long", 1)]
    assert not msgs[0].new_requests and sched.get_request("late").status == RequestStatus.WAITING


def test_waiting_queue_is_first_come_first_served():
    sched, worker = one_shard(num_blocks=9)  # 8 blocks per group = 32 tokens
    sched.add_request("a", prompt(0, 16), greedy(4))
    step(sched, [worker])
    sched.add_request("big", prompt(50, 20), greedy(2))  # needs 6 blocks: does not fit next to a
    sched.add_request("small", prompt(100, 2), greedy(2))  # would fit, but waits behind "big"
    order = []
    while sched.has_unfinished():
        msgs = step(sched, [worker])
        order += [r.req_id for m in msgs.values() for r in m.new_requests]
    assert order == ["big", "small"]
    sched.check_integrity()


def test_preemption_takes_the_latest_arrival_first():
    sched, worker = one_shard(num_blocks=13, max_num_seqs=3)  # 12 blocks per group
    for i in range(3):
        sched.add_request(f"r{i}", prompt(30 * i, 8), greedy(12))
    log = new_log()
    preempted = []
    while sched.has_unfinished():
        msgs = step(sched, [worker], log)
        preempted += [p for m in msgs.values() for p in m.preempted_ids]
    assert preempted and preempted[0] == "r2"
    assert sched.stats().num_preemptions == len(preempted)
    for i in range(3):
        assert log.outputs[f"r{i}"] == reference_output(prompt(30 * i, 8), greedy(12), EOS_ID)
    sched.check_integrity()


def test_a_shard_with_a_step_in_flight_gets_no_message():
    config = make_config()
    sched = Scheduler(config)
    sched.add_request("a", prompt(0, 4), greedy(3))
    msg = sched.schedule()[0]
    assert sched.schedule() == {}
    sched.update(0, FakeWorker(config).execute(msg))
    assert 0 in sched.schedule()


# -- finishing ---------------------------------------------------------------------------------------------


def finish_one(sampling: SamplingParams, script: list[int]):
    config = make_config()
    sched = Scheduler(config)
    worker = FakeWorker(config, scripts={"a": script})
    sched.add_request("a", prompt(0, 5), sampling)
    log = run(sched, [worker])
    final = log.finals["a"]
    assert final.finished and sched.get_request("a") is None
    assert log.outputs["a"] == reference_output(prompt(0, 5), sampling, EOS_ID, script)
    sched.check_integrity()
    return log.outputs["a"], final.finish_reason


def test_finish_on_max_tokens():
    out, reason = finish_one(SamplingParams(max_tokens=4), [])
    assert len(out) == 4 and reason == "length"


def test_finish_on_eos():
    out, reason = finish_one(SamplingParams(max_tokens=8), [11, EOS_ID, 12])
    assert out == [11, EOS_ID] and reason == "stop"


def test_ignore_eos_runs_to_max_tokens():
    out, reason = finish_one(SamplingParams(max_tokens=4, ignore_eos=True), [EOS_ID, EOS_ID])
    assert out[:2] == [EOS_ID, EOS_ID] and len(out) == 4 and reason == "length"


def test_stop_token_is_kept_in_the_output():
    out, reason = finish_one(SamplingParams(max_tokens=8, stop_token_ids=[42, 43]), [1, 2, 43, 5])
    assert out == [1, 2, 43] and reason == "stop"


def test_stop_wins_over_length_on_the_same_token():
    out, reason = finish_one(SamplingParams(max_tokens=2), [1, EOS_ID])
    assert out == [1, EOS_ID] and reason == "stop"


def test_finished_ids_go_to_the_next_message_and_blocks_are_freed():
    sched, worker = one_shard()
    sched.add_request("a", prompt(0, 6), greedy(1))
    sched.add_request("b", prompt(20, 6), greedy(3))
    step(sched, [worker])  # both prefill; a samples its only token and finishes
    assert sched.get_request("a") is None
    msgs = step(sched, [worker])
    assert msgs[0].finished_ids == ["a"] and rows(msgs[0]) == [("b", 1)]
    assert "a" not in worker.reqs
    sched.check_integrity()


# -- abort -------------------------------------------------------------------------------------------------


def test_abort_waiting_running_and_in_flight():
    sched, worker = one_shard(max_num_seqs=2)
    for req_id in ("a", "b", "c"):
        sched.add_request(req_id, prompt(ord(req_id), 6), greedy(5))
    step(sched, [worker])
    assert sched.abort("c")  # waiting: never sent
    msg = sched.schedule()[0]
    assert sched.abort("b")  # in flight: its result is ignored, its blocks freed now
    updates = sched.update(0, worker.execute(msg))
    assert [u.req_id for u in updates] == ["a"]
    msg = sched.schedule()[0]
    assert msg.finished_ids == ["b"] and [d.req_id for d in msg.running] == ["a"]
    sched.update(0, worker.execute(msg))
    assert not sched.abort("b") and not sched.abort("nope")
    assert sched.get_request("b") is None and sched.get_request("c") is None
    run(sched, [worker])
    sched.check_integrity()


# -- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "sampling", "field"),
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ([1, 259], SamplingParams(), "prompt_token_ids"),
        ([1, 2**40], SamplingParams(), "prompt_token_ids"),
        ([1, "x"], SamplingParams(), "prompt_token_ids"),
        (list(range(100)), SamplingParams(max_tokens=200), "max_tokens"),
        ([1] * 256, SamplingParams(max_tokens=1), "prompt_token_ids"),
        ([1], SamplingParams(max_tokens=0), "max_tokens"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(stop_token_ids=[999]), "stop_token_ids"),
    ],
)
def test_invalid_requests_name_the_field_and_lose_nothing(tokens, sampling, field):
    sched, worker = one_shard(max_model_len=256)
    sched.add_request("ok", prompt(0, 5), greedy(3))
    step(sched, [worker])
    with pytest.raises(InvalidRequest) as info:
        sched.add_request("bad", tokens, sampling)
    assert info.value.field == field and isinstance(info.value, ValueError)
    assert field in str(info.value)
    assert sched.get_request("bad") is None
    log = run(sched, [worker])
    assert len(log.outputs["ok"]) == 2  # one token came with the first step
    sched.check_integrity()


def test_duplicate_id_and_a_request_larger_than_the_kv_cache():
    config = make_config(num_blocks=5)  # 4 blocks of 4 tokens per group
    sched = Scheduler(config)
    sched.add_request("a", prompt(0, 4), greedy(2))
    with pytest.raises(InvalidRequest) as info:
        sched.add_request("a", prompt(0, 4), greedy(2))
    assert info.value.field == "req_id"
    with pytest.raises(InvalidRequest) as info:
        sched.add_request("b", prompt(0, 10), greedy(7))
    assert info.value.field == "max_tokens" and "KV cache" in str(info.value)


# -- results -----------------------------------------------------------------------------------------------


def test_update_rejects_a_result_that_does_not_match_the_step():
    config = make_config()
    sched = Scheduler(config)
    sched.add_request("a", prompt(0, 4), greedy(3))
    with pytest.raises(RuntimeError, match="no step in flight"):
        sched.update(0, StepResult(step_id=1, req_ids=[], sampled=b""))
    msg = sched.schedule()[0]
    with pytest.raises(ValueError, match="step_id"):
        sched.update(0, StepResult(step_id=msg.step_id + 1, req_ids=["a"], sampled=ids_to_bytes([1])))
    with pytest.raises(ValueError, match="req_ids"):
        sched.update(0, StepResult(step_id=msg.step_id, req_ids=["z"], sampled=ids_to_bytes([1])))
    updates = sched.update(0, StepResult(step_id=msg.step_id, req_ids=["a"], sampled=ids_to_bytes([9])))
    assert [(u.req_id, u.new_token_ids, u.finished) for u in updates] == [("a", [9], False)]
    assert sched.get_request("a").output_token_ids == [9]
