"""The worker actors behind the shards, and bringing them back after a fault (step thread only).

A step that raises (a dead actor: ActorDiedError; a channel error) or outlasts the step timeout sends
every shard concerned through `recover`. A shard whose worker still runs the same process keeps its
state unless a step was lost on it; one that Ray restarted, or that is gone and gets a new actor, lost
its device state. Either way `Scheduler.reset_shard` re-queues its requests, to be re-sent in full with
every token they already have, so they finish with the tokens a fault-free run gives (bounded replay
off). A shard with no actor again within `respawn_timeout_s` is dropped and its requests move to the
others; a shard that fails `MAX_FAILURES` steps in a row, or the last shard gone, ends the engine
(EngineDead).

The supervisor also owns the dispatcher over the workers: a compiled graph is torn down and rebuilt over
the live workers after a fault; with actor calls only the failed shards' handles change.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from raystate.errors import EngineDead
from raystate.scheduler.ray_dispatch import ActorDispatch, CompiledDispatch, PipelinedCompiledDispatch
from raystate.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_FAILURES = 3  # consecutive failed steps of one shard before the engine gives up
# What status() counts here: fault recoveries, workers Ray restarted, workers replaced by a new actor,
# shards dropped.
COUNTS = ("recoveries", "restarts", "respawns", "drops")


class ShardSupervisor:
    def __init__(
        self,
        workers: list,
        sched: Scheduler,
        lock: threading.Lock,
        dispatch_mode: str,
        respawn_timeout_s: float,
        spawn_worker: Callable[[int], object] | None = None,
        pipelined: bool = False,
    ) -> None:
        self.workers: dict[int, object] = dict(enumerate(workers))
        self.dispatch_mode = dispatch_mode  # "compiled", "actor", or why the graph fell back to actor calls
        self.dispatch: CompiledDispatch | PipelinedCompiledDispatch | ActorDispatch | None = None
        self._pipelined = pipelined  # a compiled graph whose workers answer one step late
        self.respawn_timeout_s = respawn_timeout_s
        self.counts = collections.Counter(dict.fromkeys(COUNTS, 0))
        self._sched = sched
        self._lock = lock  # the scheduler's
        self._spawn = spawn_worker
        self._incarnations: dict[int, str] = {}
        self._failures = collections.Counter()

    def start(self) -> None:
        """Waits for every worker's first answer, then builds the dispatcher."""
        for s, w in self.workers.items():
            self._incarnations[s] = ray.get(w.incarnation.remote(), timeout=self.respawn_timeout_s)
        self._build_dispatch()

    def close(self) -> None:
        if self.dispatch is not None:
            self.dispatch.close()

    def _build_dispatch(self) -> None:
        if self.dispatch_mode == "compiled":
            try:
                graph = PipelinedCompiledDispatch if self._pipelined else CompiledDispatch
                self.dispatch = graph(self.workers)
                return
            except Exception as e:  # e.g. channels unsupported here: plain actor calls still work
                self.dispatch_mode = f"actor (compiled graph failed: {e!r})"
        self.dispatch = ActorDispatch(self.workers)

    @property
    def pipelined(self) -> bool:
        """Whether the workers answer one step late (a compiled graph, with async scheduling)."""
        return isinstance(self.dispatch, PipelinedCompiledDispatch)

    def answered(self, shards) -> None:
        """These shards answered a step: their run of failures is over."""
        for s in shards:
            self._failures[s] = 0

    def recover(self, errors: dict[int, BaseException], lost: set[int]) -> None:
        """Brings every shard in `errors` back to a known state; `lost` had a real step in flight."""
        self.counts["recoveries"] += 1
        if self.dispatch.lockstep:
            self.dispatch.close()
        for s in sorted(errors):
            state = self._check_worker(s)
            if state == "kept" and s not in lost:
                continue
            if state == "kept":  # alive, but the step's answer is lost: start the shard over
                try:
                    ray.get(self.workers[s].reset.remote(), timeout=self.respawn_timeout_s)
                except Exception:  # it died meanwhile, or hangs
                    ray.kill(self.workers[s])
                    state = "gone"
            if state == "gone" and not self._replace_worker(s):
                self._drop(s)
                continue
            self._failures[s] += 1
            if self._failures[s] > MAX_FAILURES:
                logger.error("shard %d: last step error: %r", s, errors[s])
                kind = type(errors[s]).__name__
                raise EngineDead(f"shard {s} failed {self._failures[s]} steps in a row ({kind})")
            with self._lock:
                self._sched.reset_shard(s)
        if self.dispatch.lockstep:
            self._build_dispatch()
        else:
            self.dispatch.workers = dict(self.workers)

    def _check_worker(self, s: int) -> str:
        """'kept' (same process), 'restarted' (Ray restarted it: state lost) or 'gone'."""
        deadline = time.monotonic() + self.respawn_timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                inc = ray.get(self.workers[s].incarnation.remote(), timeout=left)
            except ActorDiedError:
                return "gone"
            except (RayActorError, GetTimeoutError):  # unreachable or restarting: try until the deadline
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                ray.kill(self.workers[s])
                return "gone"
            if inc == self._incarnations[s]:
                return "kept"
            self._incarnations[s] = inc
            self.counts["restarts"] += 1
            if not self._holds_pools(s, deadline):  # it sized its KV cache anew, smaller: replace it
                ray.kill(self.workers[s])
                return "gone"
            return "restarted"

    def _holds_pools(self, s: int, deadline: float) -> bool:
        """Whether shard s's worker has at least the blocks of the scheduler's pools in every group. A
        worker Ray restarted runs its first config again, and one that sized its cache from the device's
        memory measures anew (a replacement gets the fixed counts instead, `launch.start`)."""
        pools = self._sched.config.group_num_blocks
        try:
            blocks = ray.get(
                self.workers[s].kv_blocks.remote(), timeout=max(deadline - time.monotonic(), 1.0)
            )
        except Exception:
            return False
        if all(b >= p for b, p in zip(blocks, pools, strict=True)):
            return True
        logger.warning("shard %d restarted with KV blocks %s, fewer than the pools' %s", s, blocks, pools)
        return False

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
            self.workers[s] = handle
            self._incarnations[s] = inc
            self.counts["respawns"] += 1
            return True
        if handle is not None:
            ray.kill(handle)
        return False

    def _drop(self, s: int) -> None:
        if len(self.workers) == 1:
            raise EngineDead(f"shard {s}, the last one, is gone and no new worker came up")
        self.counts["drops"] += 1
        del self.workers[s]
        with self._lock:
            self._sched.drop_shard(s)
