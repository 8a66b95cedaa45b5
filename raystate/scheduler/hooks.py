"""Test and benchmark hooks into the scheduler actor's step thread, kept out of the step loop itself.

- Fault drills: `inject_fault("step_loop")` makes the loop raise on its next pass, leaving the actor
  running (the failure its `check_alive` exists to catch: tests/serve/test_self_heal.py,
  bench/bench_faults.py).
- Jobs: a function to run on the step thread while it is idle, e.g. `timed_round_trips` for
  bench/bench_dispatch.py, which times dispatch exactly where real steps are timed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable

from raystate.errors import InvalidRequest

FAULTS = ("step_loop",)


class StepThreadHooks:
    def __init__(self) -> None:
        self._fault: str | None = None
        self._jobs: collections.deque = collections.deque()  # (fn, future), run by the step thread

    def inject_fault(self, kind: str) -> None:
        if kind not in FAULTS:
            raise InvalidRequest("kind", " or ".join(repr(k) for k in FAULTS), kind)
        self._fault = kind

    def raise_injected_fault(self) -> None:
        """Called by the step loop once a pass."""
        if self._fault is not None:
            raise RuntimeError(f"fault injected: {self._fault}")

    def submit_job(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.append((fn, fut))
        return fut

    def run_job(self) -> bool:
        """Runs the oldest job (step thread, while idle); False when there is none."""
        if not self._jobs:
            return False
        fn, fut = self._jobs.popleft()
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)
        return True


def timed_round_trips(round_trip: Callable[[], None], iters: int) -> list[int]:
    """Nanoseconds of each of `iters` calls of `round_trip`."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        round_trip()
        times.append(time.perf_counter_ns() - t0)
    return times
