"""The Ray transports of a step: a compiled graph over every shard, or plain actor calls.

`CompiledDispatch`, one Ray compiled graph over every shard's `execute` (all shards step in lockstep,
~0.1-0.2 ms a round trip), and `ActorDispatch`, plain actor calls (each shard steps as soon as it
answered; ~1 ms a round trip). `PipelinedCompiledDispatch` is the compiled graph whose workers may answer
a step with the next message's reply (async scheduling; dispatch.PipelinedDispatch). All keep the
dispatch.py contract, so the step loop drives each the same way. Errors come back per shard, so the
scheduler actor can recover just those.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import ray
from ray.exceptions import GetTimeoutError

from raystate.scheduler.dispatch import (
    IDLE_STEP,
    Answers,
    DispatchRefused,
    LockstepDispatch,
    PipelinedDispatch,
)


class _ShardGraph:
    """A compiled graph over one method of every live shard's worker: each node takes its shard's payload
    (an empty step for a shard with nothing to do, so the graph's fan-out stays fixed), then the inputs
    every node shares. Both compiled dispatchers send and read through it."""

    def __init__(self, workers: dict[int, object], method: str, num_shared: int = 0) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self.shards = sorted(workers)
        n = len(self.shards)
        with InputNode() as inp:
            shared = [inp[n + j] for j in range(num_shared)]
            outs = [getattr(workers[s], method).bind(inp[i], *shared) for i, s in enumerate(self.shards)]
            self.dag = MultiOutputNode(outs).experimental_compile()

    def send(self, payloads: dict[int, bytes], *shared):
        try:
            return self.dag.execute(*[payloads.get(s, IDLE_STEP) for s in self.shards], *shared)
        except Exception as e:  # the graph refused the input
            raise DispatchRefused(e) from e

    def read(self, ref, timeout_s: float | None) -> tuple[dict[int, object], dict[int, BaseException]]:
        try:
            outs = ray.get(ref, timeout=timeout_s)
        except Exception as e:  # a dead actor, a channel error or a timeout: every shard's answer is lost
            return {}, {s: e for s in self.shards}
        return dict(zip(self.shards, outs, strict=True)), {}

    def teardown(self) -> None:
        with contextlib.suppress(Exception):  # an actor of the graph may be gone already
            self.dag.teardown()


class CompiledDispatch(LockstepDispatch):
    """One compiled graph over every live shard's `execute`; all shards step together."""

    def __init__(self, workers: dict[int, object]) -> None:
        super().__init__()
        self.graph = _ShardGraph(workers, "execute")

    def _send(self, payloads: dict[int, bytes]):
        return self.graph.send(payloads)

    def _wait(self, ref, timeout_s: float | None) -> tuple[dict[int, bytes], dict[int, BaseException]]:
        return self.graph.read(ref, timeout_s)

    def close(self) -> None:
        super().close()
        self.graph.teardown()


class PipelinedCompiledDispatch(PipelinedDispatch):
    """One compiled graph over every live shard's `execute_behind`: the graph's input is every shard's
    message, whether to hold its answer, and this graph's id (a worker drops a step held for another
    graph); each shard's output, the results that message finished."""

    def __init__(self, workers: dict[int, object]) -> None:
        super().__init__()
        self.graph = _ShardGraph(workers, "execute_behind", num_shared=2)
        self.graph_id = uuid.uuid4().hex

    def _send(self, payloads: dict[int, bytes], hold: bool):
        return self.graph.send(payloads, hold, self.graph_id)

    def _read(self, ref, timeout_s: float | None) -> tuple[dict[int, list[bytes]], dict[int, BaseException]]:
        return self.graph.read(ref, timeout_s)

    def close(self) -> None:
        super().close()
        self.graph.teardown()


class ActorDispatch:
    """Plain actor calls; each shard steps as soon as it answered its last message."""

    lockstep = False

    def __init__(self, workers: dict[int, object]) -> None:
        self.workers = dict(workers)
        self._refs: dict[int, tuple[object, float]] = {}  # shard -> (ref, deadline)
        self._sent: dict[int, float] = {}  # shard -> submit time, for tracked steps in flight

    def submit(self, payloads: dict[int, bytes], track: bool = True) -> None:
        now = time.perf_counter()
        for s, data in payloads.items():
            if track:
                self._sent[s] = now
            try:
                self._refs[s] = (self.workers[s].execute.remote(data), 0.0)
            except Exception as e:
                raise DispatchRefused(e) from e

    def num_in_flight(self) -> int:
        return len(self._refs)

    def collect(self, timeout_s: float | None = None) -> Answers:
        """Every answer already there, waiting for the first one up to the step timeout."""
        now = time.monotonic()
        for s, (ref, deadline) in self._refs.items():
            if not deadline:
                self._refs[s] = (ref, now + timeout_s)
        by_ref = {ref: s for s, (ref, _) in self._refs.items()}
        wait_s = max(0.0, min(d for _, d in self._refs.values()) - now)
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=wait_s)
        if ready:  # take every answer already there
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        results, sent_at, errors = {}, {}, {}
        for ref in ready:
            s = by_ref[ref]
            del self._refs[s]
            try:
                data = ray.get(ref)
            except Exception as e:
                errors[s] = e
                continue
            if s in self._sent:
                results[s] = data
                sent_at[s] = self._sent.pop(s)
        now = time.monotonic()
        for s in [s for s, (_, deadline) in self._refs.items() if deadline <= now]:
            del self._refs[s]
            errors[s] = GetTimeoutError(f"shard {s}: no answer within the step timeout")
        lost = {s for s in errors if self._sent.pop(s, None) is not None}
        return Answers(results, sent_at, errors, lost)

    def abandon(self) -> set[int]:
        """After a refused submission: the tracked steps in flight are lost (their answers, if any come,
        are dropped)."""
        lost = set(self._sent)
        self._sent.clear()
        return lost

    def close(self) -> None:
        self._refs.clear()
        self._sent.clear()
