"""How the scheduler actor sends one step to its shards and gathers the answers.

Two interchangeable dispatchers with one interface (`submit`, `in_flight`, `num_in_flight`, `collect`,
`close`):
`CompiledDispatch`, one Ray compiled graph over every shard's `execute` (all shards step in lockstep,
~0.1-0.2 ms a round trip), and `ActorDispatch`, plain actor calls (each shard steps as soon as it
answered; ~1 ms a round trip). Errors come back per shard, so the actor can recover just those.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import ray
from ray.exceptions import GetTimeoutError

from raystate.messages import StepMessage, encode

IDLE_STEP = encode(StepMessage(step_id=0))  # what a shard with nothing to do gets (answer ignored)


class CompiledDispatch:
    """One compiled graph over every live shard's `execute`; all shards step together."""

    lockstep = True

    def __init__(self, workers: dict[int, object]) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self.shards = sorted(workers)
        with InputNode() as inp:
            outs = [workers[s].execute.bind(inp[i]) for i, s in enumerate(self.shards)]
            self.dag = MultiOutputNode(outs).experimental_compile()
        self._refs: deque = deque()  # executions in flight, oldest first (two with async scheduling)

    def submit(self, payloads: dict[int, bytes]) -> None:
        self._refs.append(self.dag.execute(*[payloads.get(s, IDLE_STEP) for s in self.shards]))

    def in_flight(self) -> bool:
        return bool(self._refs)

    def num_in_flight(self) -> int:
        return len(self._refs)

    def collect(self, timeout_s: float) -> tuple[dict[int, bytes], dict[int, BaseException]]:
        """The oldest execution's answers (the graph answers in submission order)."""
        ref = self._refs.popleft()
        try:
            outs = ray.get(ref, timeout=timeout_s)
        except Exception as e:  # a dead actor, a channel error or a timeout: every shard's answer is lost
            return {}, {s: e for s in self.shards}
        return dict(zip(self.shards, outs, strict=True)), {}

    def close(self) -> None:
        self._refs.clear()
        with contextlib.suppress(Exception):  # an actor of the graph may be gone already
            self.dag.teardown()


class ActorDispatch:
    """Plain actor calls; each shard steps as soon as it answered its last message."""

    lockstep = False

    def __init__(self, workers: dict[int, object]) -> None:
        self.workers = dict(workers)
        self._refs: dict[int, tuple[object, float]] = {}  # shard -> (ref, deadline)

    def submit(self, payloads: dict[int, bytes]) -> None:
        for s, data in payloads.items():
            self._refs[s] = (self.workers[s].execute.remote(data), 0.0)

    def in_flight(self) -> bool:
        return bool(self._refs)

    def num_in_flight(self) -> int:
        return len(self._refs)

    def collect(self, timeout_s: float) -> tuple[dict[int, bytes], dict[int, BaseException]]:
        now = time.monotonic()
        for s, (ref, deadline) in self._refs.items():
            if not deadline:
                self._refs[s] = (ref, now + timeout_s)
        by_ref = {ref: s for s, (ref, _) in self._refs.items()}
        wait_s = max(0.0, min(d for _, d in self._refs.values()) - now)
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=wait_s)
        if ready:  # take every answer already there
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        results, errors = {}, {}
        for ref in ready:
            s = by_ref[ref]
            del self._refs[s]
            try:
                results[s] = ray.get(ref)
            except Exception as e:
                errors[s] = e
        now = time.monotonic()
        for s in [s for s, (_, deadline) in self._refs.items() if deadline <= now]:
            del self._refs[s]
            errors[s] = GetTimeoutError(f"shard {s}: no answer within the step timeout")
        return results, errors

    def close(self) -> None:
        self._refs.clear()
