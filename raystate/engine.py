"""The in-process backend: the scheduler and one worker in one process.

It is the debugging backend and the seam the Ray backend drops into: the same step loop (`StepDriver`)
drives it, over `LocalDispatch` instead of Ray, so each `StepMessage` is encoded once and decoded by the
worker exactly as it would be across an actor boundary, and the worker's `StepResult` goes back to the
scheduler the same way. With async scheduling the next decode step is launched before the one in flight
is finished (driver.py says when).

Profile mode (`engine.profile = True`) times every step by phase into `engine.step_times`, for the
benchmarks' step-time breakdown; off (the default), a step pays one `if` for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from raystate.config import EngineConfig
from raystate.messages import SamplingParams
from raystate.scheduler import RequestUpdate, Scheduler
from raystate.scheduler.dispatch import LocalDispatch
from raystate.scheduler.driver import StepDriver
from raystate.worker.worker import Worker

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
        self.worker = worker if worker is not None else Worker(config)
        # The worker's: on CUDA with no KV size set, the blocks it measured are fixed there.
        self.config = config = self.worker.config
        self.scheduler = Scheduler(config, num_shards=1)
        self.step_times: list[StepTiming] = []  # one per step while `profile` is on
        self._dispatch = LocalDispatch({0: self.worker})
        self._driver = StepDriver(self.scheduler, self._dispatch, lookahead=config.async_scheduling)

    @property
    def profile(self) -> bool:
        """On: each step appends a `StepTiming` to `step_times` (and the worker syncs a CUDA device at its
        phase boundaries, which costs a little throughput)."""
        return self.worker.profile

    @profile.setter
    def profile(self, on: bool) -> None:
        self.worker.profile = bool(on)
        # A profiled step runs alone (nothing planned on top of it), so each StepTiming is one whole step.
        self._driver.lookahead = self.config.async_scheduling and not on

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        fork_of: str | None = None,
    ) -> None:
        """Queues a request; `fork_of` names a sibling with the same prompt (one of n choices) whose
        prompt KV it shares (`Scheduler.add_request`)."""
        self.scheduler.add_request(req_id, prompt_token_ids, sampling, fork_of=fork_of)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestUpdate]:
        """One pass of the step loop. With async scheduling the next decode step is planned and launched
        before the step in flight is finished, so the returned updates may be the previous step's (the
        host's scheduling, message and bookkeeping work overlaps the device's)."""
        if self.worker.profile:
            return self._driver.drain() + self._profiled_step()
        return self._driver.step().updates

    def _profiled_step(self) -> list[RequestUpdate]:
        """A step with nothing else in flight, its phases timed (the worker times its own three)."""
        clock = time.perf_counter_ns
        t_start = clock()
        worker_ns = self._dispatch.worker_ns
        step = self._driver.step(timed=True)
        ns = dict.fromkeys(PHASES, 0)
        ns["schedule"] = step.ns.get("schedule", 0)
        ns["update"] = step.ns.get("update", 0)
        rows = tokens = 0
        if step.messages:
            # The wire: encoding and decoding the message and the result, without the worker's own time.
            wire = step.ns.get("dispatch", 0) + step.ns.get("collect", 0)
            ns["dispatch"] = wire - (self._dispatch.worker_ns - worker_ns)
            ns["prepare"], ns["forward"], ns["sample"] = self.worker.last_phases
            rows = sum(len(result.req_ids) for result in step.results.values())
            for msg in step.messages.values():
                tokens += sum(r.num_scheduled for r in msg.new_requests)
                tokens += sum(d.num_scheduled for d in msg.running)
        self.step_times.append(
            StepTiming(
                **{k: v * 1e-9 for k, v in ns.items()},
                total=(clock() - t_start) * 1e-9,
                num_rows=rows,
                num_tokens=tokens,
            )
        )
        return step.updates

    def shutdown(self) -> None:
        self._driver.drain()
