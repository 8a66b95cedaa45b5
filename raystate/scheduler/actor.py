"""SchedulerActor: the Ray backend's scheduler, as one actor that clients call and one thread that steps.

Two threads share one `Scheduler` under a lock. The actor's event loop serves clients: `add_requests`
(validated, routed and queued at once, while a step runs), `abort`, long-polled `poll`s that return each
client's `RequestUpdate`s (outbox.py), `health`, `check_alive`, `status`. The step thread runs the step
loop (`StepDriver`, driver.py), never holding the lock while it waits on the workers:

    schedule -> dispatch -> [stream the previous step's updates, record metrics] -> collect -> update

so streaming, metrics and all client traffic overlap the step in flight, and with async scheduling (the
config's default) and a compiled graph the next decode step is planned and sent while one runs; with
`pipeline_steps` each worker also launches it before answering the one in flight (the graph runs each
shard's `execute_behind`, `PipelinedCompiledDispatch`), so its device need not idle while answers travel.
Dispatch is a compiled Ray graph over every shard's `execute` (shards step in lockstep) or plain actor
calls (`dispatch="actor"`: each shard steps as soon as it answered); if the graph cannot be compiled the
actor falls back to actor calls and says so in `status()`. The price of the graph's latency: in Ray 2.60
a worker polls its input channel, so each shard's actor keeps about one CPU core busy even when idle.

Faults: a step that fails or outlasts `step_timeout_s` sends its shards through recovery (supervisor.py).
While idle, an empty step goes to every shard every `probe_interval_s`, so a death is noticed within
seconds. Test and benchmark hooks live in hooks.py. The actor never imports torch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from raystate.config import EngineConfig
from raystate.errors import EngineDead, InvalidRequest
from raystate.messages import (
    Rejected,
    RequestUpdate,
    SamplingParams,
    UpdateBatch,
    bytes_to_ids,
    decode_add_batch,
    encode,
)
from raystate.metrics import EngineMetrics
from raystate.scheduler.dispatch import IDLE_STEP, round_trip
from raystate.scheduler.driver import Step, StepDriver
from raystate.scheduler.hooks import StepThreadHooks, timed_round_trips
from raystate.scheduler.outbox import HEALTH, Outbox
from raystate.scheduler.scheduler import Scheduler
from raystate.scheduler.supervisor import ShardSupervisor

logger = logging.getLogger(__name__)

# What status() counts besides the supervisor's: steps answered, steps planned on top of one in flight
# (async scheduling), idle probes.
_COUNTS = ("steps", "lookahead_steps", "probes")


class SchedulerActor:
    """The deployment's scheduler (plain class; `launch.py` applies `ray.remote`). Call `start()` once."""

    def __init__(
        self,
        config: EngineConfig,
        workers: list,
        name: str = "raystate",
        dispatch: str = "compiled",
        pipeline_steps: bool = False,
        step_timeout_s: float = 120.0,
        probe_interval_s: float = 2.0,
        respawn_timeout_s: float = 60.0,
        client_timeout_s: float = 120.0,
        spawn_worker: Callable[[int], object] | None = None,
    ) -> None:
        if dispatch not in ("compiled", "actor"):
            raise InvalidRequest("dispatch", "'compiled' or 'actor'", dispatch)
        # The step thread blocks in ray.get on purpose (the event loop stays free): no warning for that.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        self.config = config
        self.name = name
        self.step_timeout_s = step_timeout_s
        self.probe_interval_s = probe_interval_s
        self._sched = Scheduler(config, len(workers))
        self._lock = threading.Lock()  # guards _sched between the event loop and the step thread
        self._shards = ShardSupervisor(
            workers,
            self._sched,
            self._lock,
            dispatch,
            respawn_timeout_s,
            spawn_worker,
            pipelined=pipeline_steps and config.async_scheduling,
        )
        self._outbox = Outbox(client_timeout_s)
        self._hooks = StepThreadHooks()
        self._driver: StepDriver | None = None  # built by the step thread once the workers answer
        self._work = threading.Event()
        self._stopping = False
        self._fatal: str | None = None
        self._ids = itertools.count()
        self._metrics = EngineMetrics(name, len(workers))
        self._step_times: collections.deque = collections.deque(maxlen=2048)  # (step_s, dispatch_s)
        self._done: Step | None = None  # the last step, streamed while the next one is in flight
        self.counts = collections.Counter(dict.fromkeys(_COUNTS, 0))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()  # the step loop's last pass (a stalled loop stops moving it)
        # A step loop that has not passed for this long is stuck (a step, then a recovery, both timed out).
        self.stall_timeout_s = step_timeout_s + 2 * respawn_timeout_s + 30.0

    @property
    def dispatch_mode(self) -> str:
        return self._shards.dispatch_mode

    # -- life cycle (event loop) ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Starts the step thread once the workers answer; returns the dispatch mode in use."""
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            started: concurrent.futures.Future = concurrent.futures.Future()
            self._thread = threading.Thread(target=self._run, args=(started,), name="step-loop", daemon=True)
            self._thread.start()
            await asyncio.wrap_future(started)
        return self.dispatch_mode

    async def shutdown(self) -> None:
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        self._set_fatal("the engine was shut down")

    def _set_fatal(self, why: str) -> None:
        if self._fatal is None:
            self._fatal = why
        self._outbox.fail(why)

    # -- client calls (event loop) -------------------------------------------------------------------------

    async def add_requests(self, data: bytes) -> bytes:
        """Queues an `AddBatch` atomically: b"" when accepted, else the encoded `Rejected`."""
        if self._fatal is not None:
            raise EngineDead(self._fatal)
        batch = decode_add_batch(data)
        with self._lock:
            for i, r in enumerate(batch.requests):
                try:
                    self._sched.add_request(
                        r.req_id, bytes_to_ids(r.token_ids), r.sampling, fork_of=r.fork_of or None
                    )
                except InvalidRequest as e:
                    for earlier in batch.requests[:i]:
                        self._sched.abort(earlier.req_id)
                    return encode(Rejected(i, e.field, e.limit, repr(e.got)))
        self._outbox.own(batch.client_id, [r.req_id for r in batch.requests])
        self._work.set()
        return b""

    async def abort(self, req_id: str) -> bool:
        """Drops the request; its owner gets a last update with finish_reason "abort"."""
        with self._lock:
            req = self._sched.get_request(req_id)
            found = self._sched.abort(req_id)
        if found:
            self._work.set()
            update = RequestUpdate(req_id, [], True, "abort", req.num_cached_tokens, req.replay_start)
            self._outbox.deliver([update])
        return found

    async def poll(self, client_id: str, max_wait_s: float = 1.0) -> bytes:
        """The client's updates since its last poll (an encoded UpdateBatch), waiting up to max_wait_s."""
        updates = await self._outbox.take(client_id, max_wait_s, wait=self._fatal is None)
        self._forget_silent_clients()
        return encode(UpdateBatch(updates, self._fatal))

    def _forget_silent_clients(self) -> None:
        """Aborts the requests of clients that stopped polling (gone without saying so)."""
        orphans = self._outbox.forget_silent()
        if orphans:
            with self._lock:
                for rid in orphans:
                    self._sched.abort(rid)
            self._work.set()

    async def health(self, timeout_s: float = 60.0) -> bool:
        """Runs a real one-token request on every live shard."""
        if self._fatal is not None:
            raise EngineDead(self._fatal)
        futs = []
        with self._lock:
            for s in self._sched.live_shards():
                rid = f"{HEALTH}-{next(self._ids)}-{s}"
                one_token = SamplingParams(max_tokens=1, ignore_eos=True)
                self._sched.add_request(rid, [self.config.model.probe_token_id], one_token, shard=s)
                fut = self._loop.create_future()
                self._outbox.expect_health(rid, fut)
                futs.append(fut)
        self._work.set()
        try:
            done = await asyncio.wait_for(asyncio.gather(*futs), timeout_s)
        except TimeoutError:
            with self._lock:
                for rid in self._outbox.health_requests():
                    self._sched.abort(rid)
            return False
        return all(len(u.new_token_ids) == 1 and u.finish_reason == "length" for u in done)

    def _step_loop_dead(self) -> str | None:
        """Why the step loop cannot serve (stopped, failed, or stuck), or None while it runs."""
        if self._fatal is not None:
            return self._fatal
        if self._thread is None or not self._thread.is_alive():
            return "the scheduler's step loop is not running"
        stalled = time.monotonic() - self._beat
        if stalled > self.stall_timeout_s:
            return f"the scheduler's step loop has not moved for {stalled:.0f} s"
        return None

    async def check_alive(self) -> None:
        """Raises EngineDead unless the step loop runs: the cheap liveness check behind Serve's
        `check_health` (status() still answers when the loop is dead; this does not)."""
        why = self._step_loop_dead()
        if why is not None:
            raise EngineDead(why)

    async def status(self) -> dict:
        with self._lock:
            stats = dataclasses.asdict(self._sched.stats())
            live = self._sched.live_shards()
        steps = sorted(t for t, _ in self._step_times)
        dispatches = sorted(d for _, d in self._step_times)
        return {
            "backend": "ray",
            "deployment": self.name,
            "dispatch": self.dispatch_mode,
            "pipelined": self._shards.pipelined,
            "flushes": getattr(self._shards.dispatch, "flushes", 0),
            "num_shards": self._sched.num_shards,
            "live_shards": live,
            "step_time_p50_us": steps[len(steps) // 2] * 1e6 if steps else 0.0,
            "dispatch_time_p50_us": dispatches[len(dispatches) // 2] * 1e6 if dispatches else 0.0,
            **dict(self.counts),
            **dict(self._shards.counts),
            **stats,
            "step_loop_alive": self._step_loop_dead() is None,
            "error": self._fatal,
        }

    async def get_config(self) -> EngineConfig:
        return self.config

    async def request_shard(self, req_id: str) -> int:
        """The shard an unfinished request is on (-1 if unknown): routing is observable."""
        with self._lock:
            req = self._sched.get_request(req_id)
        return -1 if req is None else req.shard

    async def workers(self) -> dict[int, object]:
        return dict(self._shards.workers)

    async def loaded_modules(self, names: list[str]) -> list[str]:
        """Which of these modules this process imported (the scheduler must never load torch)."""
        return [n for n in names if n in sys.modules]

    # -- test and benchmark hooks (hooks.py) ---------------------------------------------------------------

    async def inject_fault(self, kind: str) -> None:
        """Fault drills and tests: "step_loop" makes the step loop raise on its next pass, leaving the
        actor itself running (the failure `check_alive` exists to catch)."""
        self._hooks.inject_fault(kind)
        self._work.set()

    async def bench_dispatch(self, payload: bytes, iters: int) -> list[int]:
        """Round trips (ns) of `payload` sent to every live shard and answered, timed by the step thread."""

        def one() -> None:
            round_trip(
                self._driver.dispatcher, dict.fromkeys(self._shards.workers, payload), self.step_timeout_s
            )

        fut = self._hooks.submit_job(lambda: timed_round_trips(one, iters))
        self._work.set()
        return await asyncio.wrap_future(fut)

    # -- the step thread -----------------------------------------------------------------------------------

    def _run(self, started: concurrent.futures.Future) -> None:
        try:
            self._shards.start()
            self._driver = StepDriver(
                self._sched,
                self._shards.dispatch,
                lookahead=self.config.async_scheduling,
                lock=self._lock,
                timeout_s=self.step_timeout_s,
            )
            started.set_result(None)
            self._step_loop()
        except BaseException as e:
            if not started.done():
                started.set_exception(e)
            # The traceback goes to the actor's log; clients (and HTTP bodies) get one line with no paths.
            logger.error("scheduler %s: step loop failed:\n%s", self.name, traceback.format_exc())
            if isinstance(e, EngineDead):  # our own one-line verdict (no traceback, no paths)
                why = f"the engine gave up: {e}"
            else:
                why = f"the scheduler's step loop failed ({type(e).__name__}); see the scheduler actor's log"
            self._loop.call_soon_threadsafe(self._set_fatal, why)
        finally:
            self._shards.close()

    def _step_loop(self) -> None:
        """One pass of the step loop after another; what a pass found decides what comes next: recovery
        after a fault, a wait (or a probe, or a hook's job) when nothing is in flight."""
        while not self._stopping:
            self._beat = time.monotonic()
            self._hooks.raise_injected_fault()
            step = self._driver.step(while_in_flight=self._publish_done)
            self.counts["lookahead_steps"] += step.lookahead
            if step.refused is not None:  # every step in flight is lost; the last one's updates wait
                self._recover(dict.fromkeys(self._shards.workers, step.refused), step.lost)
                continue
            self._done = step
            self._shards.answered(step.results)
            if step.idle:
                self._idle()
            elif step.errors:
                self._recover(step.errors, step.lost)

    def _publish_done(self) -> None:
        """The last step's updates to their clients and its times to the metrics (while the next runs)."""
        step, self._done = self._done, None
        if step is not None and step.updates:
            self._loop.call_soon_threadsafe(self._outbox.deliver, step.updates)
        if step is not None and step.times:
            self.counts["steps"] += 1
            step_s = max(t for t, _ in step.times)
            dispatch_s = min(d for _, d in step.times)
            self._step_times.append((step_s, dispatch_s))
            self._metrics.record_step(step_s, dispatch_s)
        if self._metrics.stats_due():
            with self._lock:
                stats = self._sched.stats()
            self._metrics.record_stats(stats)

    def _idle(self) -> None:
        """Nothing in flight: a hook's job, else a wait for work that probes every shard when it times out."""
        if not self._hooks.run_job() and not self._work.wait(self.probe_interval_s):
            self._probe_all()
        self._work.clear()

    def _probe_all(self) -> None:
        """An empty step through every shard: how an idle engine notices a dead worker."""
        self.counts["probes"] += 1
        try:
            round_trip(
                self._driver.dispatcher, dict.fromkeys(self._shards.workers, IDLE_STEP), self.step_timeout_s
            )
        except Exception as e:
            self._recover(dict.fromkeys(self._shards.workers, e), set())

    def _recover(self, errors: dict[int, BaseException], lost: set[int]) -> None:
        self._shards.recover(errors, lost)
        self._driver.dispatcher = self._shards.dispatch  # a compiled graph is rebuilt
