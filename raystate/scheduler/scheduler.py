"""The scheduler: request intake and validation, routing to shards, one StepMessage per shard and step.

It holds every request's token ids, every shard's block pools and prefix index, and every replay start
(DESIGN section 5); it never imports torch or ray, and does no I/O. The step loop (`StepDriver`, driver.py,
for every backend) calls it:

    messages = scheduler.schedule()          # {shard: StepMessage}
    for shard, msg in messages.items():
        result = worker[shard].execute(msg)  # StepResult, rows in the message's row order
        updates = scheduler.update(shard, result)

A shard gets its next normal step only once its messages in flight are answered; with
`schedule(lookahead=True)` (async scheduling) it may also get a decode step planned on top of the one in
flight, so up to two are in flight per shard, and their answers must be applied in the order sent.
Batch rows of a message are its new_requests (all scheduled) then its running deltas; the worker samples
a row only when its chunk reaches the end of the known tokens (num_computed + num_scheduled == prompt +
outputs) and returns -1 otherwise. A decode row schedules 1 token, the last sampled one (a lookahead
row: the one its step in flight samples, already on the worker's device); replay_start travels only in
NewRequest and applies to prefill chunks; the worker runs decode rows with 0.
"""

from __future__ import annotations

import array
import dataclasses
import struct

import numpy as np

from raystate.config import EngineConfig
from raystate.errors import InvalidRequest
from raystate.messages import RequestUpdate, SamplingParams, StepMessage, StepResult
from raystate.scheduler.prefix_cache import PromptHasher
from raystate.scheduler.request import Request, RequestStatus
from raystate.scheduler.router import DEFAULT_LOAD_PENALTY, route
from raystate.scheduler.shard_scheduler import ShardScheduler

__all__ = ["RequestUpdate", "Scheduler", "SchedulerStats"]


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_running: list[int]  # per shard
    num_waiting: list[int]  # per shard (preempted requests included)
    num_free_blocks: list[list[int]]  # per shard, per group: free + evictable cached blocks
    prefix_hit_tokens: int  # sum of the hits h used at admissions
    replayed_tokens: int  # sum of h - replay_start over replayed admissions (window KV rebuilt)
    num_preemptions: int
    # sum of h - replay_start over admissions that borrowed a window rebuilt in the same step
    shared_replay_tokens: int = 0
    # sum of the prompt tokens n > 1 siblings took from the sibling that computed the prompt (forks)
    forked_tokens: int = 0


# A request siblings may wait on: not yet finished or aborted (its prompt is checked apart).
_FORKABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING)


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_shards: int = 1, load_penalty: float = DEFAULT_LOAD_PENALTY
    ) -> None:
        if num_shards < 1:
            raise InvalidRequest("num_shards", ">= 1", num_shards)
        self.config = config
        self.num_shards = num_shards
        self.load_penalty = load_penalty
        self.shards = [ShardScheduler(s, config) for s in range(num_shards)]
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._next_arrival = 0
        self._step_id = 0
        self.dropped: set[int] = set()  # shards whose workers could not be brought back
        kv = self.shards[0].kv
        self._block_size = kv.block_size
        self._max_tokens_held = kv.max_tokens_held
        # Prompts are hashed only where blocks can be cached (the hashes key the prefix index).
        self._prompt_hasher = PromptHasher(kv.block_size) if kv.caching else None

    # -- intake ------------------------------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        shard: int | None = None,
        fork_of: str | None = None,
    ) -> None:
        """Queues a request on the shard the router picks. Raises InvalidRequest (a ValueError naming the
        field and the limit) before changing anything, so no accepted request is affected.

        `fork_of`: the id of a sibling with the same prompt (one of a request's n choices). While that
        sibling has not had its last prompt chunk scheduled, this one waits on it and is then forked from
        it: it shares the prompt's KV blocks (up to the block holding the last prompt token, which it
        computes itself) instead of computing the prompt again (`ShardScheduler._fork_siblings`). Else,
        or when it cannot be forked then, it is queued as any request (a prefix-cache hit, if any)."""
        model = self.config.model
        vocab = model.vocab_size
        max_len = self.config.max_model_len
        if not isinstance(req_id, str) or not req_id:
            raise InvalidRequest("req_id", "a non-empty string", req_id)
        if req_id in self._requests:
            raise InvalidRequest("req_id", "unique among unfinished requests", req_id)
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest("sampling", "a SamplingParams", type(sampling).__name__)
        tokens = array.array("i")
        try:  # struct packs a list about 3x faster than array("i", list) does
            tokens.frombytes(struct.pack(f"={len(prompt_token_ids)}i", *prompt_token_ids))
        except (TypeError, struct.error) as e:
            raise InvalidRequest("prompt_token_ids", f"a list of ints in [0, {vocab})", str(e)) from None
        n = len(tokens)
        if n == 0:
            raise InvalidRequest("prompt_token_ids", "non-empty", [])
        ids = np.frombuffer(tokens, dtype=np.int32)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            raise InvalidRequest("prompt_token_ids", f"ids in [0, {vocab})", lo if lo < 0 else hi)
        limit = min(max_len, self._max_tokens_held)
        why = (
            f"max_model_len={max_len}"
            if limit == max_len
            else f"the KV cache holds {limit} tokens per request"
        )
        if n >= limit:
            raise InvalidRequest("prompt_token_ids", f"fewer than {limit} tokens ({why})", n)
        sampling.validate(vocab)
        if sampling.n != 1:
            raise InvalidRequest("n", "1 per engine request (raystate.fanout makes n requests)", sampling.n)
        if n + sampling.max_tokens > limit:
            raise InvalidRequest(
                "max_tokens", f"<= {limit - n} ({why}; the prompt has {n})", sampling.max_tokens
            )
        req = Request(
            req_id, tokens, sampling, self._next_arrival, model.eos_token_id, model.extra_eos_token_ids
        )
        self._next_arrival += 1
        # Hash the prompt's full blocks once; admission, routing and registration reuse them.
        if self._prompt_hasher is not None:
            self._prompt_hasher.hash_prompt(tokens, req.block_hashes, n // self._block_size)
        parent = self._fork_parent(req, fork_of) if fork_of and shard is None else None
        if parent is not None:
            self._requests[req_id] = req
            self.shards[parent.shard].park(req, parent)
            return
        if shard is None:
            shard = route(req, self.shards, self.live_shards(), self.load_penalty)
        elif shard not in self.live_shards():
            raise InvalidRequest("shard", f"one of the live shards {self.live_shards()}", shard)
        self._requests[req_id] = req
        self.shards[shard].enqueue(req)

    def _fork_parent(self, req: Request, fork_of: str) -> Request | None:
        """The request `req` can be forked from (`add_request`), or None: an unfinished request with the
        same prompt, no output yet, and its last prompt chunk not scheduled (a parked sibling stands for
        the request it waits on). A request asking for prompt logprobs computes its own prompt."""
        parent = self._requests.get(fork_of)
        if parent is not None and parent.fork_parent is not None:
            parent = parent.fork_parent
        if parent is None or req.sampling.prompt_logprobs is not None:
            return None
        if parent.num_tokens != parent.num_prompt_tokens or parent.token_ids != req.token_ids:
            return None
        if parent.num_computed + parent.num_scheduled >= parent.num_prompt_tokens:
            return None  # its last chunk is scheduled already
        return parent if parent.status in _FORKABLE else None

    def live_shards(self) -> list[int]:
        return [s for s in range(self.num_shards) if s not in self.dropped]

    def drop_shard(self, shard: int) -> list[str]:
        """The shard is gone for good: forget it and route its requests (re-sent in full) to live shards."""
        ids = self.reset_shard(shard)
        self.dropped.add(shard)
        gone = self.shards[shard]
        moved = sorted([*gone.waiting, *gone.unpark_all()], key=lambda r: r.arrival)
        gone.waiting.clear()
        live = self.live_shards()
        for req in moved:
            self.shards[route(req, self.shards, live, self.load_penalty)].enqueue(req)
        return ids

    def abort(self, req_id: str) -> bool:
        """Drops an unfinished request (False if unknown or already finished). A running one's id goes
        to its shard's next finished_ids; a result for it still in flight is ignored."""
        req = self._requests.pop(req_id, None)
        if req is None:
            return False
        self.shards[req.shard].abort(req)
        return True

    # -- the step ----------------------------------------------------------------------------------------

    def schedule(self, lookahead: bool = False) -> dict[int, StepMessage]:
        """One StepMessage per shard that has something to do and no step in flight; with `lookahead`,
        also a decode step planned on top of a shard's step in flight where that is safe (async
        scheduling: the caller sends it before applying the answer to the step in flight)."""
        self._step_id += 1
        messages = {}
        for shard in self.shards:
            msg = shard.schedule(self._step_id, lookahead)
            if msg is not None:
                messages[shard.shard] = msg
        return messages

    def update(self, shard: int, result: StepResult) -> list[RequestUpdate]:
        """Applies a shard's StepResult; returns one update per request that got a token."""
        updates, finished = self.shards[shard].update(result)
        for req in finished:
            del self._requests[req.req_id]
        return updates

    def reset_shard(self, shard: int) -> list[str]:
        """The shard's worker lost its device state (it died and was restarted): its KV and cached
        prefixes are forgotten and its requests are queued again, to be sent anew with all their tokens."""
        return [req.req_id for req in self.shards[shard].reset()]

    # -- queries -----------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id (None once it finished: its last RequestUpdate says how)."""
        return self._requests.get(req_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=[len(s.running) for s in self.shards],
            num_waiting=[len(s.waiting) + s.num_parked for s in self.shards],
            num_free_blocks=[s.kv.num_available() for s in self.shards],
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in self.shards),
            replayed_tokens=sum(s.replayed_tokens for s in self.shards),
            num_preemptions=sum(s.num_preemptions for s in self.shards),
            shared_replay_tokens=sum(s.shared_replay_tokens for s in self.shards),
            forked_tokens=sum(s.forked_tokens for s in self.shards),
        )

    def check_integrity(self) -> None:
        """Raises AssertionError if any pool's bookkeeping is off (see ShardScheduler.check_integrity)."""
        for shard in self.shards:
            shard.check_integrity()
        for req in self._requests.values():
            assert not req.is_finished, f"{req!r} is finished but still tracked"
