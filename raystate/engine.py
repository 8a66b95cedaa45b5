"""The in-process backend: the scheduler and one worker in one process.

It is the debugging backend and the seam the Ray backend drops into: the scheduler plans `StepMessage`s,
each is encoded once and decoded by the worker exactly as it would be across an actor boundary, and the
worker's `StepResult` goes back to the scheduler the same way.

Profile mode (`engine.profile = True`) times every step by phase into `engine.step_times`, for the
benchmarks' step-time breakdown; off (the default), a step pays one `if` for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from raystate.config import EngineConfig
from raystate.messages import SamplingParams, decode_result, decode_step, encode
from raystate.scheduler import RequestUpdate, Scheduler
from raystate.worker.worker import PendingStep, Worker

# The phases of a profiled step, in the order they run; `StepTiming` has one field of seconds per phase.
PHASES = ("schedule", "dispatch", "prepare", "forward", "sample", "update")


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Seconds one profiled `InProcessEngine.step()` spent in each phase.

    schedule: `Scheduler.schedule`; dispatch: encoding and decoding the message and the result (what the
    actor boundary costs); prepare, forward, sample: the worker's phases (`Worker.last_phases`); update:
    `Scheduler.update`. On CUDA the worker synchronizes the device at its phase boundaries, so each phase
    includes its GPU work. `total` is the whole step by wall clock; the rest beyond the phases' sum is
    loop and call overhead.
    """

    schedule: float
    dispatch: float
    prepare: float
    forward: float
    sample: float
    update: float
    total: float
    num_rows: int  # batch rows the worker ran (0: nothing was scheduled)
    num_tokens: int  # tokens scheduled (prefill chunks and decodes)


class InProcessEngine:
    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.config = config
        self.scheduler = Scheduler(config, num_shards=1)
        self.worker = worker if worker is not None else Worker(config)
        self.step_times: list[StepTiming] = []  # one per step while `profile` is on
        self._pending: list[tuple[int, PendingStep]] = []  # launched, not yet finished (async scheduling)

    @property
    def profile(self) -> bool:
        """On: each step appends a `StepTiming` to `step_times` (and the worker syncs a CUDA device at its
        phase boundaries, which costs a little throughput)."""
        return self.worker.profile

    @profile.setter
    def profile(self, on: bool) -> None:
        self.worker.profile = bool(on)

    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        self.scheduler.add_request(req_id, prompt_token_ids, sampling)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestUpdate]:
        """One scheduling round. With async scheduling the next decode step is planned and launched
        before the step in flight is finished, so the returned updates may be the previous step's (the
        host's scheduling, message and bookkeeping work overlaps the device's)."""
        if self.worker.profile:
            return self._finish_pending() + self._profiled_step()
        if not self.config.async_scheduling:
            updates: list[RequestUpdate] = []
            for shard, msg in self.scheduler.schedule().items():
                result = decode_result(encode(self.worker.execute(decode_step(encode(msg)))))
                updates.extend(self.scheduler.update(shard, result))
            return updates
        launched = [
            (shard, self.worker.launch(decode_step(encode(msg))))
            for shard, msg in self.scheduler.schedule(lookahead=True).items()
        ]
        updates = self._finish_pending()
        self._pending = launched
        return updates

    def _finish_pending(self) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        pending, self._pending = self._pending, []
        for shard, launched in pending:
            result = decode_result(encode(self.worker.finish(launched)))
            updates.extend(self.scheduler.update(shard, result))
        return updates

    def _profiled_step(self) -> list[RequestUpdate]:
        """`step` with a clock read between phases; the worker times its own three."""
        clock = time.perf_counter_ns
        t_start = clock()
        updates: list[RequestUpdate] = []
        messages = self.scheduler.schedule()
        t = clock()
        ns = dict.fromkeys(PHASES, 0)
        ns["schedule"] = t - t_start
        rows = tokens = 0
        for shard, msg in messages.items():
            wire_msg = decode_step(encode(msg))
            t1 = clock()
            out = self.worker.execute(wire_msg)
            t2 = clock()
            result = decode_result(encode(out))
            t3 = clock()
            updates.extend(self.scheduler.update(shard, result))
            t4 = clock()
            prepare, forward, sample = self.worker.last_phases
            ns["dispatch"] += (t1 - t) + (t3 - t2)
            ns["prepare"] += prepare
            ns["forward"] += forward
            ns["sample"] += sample
            ns["update"] += t4 - t3
            rows += len(result.req_ids)
            tokens += sum(r.num_scheduled for r in msg.new_requests)
            tokens += sum(d.num_scheduled for d in msg.running)
            t = clock()  # this bookkeeping is in `total` only
        self.step_times.append(
            StepTiming(
                **{k: v * 1e-9 for k, v in ns.items()},
                total=(clock() - t_start) * 1e-9,
                num_rows=rows,
                num_tokens=tokens,
            )
        )
        return updates

    def shutdown(self) -> None:
        self._finish_pending()
