"""The scheduler-side request: its token history, progress, KV blocks and the rules that finish it.

The scheduler is the one place that holds every request's token ids (DESIGN section 5): a worker can die
and the request is re-sent in full from here. Token ids live in an int32 `array` (prompt, then outputs)
so they go on the wire and into the block hashes without a per-token conversion.

The block fields are owned by `KVManager` (read-only for everyone else); they live here rather than in a
dict keyed by request id because the decode hot path touches them every step.
"""

from __future__ import annotations

import array
import enum
import sys

from raystate.messages import SamplingParams

_LITTLE_ENDIAN = sys.byteorder == "little"


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, never admitted
    RUNNING = 1  # admitted to a shard: holds blocks and a worker state slot
    PREEMPTED = 2  # blocks taken back; queued again, re-sent in full when re-admitted
    FINISHED_STOPPED = 3  # EOS or a stop token
    FINISHED_LENGTH = 4  # max_tokens reached
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request alone failed on its shard (non-finite logits, a bad value)


class Request:
    """One request as the scheduler tracks it.

    `num_computed` counts tokens whose KV the shard holds; it advances when a step's result arrives
    (`num_scheduled` is the chunk of the normal step in flight; a lookahead step planned on top of it keeps
    its rows' counts itself). `replay_start` holds for every prefill chunk of the current admission;
    decode rows run with 0, which the worker derives from its own state.
    """

    __slots__ = (
        "req_id",
        "sampling",
        "arrival",
        "status",
        "shard",
        "token_ids",
        "num_prompt_tokens",
        "num_tokens",
        "num_computed",
        "num_scheduled",
        "replay_start",
        "num_cached_tokens",
        "finish_reason",
        "block_hashes",
        "block_ids",
        "new_block_ids",
        "block_capacity",
        "num_registered",
        "num_released",
        "kv_check_at",
        "max_num_tokens",
        "min_stop_tokens",
        "eos_token_id",
        "stop_token_ids",
        "prompt_logprobs",
        "prompt_logprobs_next",
        "fork_parent",
        "forks",
    )

    def __init__(
        self,
        req_id: str,
        token_ids: array.array,
        sampling: SamplingParams,
        arrival: int,
        eos_token_id: int,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.req_id = req_id
        self.sampling = sampling
        self.arrival = arrival  # admission order: FCFS, and preemption takes the latest first
        self.status = RequestStatus.WAITING
        self.shard = -1
        self.token_ids = token_ids  # int32 [num_tokens]: prompt, then outputs
        self.num_prompt_tokens = len(token_ids)
        self.num_tokens = len(token_ids)
        self.num_computed = 0
        self.num_scheduled = 0
        self.replay_start = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        # Chained hashes of the full blocks of token_ids (filled at intake, extended as outputs arrive).
        self.block_hashes: list[bytes] = []
        # Owned by KVManager: block ids per group (0 = null or released), blocks not yet sent, the tokens
        # the blocks cover, full blocks whose hash is registered, window blocks released per group, and
        # the num_computed at which KVManager.advance has work to do.
        self.block_ids: list[list[int]] = []
        self.new_block_ids: list[list[int]] | None = None
        self.block_capacity = 0
        self.num_registered = 0
        self.num_released: list[int] = []
        self.kv_check_at = 0
        # Finishing rules, resolved once: the length cap, EOS (-1 with ignore_eos) and the stop ids.
        self.max_num_tokens = self.num_prompt_tokens + sampling.max_tokens
        # min_tokens: EOS and the stop ids end the request only from this history length on (the worker
        # also masks them until then).
        self.min_stop_tokens = self.num_prompt_tokens + sampling.min_tokens
        self.eos_token_id = -1 if sampling.ignore_eos else eos_token_id
        # A model may end sequences on several ids (generation_config.json lists them): the extra ones
        # finish a request exactly as EOS does.
        extra_eos = () if sampling.ignore_eos else extra_eos_token_ids
        self.stop_token_ids = frozenset((*sampling.stop_token_ids, *extra_eos))
        # With sampling.prompt_logprobs: the records received so far (sent with the first output token,
        # then None) and the next prompt position they lack (a recomputed chunk's repeats are dropped).
        self.prompt_logprobs: list[bytes] | None = [] if sampling.prompt_logprobs is not None else None
        self.prompt_logprobs_next = 0
        # Siblings of one prompt (n > 1, `Scheduler.add_request(fork_of=...)`): a sibling waits parked on
        # the request that computes the prompt (`fork_parent`, which lists it in `forks`) instead of in
        # the queue, and is forked from it when its last prompt chunk is scheduled (ShardScheduler).
        self.fork_parent: Request | None = None
        self.forks: list[Request] | None = None

    # -- token history ---------------------------------------------------------------------------------

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :].tolist()

    def token_bytes(self) -> bytes:
        """The whole history as int32 little-endian bytes (the wire format of NewRequest.token_ids)."""
        if _LITTLE_ENDIAN:
            return self.token_ids.tobytes()
        swapped = array.array("i", self.token_ids)
        swapped.byteswap()
        return swapped.tobytes()

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.name}, shard={self.shard}, tokens={self.num_tokens}, "
            f"computed={self.num_computed}, replay_start={self.replay_start})"
        )
