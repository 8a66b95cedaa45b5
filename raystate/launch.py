"""Starting and stopping a deployment: one placement group, one worker actor per shard, the scheduler.

The one module that imports both actor classes. Placement: one placement group per deployment with one
bundle per shard (`{"GPU": 1, "CPU": c}` on GPUs; on the CPU the same code with `{"CPU": c}` bundles),
strategy PACK by default. Shards are numbered node by node (bundles sorted by node address, then index),
so neighbouring shards share a node. Actors are named in a Ray namespace named after the deployment:
`worker-{i}` and `scheduler`, so tools and tests find them with `ray.get_actor(name, namespace=...)`.

The scheduler actor goes to the node that starts the deployment (softly) and is never restarted: its
state cannot be rebuilt, and clients turn its death into `EngineDead`. Workers restart up to
`max_worker_restarts` times; one that is gone for good is replaced in its bundle by the scheduler through
`WorkerSpawner`, which travels to the scheduler actor pickled.

Environment variables named `RAYSTATE_*` in the starting process (e.g. `RAYSTATE_KERNELS=reference`) are
passed on to the worker actors, merged with `LaunchOptions.worker_env`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from raystate.config import EngineConfig
from raystate.errors import InvalidRequest
from raystate.field_types import check_field_types
from raystate.scheduler.actor import SchedulerActor
from raystate.worker.actor import WorkerActor

SCHEDULER_NAME = "scheduler"


def worker_name(shard: int) -> str:
    return f"worker-{shard}"


@dataclass(frozen=True)
class LaunchOptions:
    """How a deployment is placed and run (the engine itself is configured by `EngineConfig`)."""

    name: str = "raystate"  # deployment name = Ray namespace of its actors
    num_shards: int = 1
    # "compiled" (Ray Compiled Graph: fastest; each worker spins a CPU core polling its channel) or
    # "actor" (plain actor calls: ~1 ms per step more, nothing spins).
    dispatch: str = "compiled"
    # With "compiled" and async scheduling: each worker launches the next step before it answers the last
    # one (`PipelinedCompiledDispatch`), so its device need not idle while answers and messages travel.
    # On by default since measured on a GPU: the decode step 0.87x of the unpipelined one at batch 1, 8
    # and 64, tokens equal (bench/bench_backends.py, H100, BENCHMARKS.md); RAYSTATE_PIPELINE_STEPS=0 in
    # the environment turns it off where no option reaches.
    pipeline_steps: bool = field(default_factory=lambda: os.environ.get("RAYSTATE_PIPELINE_STEPS") != "0")
    num_gpus_per_shard: float | None = None  # None: 1 when config.device is CUDA, else 0
    num_cpus_per_shard: float = 1.0
    scheduler_num_cpus: float = 0.0
    scheduler_node_id: str | None = None  # None: the node of the process that starts the deployment
    placement_strategy: str = "PACK"
    worker_env: dict[str, str] = field(default_factory=dict)
    max_worker_restarts: int = 3
    step_timeout_s: float = 120.0  # a step that takes longer counts as a fault
    probe_interval_s: float = 2.0  # an idle engine sends an empty step to every shard this often
    respawn_timeout_s: float = 60.0  # how long a worker may take to come back before its shard is dropped
    start_timeout_s: float = 300.0  # placement, then every worker up (model loaded)
    detached: bool = False  # actors outlive the starting process (stop them with `stop(name)`)
    dry_run: bool = False  # workers answer every step without a model (dispatch benchmarks)

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.num_shards < 1:
            raise InvalidRequest("num_shards", ">= 1", self.num_shards)
        if self.dispatch not in ("compiled", "actor"):
            raise InvalidRequest("dispatch", "'compiled' or 'actor'", self.dispatch)
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise InvalidRequest(
                "placement_strategy", "PACK, SPREAD, STRICT_PACK or STRICT_SPREAD", self.placement_strategy
            )


@dataclass
class Deployment:
    name: str
    scheduler: object  # ActorHandle
    workers: list  # ActorHandle per shard
    placement_group: PlacementGroup
    dispatch: str  # the dispatch in use (a failed graph compile falls back to actor calls)
    config: EngineConfig  # the deployment's: KV blocks per group fixed (`smallest_blocks`)


def _gpus(config: EngineConfig, options: LaunchOptions) -> float:
    if options.num_gpus_per_shard is not None:
        return options.num_gpus_per_shard
    return 1.0 if config.device.startswith("cuda") else 0.0


def _bundle(config: EngineConfig, options: LaunchOptions) -> dict[str, float]:
    bundle = {"CPU": options.num_cpus_per_shard, "GPU": _gpus(config, options)}
    bundle = {k: v for k, v in bundle.items() if v > 0}
    if not bundle:
        raise InvalidRequest("num_cpus_per_shard", "> 0 when a shard has no GPU", options.num_cpus_per_shard)
    return bundle


def _node_sorted_bundles(pg: PlacementGroup) -> list[int]:
    """Bundle indices ordered by node address (then node id and index): shard i -> result[i]."""
    to_node = placement_group_table(pg)["bundles_to_node_id"]
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return sorted(to_node, key=lambda b: (address.get(to_node[b], ""), to_node[b], b))


@dataclass(frozen=True)
class WorkerSpawner:
    """Creates shard i's worker actor in its placement bundle (at start, and when a worker is replaced)."""

    config: EngineConfig
    options: LaunchOptions
    placement_group: PlacementGroup
    bundle_of_shard: tuple[int, ...]
    env: dict[str, str]

    def __call__(self, shard: int):
        opts = self.options
        return (
            ray.remote(WorkerActor)
            .options(
                name=worker_name(shard),
                namespace=opts.name,
                num_cpus=opts.num_cpus_per_shard,
                num_gpus=_gpus(self.config, opts),
                max_restarts=opts.max_worker_restarts,
                max_task_retries=0,
                lifetime="detached" if opts.detached else None,
                runtime_env={"env_vars": self.env} if self.env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=self.bundle_of_shard[shard]
                ),
            )
            .remote(self.config, shard, opts.dry_run)
        )


def exists(name: str) -> bool:
    try:
        ray.get_actor(SCHEDULER_NAME, namespace=name)
    except ValueError:
        return False
    return True


def starting(name: str) -> bool:
    """Whether another process is starting deployment `name`: its placement group (the first thing
    `start` creates, removed if the start fails) exists, its scheduler (the last) not yet."""
    try:
        pg = get_placement_group(f"raystate-{name}")
    except ValueError:
        return False
    return pg is not None and not exists(name)


def wait_started(name: str, timeout_s: float) -> bool:
    """Waits while another process starts deployment `name` (`starting`); True once it runs, False when
    no start is in progress (or it failed, or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if exists(name):
            return True
        if not starting(name):
            return exists(name)
        time.sleep(0.2)
    return False


def free_name(base: str = "raystate") -> str:
    """`base`, or `base-2`, `base-3`, ... : the first deployment name not in use."""
    name, n = base, 1
    while exists(name):
        n += 1
        name = f"{base}-{n}"
    return name


def start(config: EngineConfig, options: LaunchOptions) -> Deployment:
    """Places and starts a deployment; returns once every worker answered and the step loop runs."""
    if exists(options.name):
        raise InvalidRequest("name", "a deployment name not in use", options.name)
    bundles = [_bundle(config, options)] * options.num_shards
    pg = placement_group(
        bundles,
        strategy=options.placement_strategy,
        name=f"raystate-{options.name}",
        lifetime="detached" if options.detached else None,
    )
    try:
        ray.get(pg.ready(), timeout=options.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise InvalidRequest(
            "num_shards", f"placeable within {options.start_timeout_s} s: bundles {bundles}", options
        ) from None
    env = {k: v for k, v in os.environ.items() if k.startswith("RAYSTATE_")}
    env.update(options.worker_env)
    spawner = WorkerSpawner(config, options, pg, tuple(_node_sorted_bundles(pg)), env)
    workers = [spawner(i) for i in range(options.num_shards)]
    try:
        ray.get([w.incarnation.remote() for w in workers], timeout=options.start_timeout_s)
        if config.kv_sized_at_start:
            measured = ray.get([w.kv_blocks.remote() for w in workers], timeout=options.start_timeout_s)
            config = config.with_group_blocks(smallest_blocks(measured))
            # A replacement worker allocates exactly the pools the scheduler runs.
            spawner = dataclasses.replace(spawner, config=config)
    except BaseException:
        kill(None, workers, pg)
        raise
    scheduler = (
        ray.remote(SchedulerActor)
        .options(
            name=SCHEDULER_NAME,
            namespace=options.name,
            num_cpus=options.scheduler_num_cpus,
            max_restarts=0,
            lifetime="detached" if options.detached else None,
            # A node the caller named is a must; the caller's own node only a preference.
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                options.scheduler_node_id or ray.get_runtime_context().get_node_id(),
                soft=options.scheduler_node_id is None,
            ),
        )
        .remote(
            config,
            workers,
            name=options.name,
            dispatch=options.dispatch,
            pipeline_steps=options.pipeline_steps,
            step_timeout_s=options.step_timeout_s,
            probe_interval_s=options.probe_interval_s,
            respawn_timeout_s=options.respawn_timeout_s,
            spawn_worker=spawner,
        )
    )
    try:
        dispatch = ray.get(scheduler.start.remote())
    except BaseException:
        kill(scheduler, workers, pg)
        raise
    return Deployment(options.name, scheduler, workers, pg, dispatch, config)


def smallest_blocks(measured: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The KV blocks per group that every shard has: shards that sized their caches from their own
    device's memory may differ (another GPU model, another process's memory), and the scheduler gives
    every shard the same pools, so a shard with more blocks leaves its extra ones unused."""
    return tuple(min(counts) for counts in zip(*measured, strict=True))


def stop(name: str, placement_group: PlacementGroup | None = None, timeout_s: float = 30.0) -> None:
    """Stops the step loop (tearing its compiled graph down), then kills the actors and frees the bundles.
    Safe to call twice, and after the scheduler died."""
    scheduler, workers = None, []
    try:
        scheduler = ray.get_actor(SCHEDULER_NAME, namespace=name)
        workers = list(ray.get(scheduler.workers.remote(), timeout=timeout_s).values())
        ray.get(scheduler.shutdown.remote(), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayError):
        pass  # no scheduler (any more): kill what is left
    misses, shard = 0, 0
    while misses < 8:  # also the workers a dead scheduler cannot name (a dropped shard leaves a gap)
        try:
            workers.append(ray.get_actor(worker_name(shard), namespace=name))
            misses = 0
        except ValueError:
            misses += 1
        shard += 1
    if placement_group is None:
        try:
            placement_group = ray.util.get_placement_group(f"raystate-{name}")
        except ValueError:
            placement_group = None
    kill(scheduler, workers, placement_group)


# How long `kill` waits for the killed workers' processes on this node to exit.
KILL_WAIT_S = 20.0


def kill(scheduler, workers: list, pg: PlacementGroup | None, wait_s: float = KILL_WAIT_S) -> None:
    """Kills these actors and frees the bundles; what is already gone is skipped. Returns once the
    workers' processes on this node have exited (at most `wait_s`): Ray reports an actor dead before its
    process is gone, and until then its GPU memory is held, so an engine started right after on the same
    GPU (a script's next `LLM(...)`, a retry with a smaller share) would find it taken."""
    local_pids = _local_pids(workers)
    for handle in [h for h in (scheduler, *workers) if h is not None]:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(handle)
    if pg is not None:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
    deadline = time.monotonic() + wait_s
    while local_pids and time.monotonic() < deadline:
        local_pids = [pid for pid in local_pids if _process_exists(pid)]
        if local_pids:
            time.sleep(0.01)


def _local_pids(workers: list, timeout_s: float = 2.0) -> list[int]:
    """The process ids of the workers (those still answering) that run on this node."""
    refs = [w.where.remote() for w in workers if w is not None]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    node = ray.get_runtime_context().get_node_id()
    pids = []
    for ref in ready:
        with contextlib.suppress(Exception):  # died, or died starting
            where = ray.get(ref)
            if where["node_id"] == node and where["pid"] != os.getpid():
                pids.append(where["pid"])
    return pids


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True
