"""SchedulerActor: the step loop of the Ray backend (with dispatch.py, the only scheduler code importing ray).

Two threads share one `Scheduler` under a lock. The actor's event loop serves clients: `add_requests`
(validated, routed and queued at once, while a step runs), `abort`, long-polled `poll`s that return each
client's `RequestUpdate`s, `health`, `status`. The step thread runs the loop, never holding the lock while
it waits on the workers:

    schedule() -> {shard: StepMessage} -> encode each once -> dispatch -> [stream the previous step's
    updates, record metrics] -> collect the StepResults -> update() -> next step

Streaming, metrics and all client traffic thus overlap the step in flight. With async scheduling (the
config's default) and a compiled graph, the next decode step is also planned and sent while one is in
flight (`Scheduler.schedule(lookahead=True)`: the worker already holds the token it will read), so the
scheduler's update and planning overlap the workers' execution; steps that admit or prefill wait for
the answer. Dispatch is a compiled Ray graph over every shard's `execute` (shards step in lockstep; a
shard with nothing to do gets an empty StepMessage, so the graph's fan-out stays fixed), or plain actor
calls (`dispatch="actor"`: each shard steps as soon as it answered). If the graph cannot be compiled the
actor falls back to actor calls and says so in `status()`. The price of the graph's latency: in Ray 2.60
a worker polls its input channel, so each shard's actor keeps about one CPU core busy even when idle.

Faults: a step that raises (a dead actor: ActorDiedError; a channel error) or outlasts `step_timeout_s`
sends every shard concerned through recovery. A shard whose worker still runs the same process keeps its
state unless a step was lost on it; one that Ray restarted, or that is gone and gets a new actor, lost its
device state. Either way `Scheduler.reset_shard` re-queues its requests, to be re-sent in full with every
token they already have, so they finish with the tokens a fault-free run gives (bounded replay off). A
shard with no actor again within `respawn_timeout_s` is dropped and its requests move to the others.
While idle, an empty step goes to every shard every `probe_interval_s`, so a death is noticed within
seconds. The actor never imports torch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from raystate.config import EngineConfig
from raystate.errors import EngineDead, InvalidRequest
from raystate.messages import (
    Rejected,
    RequestUpdate,
    SamplingParams,
    UpdateBatch,
    bytes_to_ids,
    decode_add_batch,
    decode_result,
    encode,
)
from raystate.metrics import EngineMetrics
from raystate.scheduler.dispatch import IDLE_STEP, ActorDispatch, CompiledDispatch
from raystate.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

_HEALTH = "__health__"  # owner of the health-check requests
_MAX_FAILURES = 3  # consecutive failed steps of one shard before the engine gives up
# What status() counts: steps answered, steps planned on top of one in flight (async scheduling), idle
# probes, fault recoveries, workers Ray restarted, workers replaced by a new actor, shards dropped.
_COUNTS = ("steps", "lookahead_steps", "probes", "recoveries", "restarts", "respawns", "drops")


@dataclasses.dataclass
class _Outbox:
    """One client's updates waiting for its next poll."""

    updates: list[RequestUpdate] = dataclasses.field(default_factory=list)
    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    last_poll: float = dataclasses.field(default_factory=time.monotonic)


class SchedulerActor:
    """The deployment's scheduler (plain class; `launch.py` applies `ray.remote`). Call `start()` once."""

    def __init__(
        self,
        config: EngineConfig,
        workers: list,
        name: str = "raystate",
        dispatch: str = "compiled",
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
        self.dispatch_mode = dispatch
        self.step_timeout_s = step_timeout_s
        self.probe_interval_s = probe_interval_s
        self.respawn_timeout_s = respawn_timeout_s
        self.client_timeout_s = client_timeout_s
        self._spawn = spawn_worker
        self._workers: dict[int, object] = dict(enumerate(workers))
        self._incarnations: dict[int, str] = {}
        self._sched = Scheduler(config, len(workers))
        self._lock = threading.Lock()  # guards _sched between the event loop and the step thread
        self._work = threading.Event()
        self._jobs: collections.deque = collections.deque()  # (fn, future) run by the step thread
        self._stopping = False
        self._fatal: str | None = None
        self._owner: dict[str, str] = {}  # req_id -> client id (event loop thread only)
        self._boxes: dict[str, _Outbox] = {}
        self._health: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._next_gc = 0.0
        self._dispatch = None
        self._metrics = EngineMetrics(name, len(workers))
        self._step_times: collections.deque = collections.deque(maxlen=2048)  # (step_s, dispatch_s)
        self._failures = collections.Counter()
        self.counts = collections.Counter(dict.fromkeys(_COUNTS, 0))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._beat = time.monotonic()  # the step loop's last pass (a stalled loop stops moving it)
        # A step loop that has not passed for this long is stuck (a step, then a recovery, both timed out).
        self.stall_timeout_s = step_timeout_s + 2 * respawn_timeout_s + 30.0
        self._injected_fault: str | None = None

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
        for box in self._boxes.values():
            box.event.set()
        for fut in self._health.values():
            if not fut.done():
                fut.set_exception(EngineDead(why))

    # -- client calls (event loop) -------------------------------------------------------------------------

    async def add_requests(self, data: bytes) -> bytes:
        """Queues an `AddBatch` atomically: b"" when accepted, else the encoded `Rejected`."""
        if self._fatal is not None:
            raise EngineDead(self._fatal)
        batch = decode_add_batch(data)
        with self._lock:
            for i, r in enumerate(batch.requests):
                try:
                    self._sched.add_request(r.req_id, bytes_to_ids(r.token_ids), r.sampling)
                except InvalidRequest as e:
                    for earlier in batch.requests[:i]:
                        self._sched.abort(earlier.req_id)
                    return encode(Rejected(i, e.field, e.limit, repr(e.got)))
        self._boxes.setdefault(batch.client_id, _Outbox())
        for r in batch.requests:
            self._owner[r.req_id] = batch.client_id
        self._work.set()
        return b""

    async def abort(self, req_id: str) -> bool:
        """Drops the request; its owner gets a last update with finish_reason "abort"."""
        with self._lock:
            req = self._sched.get_request(req_id)
            found = self._sched.abort(req_id)
        if found:
            self._work.set()
            self._deliver([RequestUpdate(req_id, [], True, "abort", req.num_cached_tokens, req.replay_start)])
        return found

    async def poll(self, client_id: str, max_wait_s: float = 1.0) -> bytes:
        """The client's updates since its last poll (an encoded UpdateBatch), waiting up to max_wait_s."""
        box = self._boxes.setdefault(client_id, _Outbox())
        box.last_poll = time.monotonic()
        if not box.updates and self._fatal is None:
            box.event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(box.event.wait(), max_wait_s)
        updates, box.updates = box.updates, []
        self._forget_silent_clients()
        return encode(UpdateBatch(updates, self._fatal))

    async def health(self, timeout_s: float = 60.0) -> bool:
        """Runs a real one-token request on every live shard."""
        if self._fatal is not None:
            raise EngineDead(self._fatal)
        futs = []
        with self._lock:
            for s in self._sched.live_shards():
                rid = f"{_HEALTH}-{next(self._ids)}-{s}"
                one_token = SamplingParams(max_tokens=1, ignore_eos=True)
                self._sched.add_request(rid, [self.config.model.bos_token_id], one_token, shard=s)
                self._owner[rid] = _HEALTH
                self._health[rid] = fut = self._loop.create_future()
                futs.append(fut)
        self._work.set()
        try:
            done = await asyncio.wait_for(asyncio.gather(*futs), timeout_s)
        except TimeoutError:
            with self._lock:
                for rid in [r for r, c in self._owner.items() if c == _HEALTH]:
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

    async def inject_fault(self, kind: str) -> None:
        """Fault drills and tests: "step_loop" makes the step loop raise on its next pass, leaving the
        actor itself running (the failure `check_alive` exists to catch)."""
        if kind != "step_loop":
            raise InvalidRequest("kind", "'step_loop'", kind)
        self._injected_fault = kind
        self._work.set()

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
            "num_shards": self._sched.num_shards,
            "live_shards": live,
            "step_time_p50_us": steps[len(steps) // 2] * 1e6 if steps else 0.0,
            "dispatch_time_p50_us": dispatches[len(dispatches) // 2] * 1e6 if dispatches else 0.0,
            **dict(self.counts),
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
        return dict(self._workers)

    async def loaded_modules(self, names: list[str]) -> list[str]:
        """Which of these modules this process imported (the scheduler must never load torch)."""
        return [n for n in names if n in sys.modules]

    async def bench_dispatch(self, payload: bytes, iters: int) -> list[int]:
        """Round trips (ns) of `payload` sent to every live shard and answered, timed by the step thread."""

        def job() -> list[int]:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter_ns()
                self._round_trip(dict.fromkeys(self._workers, payload))
                times.append(time.perf_counter_ns() - t0)
            return times

        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.append((job, fut))
        self._work.set()
        return await asyncio.wrap_future(fut)

    # -- delivery (event loop) -----------------------------------------------------------------------------

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        owner = self._owner
        woken = set()
        for u in updates:
            cid = owner.pop(u.req_id, None) if u.finished else owner.get(u.req_id)
            if cid == _HEALTH:
                fut = self._health.pop(u.req_id, None)
                if fut is not None and not fut.done() and u.finished:
                    fut.set_result(u)
            elif cid is not None and (box := self._boxes.get(cid)) is not None:
                box.updates.append(u)
                woken.add(cid)
        for cid in woken:
            self._boxes[cid].event.set()

    def _forget_silent_clients(self) -> None:
        """Aborts the requests of clients that stopped polling (gone without saying so)."""
        now = time.monotonic()
        if now < self._next_gc:
            return
        self._next_gc = now + 10.0
        gone = {c for c, box in self._boxes.items() if now - box.last_poll > self.client_timeout_s}
        if not gone:
            return
        with self._lock:
            for rid in [r for r, c in self._owner.items() if c in gone]:
                self._sched.abort(rid)
                del self._owner[rid]
        for c in gone:
            del self._boxes[c]
        self._work.set()

    # -- the step thread -----------------------------------------------------------------------------------

    def _run(self, started: concurrent.futures.Future) -> None:
        try:
            for s, w in self._workers.items():
                self._incarnations[s] = ray.get(w.incarnation.remote(), timeout=self.respawn_timeout_s)
            self._build_dispatch()
            started.set_result(None)
            self._loop_steps()
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
            if self._dispatch is not None:
                self._dispatch.close()

    def _build_dispatch(self) -> None:
        if self.dispatch_mode == "compiled":
            try:
                self._dispatch = CompiledDispatch(self._workers)
                return
            except Exception as e:  # e.g. channels unsupported here: plain actor calls still work
                self.dispatch_mode = f"actor (compiled graph failed: {e!r})"
        self._dispatch = ActorDispatch(self._workers)

    def _loop_steps(self) -> None:
        sched, lock = self._sched, self._lock
        # Compiled graph (lockstep): one entry per step in flight, oldest first, each mapping the shards
        # that got a real message to its submit time; with async scheduling a second step, planned on top
        # of the first, may be in flight. Actor calls: one step per shard at most, in one dict.
        steps: collections.deque[dict[int, float]] = collections.deque()
        expecting: dict[int, float] = {}
        lookahead_ok = sched.config.async_scheduling
        done: tuple[list[RequestUpdate], list[tuple[float, float]]] = ([], [])
        while not self._stopping:
            self._beat = time.monotonic()
            if self._injected_fault is not None:
                raise RuntimeError(f"fault injected: {self._injected_fault}")
            dispatch = self._dispatch
            lockstep = dispatch.lockstep
            refused = False
            # Plan and send: a step when none is in flight, then (compiled graph, async scheduling) a
            # decode step on top of it while it runs; with actor calls, whatever shards are free.
            while True:
                in_flight = dispatch.num_in_flight()
                if lockstep and not (in_flight == 0 or (in_flight == 1 and lookahead_ok)):
                    break
                with lock:
                    msgs = sched.schedule(lookahead=lockstep and in_flight > 0)
                payloads = {s: encode(m) for s, m in msgs.items()}
                if not payloads:
                    break
                sent = dict.fromkeys(payloads, time.perf_counter())
                self.counts["lookahead_steps"] += lockstep and in_flight > 0
                if lockstep:
                    steps.append(sent)
                else:
                    expecting.update(sent)
                try:
                    dispatch.submit(payloads)
                except Exception as e:  # the graph refused the input: every step in flight is lost
                    lost = set(expecting).union(*steps)
                    steps.clear()
                    expecting.clear()
                    self._recover(dict.fromkeys(self._workers, e), lost)
                    refused = True
                    break
                if not lockstep:
                    break
            if refused:
                continue
            self._after_step(*done)  # the previous step's streaming and metrics, while this one runs
            done = ([], [])
            if not dispatch.in_flight():
                if self._jobs:
                    self._run_job(*self._jobs.popleft())
                elif not self._work.wait(self.probe_interval_s):
                    self._probe_all()
                self._work.clear()
                continue
            results, errors = dispatch.collect(self.step_timeout_s)
            now = time.perf_counter()
            answered = (steps.popleft() if steps else {}) if lockstep else expecting
            with lock:
                for s, data in results.items():
                    sent_at = answered.pop(s, None)
                    if sent_at is None:
                        continue  # an idle shard's empty step
                    result = decode_result(data)
                    done[0].extend(sched.update(s, result))
                    done[1].append((now - sent_at, now - sent_at - result.execute_ns * 1e-9))
                    self._failures[s] = 0
            if errors:
                if lockstep:  # the graph is torn down: every step in flight is lost
                    lost = set(answered).union(*steps)
                    steps.clear()
                else:
                    lost = {s for s in errors if expecting.pop(s, None) is not None}
                self._recover(errors, lost)

    def _after_step(self, updates: list[RequestUpdate], times: list[tuple[float, float]]) -> None:
        if updates:
            self._loop.call_soon_threadsafe(self._deliver, updates)
        if times:
            self.counts["steps"] += 1
            step_s = max(t for t, _ in times)
            dispatch_s = min(d for _, d in times)
            self._step_times.append((step_s, dispatch_s))
            self._metrics.record_step(step_s, dispatch_s)
        if self._metrics.stats_due():
            with self._lock:
                stats = self._sched.stats()
            self._metrics.record_stats(stats)

    def _run_job(self, fn, fut: concurrent.futures.Future) -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:
            fut.set_exception(e)

    def _round_trip(self, payloads: dict[int, bytes]) -> dict[int, bytes]:
        """Sends and waits for every answer (probes, benchmarks); raises the first error."""
        self._dispatch.submit(payloads)
        results: dict[int, bytes] = {}
        while self._dispatch.in_flight():
            got, errors = self._dispatch.collect(self.step_timeout_s)
            if errors:
                raise next(iter(errors.values()))
            results.update(got)
        return results

    def _probe_all(self) -> None:
        """An empty step through every shard: how an idle engine notices a dead worker."""
        self.counts["probes"] += 1
        try:
            self._round_trip(dict.fromkeys(self._workers, IDLE_STEP))
        except Exception as e:
            self._recover(dict.fromkeys(self._workers, e), set())

    # -- recovery (step thread) ----------------------------------------------------------------------------

    def _recover(self, errors: dict[int, BaseException], lost: set[int]) -> None:
        """Brings every shard in `errors` back to a known state; `lost` had a real step in flight.

        A compiled graph is torn down and rebuilt over the live workers; with actor calls only the failed
        shards' handles change and the other shards' steps stay in flight.
        """
        self.counts["recoveries"] += 1
        if self._dispatch.lockstep:
            self._dispatch.close()
        for s in sorted(errors):
            state = self._check_worker(s)
            if state == "kept" and s not in lost:
                continue
            if state == "kept":  # alive, but the step's answer is lost: start the shard over
                try:
                    ray.get(self._workers[s].reset.remote(), timeout=self.respawn_timeout_s)
                except Exception:  # it died meanwhile, or hangs
                    ray.kill(self._workers[s])
                    state = "gone"
            if state == "gone" and not self._replace_worker(s):
                self._drop(s)
                continue
            self._failures[s] += 1
            if self._failures[s] > _MAX_FAILURES:
                logger.error("shard %d: last step error: %r", s, errors[s])
                kind = type(errors[s]).__name__
                raise EngineDead(f"shard {s} failed {self._failures[s]} steps in a row ({kind})")
            with self._lock:
                self._sched.reset_shard(s)
        if self._dispatch.lockstep:
            self._build_dispatch()
        else:
            self._dispatch.workers = dict(self._workers)

    def _check_worker(self, s: int) -> str:
        """'kept' (same process), 'restarted' (Ray restarted it: state lost) or 'gone'."""
        deadline = time.monotonic() + self.respawn_timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                inc = ray.get(self._workers[s].incarnation.remote(), timeout=left)
            except ActorDiedError:
                return "gone"
            except (RayActorError, GetTimeoutError):  # unreachable or restarting: try until the deadline
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                ray.kill(self._workers[s])
                return "gone"
            if inc == self._incarnations[s]:
                return "kept"
            self._incarnations[s] = inc
            self.counts["restarts"] += 1
            return "restarted"

    def _replace_worker(self, s: int) -> bool:
        """A new actor for shard s in its placement bundle; False when none comes up in time."""
        if self._spawn is None:
            return False
        deadline = time.monotonic() + self.respawn_timeout_s
        handle = None
        while time.monotonic() < deadline:
            try:
                handle = self._spawn(s)
                inc = ray.get(handle.incarnation.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except ValueError:  # the dead actor's name is not released yet
                time.sleep(0.2)
                continue
            except Exception:
                break
            self._workers[s] = handle
            self._incarnations[s] = inc
            self.counts["respawns"] += 1
            return True
        if handle is not None:
            ray.kill(handle)
        return False

    def _drop(self, s: int) -> None:
        if len(self._workers) == 1:
            raise EngineDead(f"shard {s}, the last one, is gone and no new worker came up")
        self.counts["drops"] += 1
        del self._workers[s]
        with self._lock:
            self._sched.drop_shard(s)
