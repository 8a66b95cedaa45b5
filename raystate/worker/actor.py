"""WorkerActor: one model-state shard behind a Ray actor (one per GPU, or per CPU device in tests).

The scheduler actor sends each step as msgspec bytes, encoded once on its side; the actor decodes them with
`decode_step`, runs `Worker.execute` and answers with the encoded `StepResult`: a plain actor call, or a
node of the scheduler's compiled graph. With `pipeline_steps` (and async scheduling) the graph runs
`execute_behind` instead, which may answer a step with the next message's reply, so the device runs that
step while its answer travels and the next message comes.

The class is a plain class (`launch.py` applies `ray.remote` with the placement and restart options), and
torch is imported only when a real worker is built, so importing this module stays light. The device comes
from the config, never from the Ray resource: tests give actors fake GPUs and run them on the CPU.

`incarnation` is drawn anew each time the process starts, so the scheduler can tell a live shard that
kept its state from one Ray restarted (state lost) after a fault.

Start-up is logged: a Ray worker process leaves our INFO records unshown (no handler, root at WARNING), so
the actor gives the `raystate` logger one stderr handler (`show_info_on_stderr`), which Ray forwards to
the driver's console under the actor's prefix: the worker's line per start-up phase as it ends (weights,
buffers, kv_cache, cuda_graphs) with its seconds, then its "ready" line. `startup_phases()` returns them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid

from raystate.config import DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from raystate.messages import StepMessage, StepResult, decode_step, encode, ids_to_bytes

_STDERR_HANDLER = "raystate-stderr"  # the name of the handler `show_info_on_stderr` adds


def show_info_on_stderr() -> None:
    """Lets the `raystate` logger's INFO records through, to stderr: its level is lowered to INFO, and a
    stderr handler is added unless a handler on its way up already takes INFO (one added before, or one
    the job configured, e.g. Ray's `LoggingConfig` on the root logger), so no line is shown twice."""
    log = logging.getLogger("raystate")
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    node: logging.Logger | None = log
    while node is not None:
        if any(h.level <= logging.INFO for h in node.handlers):
            return
        node = node.parent if node.propagate else None
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_STDERR_HANDLER)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)


def shared_gpu_config(config: EngineConfig, gpu_fraction: float) -> EngineConfig:
    """A shard given a fraction of a GPU (num_gpus_per_shard < 1) that sizes its KV cache from the device
    takes that fraction of the default share, so the shards on one GPU together take the default; a
    gpu_memory_utilization the user set is each shard's own share, as given."""
    if not (
        config.kv_sized_at_start and config.cache.gpu_memory_utilization is None and 0 < gpu_fraction < 1
    ):
        return config
    share = DEFAULT_GPU_MEMORY_UTILIZATION * gpu_fraction
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, gpu_memory_utilization=share))


def _assigned_gpus() -> float:
    """The GPUs Ray reserved for this actor (a fraction when shards share one); 1 outside a Ray worker."""
    import ray

    try:
        return float(ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0))
    except Exception:  # not a Ray worker process (a test builds the actor class directly)
        return 1.0


def _done_at_launch(pending) -> bool:
    """Whether a launched step's answer is there without waiting (a dry run's or a host-side step's)."""
    return isinstance(pending, StepResult) or getattr(pending, "result", None) is not None


class WorkerActor:
    def __init__(self, config: EngineConfig, shard: int, dry_run: bool = False) -> None:
        show_info_on_stderr()
        self.config = config
        self.shard = shard
        self.dry_run = dry_run
        self._incarnation = uuid.uuid4().hex
        self.worker = None
        self._held = None  # the step `execute_behind` launched and has not answered yet
        self._held_for = ""  # the dispatcher it was held for
        if not dry_run:
            from raystate.worker.worker import Worker

            if config.kv_sized_at_start:
                config = shared_gpu_config(config, _assigned_gpus())
            self.worker = Worker(config)

    def execute(self, data: bytes) -> bytes:
        """One step: StepMessage bytes in, StepResult bytes out."""
        return encode(self._finish(self._launch(decode_step(data))))

    def execute_behind(self, data: bytes, hold: bool, sender: str = "") -> list[bytes]:
        """One step, answered one message late when `hold` allows and its device work is still running
        after launch (a graph decode step): the step is launched, then the step held back by the last
        message (if any) is finished, and this one is held in turn, so its device work runs while its
        answer travels back and the scheduler plans and sends the next message. A step done at launch (on
        the host, or sampled there) is answered at once: holding it would only delay the answer. Returns
        the encoded StepResults finished now, oldest first (0, 1 or 2).

        Why: `execute` waits for the step's device work before it returns, and the next message is read
        only after that, so the GPU idles for the answer's encoding, the channel hop and the next launch.
        The scheduler's dispatcher (`dispatch.PipelinedDispatch`) knows which answer is whose. `sender`
        names it: a step held for another one is dropped unanswered, so a graph rebuilt after a fault never
        gets an answer it did not ask for (recovery resets every shard that had a step in flight, which
        drops its held step too; this guards whatever that misses)."""
        pending = self._launch(decode_step(data))
        done = []
        if self._held is not None:
            held, self._held = self._held, None
            if self._held_for == sender:
                done.append(encode(self._finish(held)))
        if hold and not _done_at_launch(pending):
            self._held, self._held_for = pending, sender
        else:
            done.append(encode(self._finish(pending)))
        return done

    def _launch(self, msg: StepMessage):
        if self.worker is None:  # dry run: answer every row without running the model
            rows = [r.req_id for r in msg.new_requests if r.num_scheduled > 0]
            rows += [r.req_id for r in msg.running]
            return StepResult(msg.step_id, rows, ids_to_bytes([0] * len(rows)))
        return self.worker.launch(msg)

    def _finish(self, pending) -> StepResult:
        return pending if self.worker is None else self.worker.finish(pending)

    def kv_blocks(self) -> tuple[int, ...]:
        """This worker's KV cache blocks per group (on CUDA with no size set, what it measured at start;
        a dry run: the config's small default)."""
        if self.worker is None:
            return self.config.static_group_blocks()
        return self.worker.config.group_num_blocks

    def incarnation(self) -> str:
        """Identifies this process's life: a different value after Ray restarted the actor."""
        return self._incarnation

    def reset(self) -> int:
        """Drops every request (their device state is stale after a lost step); returns how many."""
        self._held = None
        if self.worker is None:
            return 0
        return self.worker.reset()

    def num_active(self) -> int:
        return 0 if self.worker is None else self.worker.num_active()

    def startup_phases(self) -> dict[str, float]:
        """Seconds of each start-up phase of this process's worker, in order (weights, buffers, kv_cache,
        cuda_graphs when captured); empty for a dry run."""
        return {} if self.worker is None else dict(self.worker.startup_s)

    def where(self) -> dict:
        """Node, process and device of this shard (for tools and tests)."""
        import ray

        return {
            "shard": self.shard,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "device": self.config.device,
            "incarnation": self._incarnation,
        }

    def crash(self) -> None:
        """Ends the process abruptly, as a crash would (fault tests: Ray restarts the actor)."""
        os._exit(1)
