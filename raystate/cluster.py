"""The Ray backend, seen from the caller: `Cluster` starts or finds a deployment, `RayClient` talks to it.

    cluster = Cluster.start(config, name="raystate", num_shards=2)
    rid = await cluster.add_request(prompt_ids, SamplingParams(max_tokens=32))
    async for update in cluster.stream():      # every request added through the cluster, as tokens come
        ...
    await cluster.shutdown()

A `Cluster` is a `RayClient`, the `raystate.client.Client` every front end uses (Ray Serve included), so
they run on this backend unchanged; `Cluster.connect(name)` attaches to a running deployment.

Protocol. A client submits requests in atomic batches (`AddBatch`, one actor call: one bad request
withdraws the batch and raises `InvalidRequest` naming the field and the limit) and one background thread
long-polls the scheduler actor for the `RequestUpdate`s of all its requests at once (`UpdateBatch`), so the
cost per step is one call per client, not one per request. A scheduler that died (its actor is gone, the
poll errors at once) or stopped answering (`poll_wait_s + grace_s`, 16 s by default) fails every pending
call with `EngineDead`: never a hang.

Routing is the scheduler's, by the one rule in `raystate.scheduler.router` (`route`): a new request goes
to the shard where its cached prefix saves the most prefill, weighed against how many requests the shard
holds, and stays there (a preempted one is re-queued there) unless the shard is lost: then its requests
are re-admitted on the restarted worker, or re-routed by the same rule when the shard is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raystate.client import Client, UpdateStream
from raystate.config import EngineConfig
from raystate.errors import EngineDead, InvalidRequest
from raystate.fanout import ChildRequest
from raystate.field_types import check_names
from raystate.messages import (
    AddBatch,
    AddRequest,
    RequestUpdate,
    SamplingParams,
    decode_rejected,
    decode_update_batch,
    encode,
    ids_to_bytes,
)

logger = logging.getLogger(__name__)

# Receives a request's updates, or the EngineDead that ends them; called from the poll thread.
Sink = Callable[[RequestUpdate | BaseException], None]


class LoopSink:
    """A `Sink` whose items are handled on an event loop: `on_loop(items)` runs there, in order.

    The poll thread hands each event loop one callback per poll batch carrying the updates of every
    `LoopSink` of that loop (one thread-safe hand-over and one wake-up per step, not one per request);
    called as a plain sink (an error, say), it hands its one item over on its own."""

    __slots__ = ("loop", "on_loop")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_loop: Callable[[list[RequestUpdate | BaseException]], None]
    ) -> None:
        self.loop = loop
        self.on_loop = on_loop

    def __call__(self, item: RequestUpdate | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.on_loop, [item])


def _run_on_loop(batches: list[tuple[LoopSink, list[RequestUpdate]]]) -> None:
    """On an event loop: one poll batch's updates, to each of that loop's sinks."""
    for sink, items in batches:
        try:
            sink.on_loop(items)
        except Exception:  # one sink's failure must not starve the others
            logger.exception("delivering updates failed")


def _engine_error(e: BaseException, what: str) -> BaseException:
    """The error a caller sees when a call to the scheduler actor failed."""
    if isinstance(e, RayTaskError) and isinstance(e.cause, EngineDead):
        return EngineDead(str(e.cause))
    if isinstance(e, RayActorError):
        return EngineDead(f"{what}: the scheduler actor is gone ({type(e).__name__})")
    if isinstance(e, GetTimeoutError | TimeoutError):
        return EngineDead(f"{what}: the scheduler actor did not answer in time")
    return e


class RayClient(Client):
    """`Client` over a deployment's scheduler actor. Thread-safe; usable from any event loop."""

    def __init__(
        self,
        scheduler,
        config: EngineConfig,
        on_shutdown: Callable[[], None] | None = None,
        poll_wait_s: float = 1.0,
        grace_s: float = 15.0,
        call_timeout_s: float = 25.0,
    ) -> None:
        self._scheduler = scheduler
        self._config = config
        self._on_shutdown = on_shutdown
        self.poll_wait_s = poll_wait_s
        self.grace_s = grace_s
        self.call_timeout_s = call_timeout_s
        self.client_id = uuid.uuid4().hex
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._poller: threading.Thread | None = None
        self._dead: EngineDead | None = None
        self._closed = False

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def scheduler(self):
        return self._scheduler

    def new_request_id(self) -> str:
        return f"{self.client_id[:8]}-{next(self._ids)}"

    # -- submitting ----------------------------------------------------------------------------------------

    def _encode_batch(self, items: Sequence[tuple]) -> bytes:
        """`items`: (request id, prompt ids, sampling[, fork_of]) tuples (fork_of: `raystate.fanout`)."""
        reqs = []
        for rid, ids, sampling, *fork in items:
            if not isinstance(sampling, SamplingParams):
                raise InvalidRequest("sampling", "a SamplingParams", type(sampling).__name__)
            try:
                data = ids_to_bytes(ids)
            except (TypeError, OverflowError) as e:
                raise InvalidRequest("prompt_token_ids", "a list of int32 token ids", str(e)) from None
            reqs.append(AddRequest(rid, data, sampling, (fork[0] if fork else None) or ""))
        return encode(AddBatch(self.client_id, reqs))

    def _register(self, rids: list[str], sink: Sink) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDead(str(self._dead))
            if self._closed:
                raise EngineDead("the client is shut down")
            taken = [rid for rid in rids if rid in self._sinks]
            if taken or len(set(rids)) < len(rids):
                raise InvalidRequest("request_id", "unique among unfinished requests", taken or rids)
            for rid in rids:
                self._sinks[rid] = sink
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll_loop, name="raystate-poll", daemon=True)
                self._poller.start()

    def _unregister(self, rids: list[str]) -> None:
        with self._lock:
            for rid in rids:
                self._sinks.pop(rid, None)

    def _accepted(self, reply: bytes, rids: list[str]) -> None:
        if reply:
            self._unregister(rids)
            raise decode_rejected(reply).to_error()

    def submit(self, items: Sequence[tuple[str, list[int], SamplingParams]], sink: Sink) -> None:
        """Blocking: queues (request id, prompt ids, sampling) triples atomically; updates go to `sink`."""
        data = self._encode_batch(items)
        rids = [item[0] for item in items]
        self._register(rids, sink)
        try:
            reply = ray.get(self._scheduler.add_requests.remote(data), timeout=self.call_timeout_s)
        except Exception as e:
            self._unregister(rids)
            raise _engine_error(e, "add_requests") from e
        self._accepted(reply, rids)

    async def submit_async(self, items: Sequence[tuple[str, list[int], SamplingParams]], sink: Sink) -> None:
        data = self._encode_batch(items)
        rids = [item[0] for item in items]
        self._register(rids, sink)
        try:
            reply = await self._call(self._scheduler.add_requests.remote(data), "add_requests")
        except BaseException:
            self._unregister(rids)
            raise
        self._accepted(reply, rids)

    async def _call(self, ref, what: str, timeout_s: float | None = None):
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s or self.call_timeout_s)
        except Exception as e:
            raise _engine_error(e, what) from e

    # -- the poll thread -----------------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._sinks:
                    self._poller = None
                    return
            ref = self._scheduler.poll.remote(self.client_id, self.poll_wait_s)
            try:
                batch = decode_update_batch(ray.get(ref, timeout=self.poll_wait_s + self.grace_s))
            except Exception as e:
                self._fail(_engine_error(e, "poll"))
                return
            if batch.updates:
                self._dispatch(batch.updates)
            if batch.error is not None:
                self._fail(EngineDead(batch.error))
                return

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        """Hands one poll batch's updates to their sinks: the `LoopSink`s' grouped per event loop, one
        `call_soon_threadsafe` per loop carrying them all; any other sink called per update."""
        loops: dict[asyncio.AbstractEventLoop, dict[LoopSink, list[RequestUpdate]]] = {}
        plain: list[tuple[Sink, RequestUpdate]] = []
        sinks = self._sinks
        with self._lock:  # once per batch
            for u in updates:
                sink = sinks.pop(u.req_id, None) if u.finished else sinks.get(u.req_id)
                if sink is None:
                    continue
                if type(sink) is LoopSink:
                    loops.setdefault(sink.loop, {}).setdefault(sink, []).append(u)
                else:
                    plain.append((sink, u))
        for loop, by_sink in loops.items():
            try:
                loop.call_soon_threadsafe(_run_on_loop, list(by_sink.items()))
            except RuntimeError:  # the event loop is closed: its callers are gone
                self._unregister([u.req_id for items in by_sink.values() for u in items])
        for sink, u in plain:
            try:
                sink(u)
            except RuntimeError:  # its event loop is closed: the caller is gone
                self._unregister([u.req_id])

    def _fail(self, error: BaseException) -> None:
        if not isinstance(error, EngineDead):
            error = EngineDead(f"poll failed: {error!r}")
        with self._lock:
            self._dead = error
            sinks = list({id(s): s for s in self._sinks.values()}.values())  # each sink once
            self._sinks.clear()
            self._poller = None
        for sink in sinks:
            with contextlib.suppress(RuntimeError):  # its event loop is closed: the caller is gone
                sink(error)

    # -- the Client API ------------------------------------------------------------------------------------

    async def generate_group(self, requests: list[ChildRequest]) -> list[AsyncIterator[RequestUpdate]]:
        loop = asyncio.get_running_loop()
        queues = {r.req_id: asyncio.Queue() for r in requests}

        def deliver(items: list) -> None:  # on the event loop: an update to its request, an error to all
            for item in items:
                if isinstance(item, BaseException):
                    for q in queues.values():
                        q.put_nowait(item)
                elif (q := queues.get(item.req_id)) is not None:
                    q.put_nowait(item)

        await self.submit_async(
            [(r.req_id, list(r.prompt_token_ids), r.sampling, r.fork_of) for r in requests],
            LoopSink(loop, deliver),
        )
        return [self._updates(rid, q) for rid, q in queues.items()]

    def _updates(self, rid: str, queue: asyncio.Queue) -> UpdateStream:
        def on_end(finished: bool) -> None:
            if not finished:
                self.abort_nowait([rid])  # the caller went away

        return UpdateStream(queue, on_end, lambda e: EngineDead(str(e)))

    async def abort(self, request_id: str) -> None:
        await self._call(self._scheduler.abort.remote(request_id), "abort")

    def abort_nowait(self, request_ids) -> None:
        """Fire and forget: aborts these requests unless the engine is already gone."""
        self._unregister(list(request_ids))
        if self._dead is None:
            for rid in request_ids:
                self._scheduler.abort.remote(rid)

    async def health(self, timeout_s: float = 60.0) -> bool:
        return await self._call(self._scheduler.health.remote(timeout_s), "health", timeout_s + 10.0)

    async def check_alive(self) -> None:
        await self._call(self._scheduler.check_alive.remote(), "check_alive")

    async def status(self) -> dict[str, Any]:
        return await self._call(self._scheduler.status.remote(), "status")

    async def request_shard(self, request_id: str) -> int:
        """The shard an unfinished request was routed to (-1 once finished or unknown)."""
        return await self._call(self._scheduler.request_shard.remote(request_id), "request_shard")

    def close(self) -> None:
        """Stops polling; requests still running are left to the deployment (it aborts them later)."""
        with self._lock:
            self._closed = True
            poller = self._poller
        if poller is not None:
            poller.join(self.poll_wait_s + self.grace_s)

    async def shutdown(self) -> None:
        """Closes the client; a client that started its deployment also stops the deployment."""
        await asyncio.to_thread(self.close)
        if self._on_shutdown is not None:
            await asyncio.to_thread(self._on_shutdown)


def ensure_ray(address: str | None) -> None:
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)


class Cluster(RayClient):
    """A Ray deployment of the engine (a scheduler actor, one worker actor per shard) and a client of it.

    Being a `RayClient`, it is the `Client` front ends take. `shutdown()` stops the deployment when this
    process started it and only closes the client when it connected; `stop()` always stops it.
    """

    def __init__(self, name: str, scheduler, config: EngineConfig, deployment=None) -> None:
        super().__init__(scheduler, config, on_shutdown=self._stop_deployment if deployment else None)
        self.name = name
        self.deployment = deployment  # launch.Deployment when this process started it
        self._queue: asyncio.Queue | None = None
        self._queue_loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[str] = set()

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        name: str = "raystate",
        num_shards: int = 1,
        address: str | None = None,
        **options: Any,
    ) -> Cluster:
        """Starts a deployment (connecting to Ray at `address`, or a local one, first if needed).

        `options` are `raystate.launch.LaunchOptions` fields: dispatch="compiled" | "actor",
        num_cpus_per_shard, num_gpus_per_shard, worker_env, step_timeout_s, detached, ...
        """
        from raystate import launch

        check_names(launch.LaunchOptions, options, "a launch option")
        ensure_ray(address)
        deployment = launch.start(config, launch.LaunchOptions(name=name, num_shards=num_shards, **options))
        return cls(name, deployment.scheduler, deployment.config, deployment)

    @classmethod
    def connect(cls, name: str = "raystate", address: str | None = None) -> Cluster:
        """Attaches to a running deployment by name (its Ray namespace); InvalidRequest (a ValueError)
        when there is none."""
        from raystate.launch import SCHEDULER_NAME

        ensure_ray(address or "auto")
        try:
            scheduler = ray.get_actor(SCHEDULER_NAME, namespace=name)
        except ValueError:
            raise InvalidRequest("name", "a running deployment", name) from None
        return cls(name, scheduler, ray.get(scheduler.get_config.remote()))

    async def add_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a request whose updates come out of `stream()`; returns its id."""
        loop = asyncio.get_running_loop()
        if self._queue is None or self._queue_loop is not loop:  # the stream lives in the caller's loop
            self._queue, self._queue_loop = asyncio.Queue(), loop
        queue = self._queue
        rid = request_id or self.new_request_id()
        self._pending.add(rid)
        try:
            await self.submit_async(
                [(rid, list(prompt_token_ids), sampling or SamplingParams())],
                LoopSink(loop, lambda items: [queue.put_nowait(u) for u in items]),
            )
        except BaseException:
            self._pending.discard(rid)
            raise
        return rid

    async def stream(self) -> AsyncIterator[RequestUpdate]:
        """Updates of the requests added through `add_request`, in arrival order, until none is left."""
        while self._pending:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._pending.clear()
                raise EngineDead(str(item)) from item
            if item.finished:
                self._pending.discard(item.req_id)
            yield item

    def _stop_deployment(self) -> None:
        from raystate import launch

        try:
            current = ray.get_actor(launch.SCHEDULER_NAME, namespace=self.name)
        except ValueError:
            current = None
        if current is not None and current != self._scheduler:
            # Ours died and another process (a replacement Serve replica) started a deployment under
            # the same name: stop nothing by name, only what is ours.
            launch.kill(self._scheduler, self.deployment.workers if self.deployment else [], None)
            return
        launch.stop(self.name, self.deployment.placement_group if self.deployment else None)

    def stop(self) -> None:
        """Blocking: closes the client and stops the deployment, whoever started it."""
        self.close()
        self._stop_deployment()
