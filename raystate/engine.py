"""The in-process backend: the scheduler and one worker in one process.

It is the debugging backend and the seam the Ray backend drops into: the scheduler plans `StepMessage`s,
each is encoded once and decoded by the worker exactly as it would be across an actor boundary, and the
worker's `StepResult` goes back to the scheduler.
"""

from __future__ import annotations

from raystate.config import EngineConfig
from raystate.messages import SamplingParams, decode_step, encode
from raystate.scheduler import RequestUpdate, Scheduler
from raystate.worker.worker import Worker


class InProcessEngine:
    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.config = config
        self.scheduler = Scheduler(config, num_shards=1)
        self.worker = worker if worker is not None else Worker(config)

    def add_request(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        self.scheduler.add_request(req_id, prompt_token_ids, sampling)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for shard, msg in self.scheduler.schedule().items():
            result = self.worker.execute(decode_step(encode(msg)))
            updates.extend(self.scheduler.update(shard, result))
        return updates

    def shutdown(self) -> None:
        pass
