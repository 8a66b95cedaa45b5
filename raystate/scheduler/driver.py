"""The step loop, one pass at a time: schedule, dispatch, collect, update.

Every backend steps its `Scheduler` through `StepDriver.step`: the Ray scheduler actor (over a compiled
graph or plain actor calls), the in-process engine and the scheduler tests (over `LocalDispatch`). Each
shard's StepMessage is encoded once here and decoded by its worker; each StepResult comes back encoded
and is decoded here, so every backend crosses the same wire format. No ray, no torch: the transport is
the dispatcher (dispatch.py), which also keeps the books of what is in flight.

Async scheduling (`lookahead`, lockstep dispatchers only): up to two steps are in flight. A pass that
finds one in flight plans a decode step on top of it (`Scheduler.schedule(lookahead=True)`: the worker
will already hold the token it reads) and sends it before the older one is collected, so the
scheduler's update and planning overlap the workers' execution; steps that admit or prefill wait for
the answer. A pass collects the oldest step once two are in flight or nothing more could be sent, so
the first pass after an idle spell only sends. Without lookahead a pass sends one step and collects it.
With plain actor calls each shard has at most one step in flight and a pass collects whatever answers
first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

from raystate.messages import RequestUpdate, StepMessage, StepResult, decode_result, encode
from raystate.scheduler.dispatch import DispatchRefused
from raystate.scheduler.scheduler import Scheduler


@dataclasses.dataclass(slots=True)
class Step:
    """What one pass did."""

    messages: dict[int, StepMessage] = dataclasses.field(default_factory=dict)  # planned and sent
    lookahead: bool = False  # the messages were planned on top of a step in flight
    results: dict[int, StepResult] = dataclasses.field(default_factory=dict)  # answers collected
    updates: list[RequestUpdate] = dataclasses.field(default_factory=list)  # for the clients
    # Per answer: the round trip, and the round trip less the worker's own execute time (seconds).
    times: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    errors: dict[int, BaseException] = dataclasses.field(default_factory=dict)  # answers missing
    lost: set[int] = dataclasses.field(default_factory=set)  # shards whose step in flight is gone
    refused: BaseException | None = None  # the transport refused the messages (all in flight lost)
    idle: bool = False  # nothing was in flight, so nothing was collected
    ns: dict[str, int] | None = None  # with `timed`: nanoseconds per phase that ran


class StepDriver:
    """Steps a Scheduler over a dispatcher. `lock` guards the scheduler where other threads also use it
    (the scheduler actor's event loop); it is held only while planning and applying, never while waiting.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        dispatcher,
        lookahead: bool = False,
        lock=None,
        timeout_s: float | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.dispatcher = dispatcher  # the scheduler actor swaps in a rebuilt one after a fault
        self.lookahead = lookahead
        self.timeout_s = timeout_s
        self._lock = lock if lock is not None else contextlib.nullcontext()

    def step(self, while_in_flight: Callable[[], None] | None = None, timed: bool = False) -> Step:
        """One pass. `while_in_flight` runs once the messages are sent, before waiting for answers (the
        actor streams the last step's updates there); `timed` fills `Step.ns`."""
        step = self.schedule(timed)
        if not self.dispatch(step):
            return step  # refused: every step in flight is lost (step.lost)
        if while_in_flight is not None:
            while_in_flight()
        if self._room_on_top(step):
            return step  # the next pass plans a step on top of this one before collecting
        self.collect(step)
        self.update(step)
        return step

    def drain(self) -> list[RequestUpdate]:
        """Collects and applies every step in flight, planning nothing new."""
        updates: list[RequestUpdate] = []
        while self.dispatcher.num_in_flight():
            step = Step()
            self.collect(step)
            self.update(step)
            updates += step.updates
        return updates

    @property
    def in_flight(self) -> bool:
        return self.dispatcher.num_in_flight() > 0

    # -- the four phases -----------------------------------------------------------------------------------

    def schedule(self, timed: bool = False) -> Step:
        """Plans a step for every shard with work and room: a lookahead step on top of a lockstep step in
        flight, nothing when two are in flight (or one, without lookahead)."""
        step = Step(ns={} if timed else None)
        t = time.perf_counter_ns() if timed else 0
        dispatcher = self.dispatcher
        in_flight = dispatcher.num_in_flight()
        if dispatcher.lockstep and in_flight >= (2 if self.lookahead else 1):
            return step
        ahead = dispatcher.lockstep and in_flight > 0
        with self._lock:
            step.messages = self.scheduler.schedule(lookahead=ahead)
        step.lookahead = ahead and bool(step.messages)
        if timed:
            step.ns["schedule"] = time.perf_counter_ns() - t
        return step

    def dispatch(self, step: Step) -> bool:
        """Encodes each message once and sends them; False when the transport refused them."""
        if not step.messages:
            return True
        t = time.perf_counter_ns() if step.ns is not None else 0
        payloads = {s: encode(m) for s, m in step.messages.items()}
        try:
            self.dispatcher.submit(payloads)
        except DispatchRefused as e:
            step.refused = e.cause
            step.lost = self.dispatcher.abandon() | set(payloads)
            return False
        if step.ns is not None:
            step.ns["dispatch"] = time.perf_counter_ns() - t
        return True

    def collect(self, step: Step) -> None:
        """Waits for the oldest step's answers (up to `timeout_s`) and decodes them."""
        if not self.dispatcher.num_in_flight():
            step.idle = True
            return
        t = time.perf_counter_ns() if step.ns is not None else 0
        answers = self.dispatcher.collect(self.timeout_s)
        now = time.perf_counter()
        for s, data in answers.results.items():
            result = decode_result(data)
            step.results[s] = result
            round_trip = now - answers.sent_at[s]
            step.times.append((round_trip, round_trip - result.execute_ns * 1e-9))
        step.errors = answers.errors
        step.lost = answers.lost
        if step.ns is not None:
            step.ns["collect"] = time.perf_counter_ns() - t

    def update(self, step: Step) -> None:
        """Applies the answers to the scheduler; the client updates go to `step.updates`."""
        if not step.results:
            return
        t = time.perf_counter_ns() if step.ns is not None else 0
        with self._lock:
            for s, result in step.results.items():
                step.updates += self.scheduler.update(s, result)
        if step.ns is not None:
            step.ns["update"] = time.perf_counter_ns() - t

    def _room_on_top(self, step: Step) -> bool:
        """A lockstep step was just sent with nothing under it: with lookahead, one more may go on top."""
        return (
            bool(step.messages)
            and self.lookahead
            and self.dispatcher.lockstep
            and self.dispatcher.num_in_flight() < 2
        )
