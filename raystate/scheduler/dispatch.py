"""How one step reaches its shards, and what is in flight: the dispatcher contract and its bookkeeping.

A dispatcher sends each shard its encoded StepMessage (`submit`) and brings the encoded StepResults back
(`collect`), oldest first. It also keeps the books of what is in flight: which shards got a real message
(`track`), when, and which of those steps a fault lost, so the step loop (driver.py) need not know how
a transport answers. Three kinds:

- lockstep (`LockstepDispatch`): every submission is one execution over all of its shards, answered
  whole and in submission order; a failed execution loses every execution still in flight. The Ray
  compiled graph (ray_dispatch.py) and `LocalDispatch`, the in-process one, are of this kind.
- per shard (the Ray `ActorDispatch`): each shard answers on its own; a fault loses that shard's step only.
- lockstep, answered one message late (`PipelinedDispatch`; over Ray, `PipelinedCompiledDispatch`): a
  worker may hold a step whose device work still runs and answer it with the next message's reply.

Probes and benchmarks send untracked payloads (`round_trip`): their answers never reach the scheduler.
No ray here: the in-process engine and the scheduler tests use `LocalDispatch` without it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from raystate.messages import StepMessage, decode_step, encode

IDLE_STEP = encode(StepMessage(step_id=0))  # what a shard with nothing to do gets (answer ignored)


class DispatchRefused(Exception):
    """The transport would not take a submission (a torn-down graph, a dead actor handle): every step in
    flight on it is lost. `cause` is the transport's own error."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(repr(cause))
        self.cause = cause


@dataclasses.dataclass(slots=True)
class Answers:
    """What one `collect` brought back."""

    results: dict[int, bytes]  # shard -> encoded StepResult, for tracked steps only
    sent_at: dict[int, float]  # shard -> when its step was submitted (time.perf_counter)
    errors: dict[int, BaseException]  # shard -> why its answer is missing (tracked or not)
    lost: set[int]  # shards whose tracked step in flight is gone: their state must be reset


class LockstepDispatch:
    """Executions over a fixed set of shards, answered in submission order. Subclasses send (`_send`) and
    wait (`_wait`); this class keeps, per execution in flight, the tracked shards and their submit time."""

    lockstep = True

    def __init__(self) -> None:
        self._sent: deque[dict[int, float]] = deque()  # per execution in flight, oldest first
        self._handles: deque = deque()

    def _send(self, payloads: dict[int, bytes]):
        raise NotImplementedError

    def _wait(self, handle, timeout_s: float | None) -> tuple[dict[int, bytes], dict[int, BaseException]]:
        raise NotImplementedError

    def submit(self, payloads: dict[int, bytes], track: bool = True) -> None:
        """Starts one execution; raises DispatchRefused when the transport would not take it."""
        sent = dict.fromkeys(payloads, time.perf_counter()) if track else {}
        handle = self._send(payloads)
        self._sent.append(sent)
        self._handles.append(handle)

    def num_in_flight(self) -> int:
        return len(self._handles)

    def collect(self, timeout_s: float | None = None) -> Answers:
        """The oldest execution's answers. A failed execution loses every one still in flight."""
        sent = self._sent.popleft()
        outs, errors = self._wait(self._handles.popleft(), timeout_s)
        if errors:
            lost = set(sent).union(*self._sent)
            self._sent.clear()
            self._handles.clear()
            return Answers({}, sent, errors, lost)
        return Answers({s: outs[s] for s in sent}, sent, {}, set())

    def abandon(self) -> set[int]:
        """After a refused submission: forgets every execution in flight; returns their tracked shards."""
        lost = set().union(*self._sent)
        self._sent.clear()
        self._handles.clear()
        return lost

    def close(self) -> None:
        self._sent.clear()
        self._handles.clear()


@dataclasses.dataclass(slots=True)
class _Execution:
    sent: dict[int, float]  # tracked shard -> submit time
    flush: bool = False  # sent by `collect` only to get the held answers back (never reported)


class PipelinedDispatch:
    """Lockstep executions whose answers may come one message late: every tracked execution lets the
    workers hold its answer (`WorkerActor.execute_behind`: a step whose device work is still running is
    held), so a worker launches step N+1 before it finishes step N and answers N with N+1's reply; the
    device stays busy while the answer travels, the scheduler plans, and the next message comes. For the
    step loop with async scheduling, which sends N+1 before it collects N. When `collect` finds the
    oldest step's answer held with nothing sent after it, it sends a flush (an empty step, not held) to
    get it. Untracked executions (probes, benchmarks) are never held. Each shard answers its executions
    in order; a failed execution loses every one in flight.

    Subclasses send (`_send(payloads, hold) -> handle`) and read a handle (`_read(handle, timeout_s) ->
    ({shard: [encoded StepResult, ...]}, errors)`: per shard, the results that message finished, oldest
    first: 0, 1 or 2).
    """

    lockstep = True

    def __init__(self) -> None:
        self._executions: deque[_Execution] = deque()  # sent, not collected; oldest first
        self._unread: deque = deque()  # handles not read yet, oldest first
        self._arrived: dict[int, deque[bytes]] = {}  # shard -> answers read, not collected, oldest first
        self.flushes = 0  # flushes sent: a held step collected with no step launched after it

    def _send(self, payloads: dict[int, bytes], hold: bool):
        raise NotImplementedError

    def _read(
        self, handle, timeout_s: float | None
    ) -> tuple[dict[int, list[bytes]], dict[int, BaseException]]:
        raise NotImplementedError

    def submit(self, payloads: dict[int, bytes], track: bool = True) -> None:
        self._submit(payloads, track, flush=False)

    def _submit(self, payloads: dict[int, bytes], track: bool, flush: bool) -> None:
        sent = dict.fromkeys(payloads, time.perf_counter()) if track else {}
        self._unread.append(self._send(payloads, track))
        self._executions.append(_Execution(sent, flush))

    def num_in_flight(self) -> int:
        return sum(not e.flush for e in self._executions)

    def collect(self, timeout_s: float | None = None) -> Answers:
        """The oldest execution's answers (after a flush when one is held with nothing sent after it)."""
        while True:
            while self._executions[0].flush and self._oldest_answered():
                self._pop_oldest()
            if self._oldest_answered():
                sent = self._executions[0].sent
                outs = self._pop_oldest()
                return Answers({s: outs[s] for s in sent}, sent, {}, set())
            if not self._unread:  # every reply was read and the oldest answer is still held
                self.flushes += 1
                try:
                    self._submit({}, track=False, flush=True)
                except DispatchRefused as e:
                    return self._lose_all({s: e.cause for s in self._executions[0].sent})
            outs, errors = self._read(self._unread.popleft(), timeout_s)
            if errors:
                return self._lose_all(errors)
            for s, results in outs.items():
                self._arrived.setdefault(s, deque()).extend(results)

    def _oldest_answered(self) -> bool:
        return bool(self._arrived) and all(self._arrived.values())

    def _pop_oldest(self) -> dict[int, bytes]:
        self._executions.popleft()
        return {s: answers.popleft() for s, answers in self._arrived.items()}

    def _lose_all(self, errors: dict[int, BaseException]) -> Answers:
        sent = self._executions[0].sent if self._executions else {}
        return Answers({}, sent, errors, self.abandon())

    def abandon(self) -> set[int]:
        """After a refused submission: forgets every execution in flight; returns their tracked shards."""
        lost = set().union(*(e.sent for e in self._executions))
        self._executions.clear()
        self._unread.clear()
        self._arrived.clear()
        return lost

    def close(self) -> None:
        self.abandon()


class LocalDispatch(LockstepDispatch):
    """In-process workers: each message is decoded as a worker actor would decode it and launched at once;
    `collect` finishes the oldest launch and encodes its answer. Errors propagate as they are.

    A worker has `launch(StepMessage) -> handle` and `finish(handle) -> StepResult` (the real worker
    queues its device work in `launch`, so the next step can be planned while it runs). `worker_ns` adds
    up the time spent inside the workers, which a profile subtracts to get the wire's own cost.
    """

    def __init__(self, workers: dict) -> None:
        super().__init__()
        self.workers = workers
        self.worker_ns = 0

    def _send(self, payloads: dict[int, bytes]) -> dict:
        clock = time.perf_counter_ns
        handles = {}
        for s, data in payloads.items():
            msg = decode_step(data)
            t = clock()
            handles[s] = self.workers[s].launch(msg)
            self.worker_ns += clock() - t
        return handles

    def _wait(self, handles: dict, timeout_s: float | None) -> tuple[dict[int, bytes], dict]:
        clock = time.perf_counter_ns
        outs = {}
        for s, handle in handles.items():
            t = clock()
            result = self.workers[s].finish(handle)
            self.worker_ns += clock() - t
            outs[s] = encode(result)
        return outs, {}


def round_trip(dispatch, payloads: dict[int, bytes], timeout_s: float | None) -> None:
    """Sends untracked payloads and waits for every answer (idle probes, benchmarks); raises the first
    error, the transport's own."""
    try:
        dispatch.submit(payloads, track=False)
    except DispatchRefused as e:
        raise e.cause from None
    while dispatch.num_in_flight():
        errors = dispatch.collect(timeout_s).errors
        if errors:
            raise next(iter(errors.values()))
