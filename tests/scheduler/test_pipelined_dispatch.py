"""Answers one message late: `WorkerActor.execute_behind` and the dispatcher that reads them
(`PipelinedDispatch`, whose Ray form is the compiled graph's). The random workloads of test_lookahead.py
run through both; these pin down each rule on its own."""

from __future__ import annotations

import pytest
from sched_harness import BehindDispatch, FakeWorker, make_config

from raystate.messages import StepMessage, StepResult, decode_result, encode
from raystate.scheduler.dispatch import IDLE_STEP
from raystate.worker.actor import WorkerActor


class _EchoWorker:
    """Launches return a handle whose answer is read at `finish` (a graph decode step's way), unless the
    message's step id is odd: then the answer is there at launch (a step that ran on the host)."""

    config = make_config()

    def launch(self, msg: StepMessage):
        answer = StepResult(msg.step_id, [], b"")
        if msg.step_id % 2:
            return answer
        return _Handle(answer)

    def finish(self, pending):
        return pending.answer if isinstance(pending, _Handle) else pending

    def reset(self) -> int:
        return 0


class _Handle:
    result = None

    def __init__(self, answer) -> None:
        self.answer = answer


def _actor() -> WorkerActor:
    actor = WorkerActor(_EchoWorker.config, 0, dry_run=True)
    actor.worker = _EchoWorker()
    return actor


def _ids(answers: list[bytes]) -> list[int]:
    return [decode_result(a).step_id for a in answers]


def _msg(step_id: int) -> bytes:
    return encode(StepMessage(step_id=step_id))


def test_a_step_still_running_is_held_and_answered_with_the_next_message():
    actor = _actor()
    assert _ids(actor.execute_behind(_msg(2), True, "g")) == []  # held
    assert _ids(actor.execute_behind(_msg(4), True, "g")) == [2]  # 4 launched, then 2 answered; 4 held
    assert _ids(actor.execute_behind(_msg(5), True, "g")) == [4, 5]  # 5 was done at launch: not held
    assert _ids(actor.execute_behind(_msg(6), False, "g")) == [6]  # not to be held
    assert _ids(actor.execute_behind(_msg(8), True, "g")) == []
    assert _ids(actor.execute_behind(IDLE_STEP, False, "g")) == [8, 0]  # a flush


def test_a_step_held_for_another_dispatcher_or_before_a_reset_is_dropped():
    actor = _actor()
    actor.execute_behind(_msg(2), True, "old graph")
    assert _ids(actor.execute_behind(_msg(4), True, "new graph")) == []  # 2 dropped, 4 held
    actor.reset()
    assert _ids(actor.execute_behind(_msg(6), False, "new graph")) == [6]


def test_the_dispatcher_flushes_a_held_step_with_nothing_sent_after_it():
    config = make_config()
    dispatch = BehindDispatch([FakeWorker(config), FakeWorker(config)])
    dispatch.submit({0: _msg(2)})  # shard 1 gets an idle step, held too
    assert dispatch.num_in_flight() == 1
    answers = dispatch.collect()
    assert dispatch.flushes == 1 and dispatch.num_in_flight() == 0
    assert list(answers.results) == [0] and decode_result(answers.results[0]).step_id == 2
    assert not answers.errors and not answers.lost
    # Two in flight, the second sent before the first is collected: no flush for the first.
    dispatch.submit({0: _msg(4), 1: _msg(4)})
    dispatch.submit({0: _msg(6), 1: _msg(6)})
    assert decode_result(dispatch.collect().results[1]).step_id == 4
    assert dispatch.flushes == 1
    assert decode_result(dispatch.collect().results[1]).step_id == 6
    assert dispatch.flushes == 2 and dispatch.held_counts == [0, 2, 0, 1, 2]


class _FailingRead(BehindDispatch):
    def _read(self, handle, timeout_s):
        return {}, {0: RuntimeError("channel closed"), 1: RuntimeError("channel closed")}


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_failed_reply_loses_every_step_in_flight(in_flight):
    config = make_config()
    dispatch = _FailingRead([FakeWorker(config), FakeWorker(config)])
    dispatch.submit({0: _msg(2)})
    if in_flight == 2:
        dispatch.submit({1: _msg(4)})
    answers = dispatch.collect()
    assert not answers.results and set(answers.errors) == {0, 1}
    assert answers.lost == ({0, 1} if in_flight == 2 else {0})
    assert dispatch.num_in_flight() == 0
