"""Every type that crosses an actor boundary, as msgspec Structs, plus one encoder and typed decoders.

The scheduler builds one `StepMessage` per shard and step; the worker answers with a `StepResult`.
Clients of the Ray backend submit `AddBatch`es to the scheduler actor and poll `UpdateBatch`es back.
Token ids travel as little-endian int32 bytes. A new request goes out once in full (`NewRequest`); after
that only what changed (`RunningDelta`). `array_like=True` keeps the encoding compact (no field names on
the wire) and `gc=False` keeps these short-lived objects out of the cyclic GC.
"""

from __future__ import annotations

import array
import json
import sys

import msgspec

from raystate.errors import InvalidRequest

_INT32 = "i"
assert array.array(_INT32).itemsize == 4


def ids_to_bytes(ids) -> bytes:
    """int32 little-endian bytes of a sequence of token ids."""
    a = array.array(_INT32, ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def bytes_to_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise msgspec.DecodeError(f"token id bytes: length {len(data)} is not a multiple of 4")
    a = array.array(_INT32)
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


# The sampled id of a row that failed (non-finite logits, a sampling error): its request alone ends with
# finish_reason "error"; StepResult.errors says why.
FAILED_ROW = -2


class SamplingParams(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """How to pick the next token. temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Controls applied by the worker to the raw logits, before temperature (raystate/worker/penalties.py).
    presence_penalty: float = 0.0  # minus this where the token is in the output so far
    frequency_penalty: float = 0.0  # minus this times the token's count in the output so far
    repetition_penalty: float = 1.0  # l / p (l > 0) or l * p (l <= 0) for tokens of the prompt or output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_p: float = 0.0  # keep tokens with probability >= min_p * the largest (after temperature)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until the output has this many tokens
    # Only these ids may be sampled (every other token, EOS included unless listed, is -inf); None: all
    allowed_token_ids: list[int] | None = None
    # Log-probabilities (raystate/worker/logprobs.py): of each output token plus the `logprobs` most
    # likely, and of each prompt token (from position 1) plus the `prompt_logprobs` most likely; None:
    # off, 0: the token's own only. From the logits after the logit controls above and before
    # temperature, top-k, top-p and min_p (log_softmax in fp32). A request with prompt_logprobs does not
    # use a prefix-cache hit (every prompt position is computed).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output (raystate/worker/structured.py): the output must be JSON that `json_schema` (a JSON
    # Schema, as JSON text) accepts, or with `json_object` any JSON object; or match `regex` (a regular
    # expression over the whole output, in the Rust regex dialect); or be exactly one of the `choice`
    # strings; or match `grammar` (a Lark grammar, llguidance's dialect, whose rule `start` is the whole
    # output). The worker masks every token the grammar does not allow (EOS only once the output is
    # complete); at most one of the five is set.
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Choices per prompt. The front ends (LLM, the OpenAI server) submit n > 1 as n requests of n = 1
    # (`raystate.fanout.child_requests`), the later ones forked from the first (they share its prompt
    # KV); the engine itself takes n = 1 only.
    n: int = 1
    # vLLM's bad_words: token sequences never to be generated (penalties.py). The engine takes them as ids,
    # `bad_words_token_ids`: a sequence's last token is -inf where the output so far ends with the rest
    # of it (a one-token sequence: always). The text front ends (LLM, the OpenAI server) encode
    # `bad_words` into those ids with the model's tokenizer (`ModelText.bad_words_token_ids`: each word
    # as it starts the text and after a space) and clear it; the engine refuses the text itself.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    @property
    def structured(self) -> bool:
        """Whether the worker constrains this request's tokens with a grammar."""
        return bool(self.structured_fields)

    @property
    def structured_fields(self) -> list[str]:
        """The names of the structured-output fields that are set (valid params: at most one)."""
        return [name for name in STRUCTURED_FIELDS if getattr(self, name) not in (None, False)]

    @property
    def has_logit_controls(self) -> bool:
        """Whether the worker must adjust this request's raw logits (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequest (a ValueError) naming the field and the limit. Temperatures in
        (0, 1e-5) are accepted and sampled greedily (the sampler's MIN_TEMPERATURE)."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest("n", f"an integer in [1, {MAX_N}]", self.n)
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise InvalidRequest("max_tokens", f"an integer in [1, {MAX_INT32}]", self.max_tokens)
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest("temperature", f"a number in [0, {MAX_TEMPERATURE:g}]", self.temperature)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise InvalidRequest("top_k", f"an integer in [0, {MAX_INT32}] (0 = off)", self.top_k)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_INT64):
            raise InvalidRequest("seed", f"an integer in [0, {MAX_INT64}]", self.seed)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids)
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise InvalidRequest("stop_token_ids", f"ids in [0, {vocab_size})", t)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise InvalidRequest(name, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", v)
        v = self.repetition_penalty
        if not _is_number(v) or not 0.0 < v <= MAX_REPETITION_PENALTY:
            raise InvalidRequest("repetition_penalty", f"a number in (0, {MAX_REPETITION_PENALTY:g}]", v)
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", len(self.logit_bias))
            for t, b in self.logit_bias.items():
                if not _is_int(t) or not 0 <= t < vocab_size:
                    raise InvalidRequest("logit_bias", f"token ids in [0, {vocab_size})", t)
                if not _is_number(b) or not -MAX_BIAS_VALUE <= b <= MAX_BIAS_VALUE:
                    raise InvalidRequest(
                        "logit_bias", f"values in [-{MAX_BIAS_VALUE:g}, {MAX_BIAS_VALUE:g}]", b
                    )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS:
                limit = f"a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids"
                raise InvalidRequest("allowed_token_ids", limit, len(ids) if isinstance(ids, list) else ids)
            bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest("allowed_token_ids", f"token ids in [0, {vocab_size})", bad[0])
        if self.bad_words is not None:
            raise InvalidRequest(
                "bad_words",
                "unset here: the engine takes bad_words_token_ids (LLM and the OpenAI server encode "
                "bad_words into them with the model's tokenizer)",
                self.bad_words,
            )
        if self.bad_words_token_ids is not None:
            _check_bad_words_token_ids(self.bad_words_token_ids, vocab_size)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", "a number in [0, 1]", self.min_p)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                "min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequest(name, f"an integer in [0, {MAX_LOGPROBS}] or None", v)
        if not isinstance(self.json_object, bool):
            raise InvalidRequest("json_object", "a boolean", self.json_object)
        if self.json_schema is not None:
            _check_json_schema(self.json_schema)
            if self.json_object:
                raise InvalidRequest("json_object", "false when json_schema is set", self.json_object)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise InvalidRequest(name, "a string", type(v).__name__)
            if v is not None and len(v) > MAX_GRAMMAR_CHARS:
                raise InvalidRequest(name, f"at most {MAX_GRAMMAR_CHARS} characters", len(v))
        if self.choice is not None:
            _check_choice(self.choice)
        given = self.structured_fields
        if len(given) > 1:
            raise InvalidRequest(given[1], f"unset when {given[0]} is set (one structured output)", "set")


MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MAX_TEMPERATURE = 1e4  # a softmax past this is uniform to fp32 precision anyway
MAX_STOP_TOKEN_IDS = 1024
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BIAS_VALUE = 100.0
MAX_BAD_WORDS = 128  # bad_words: words per request (each is one or two token sequences)
MAX_BAD_WORD_SEQUENCES = 2 * MAX_BAD_WORDS  # bad_words_token_ids: sequences per request
MAX_BAD_WORD_TOKENS = 16  # tokens per sequence (the worker compares the output's last 15 with a prefix)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
MAX_JSON_SCHEMA_CHARS = 65536
MAX_GRAMMAR_CHARS = 65536  # regex, grammar, and the choice strings together
MAX_CHOICE_STRINGS = 1024
STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_N = 128  # choices per prompt


def _check_bad_words_token_ids(seqs: object, vocab_size: int) -> None:
    """0..MAX_BAD_WORD_SEQUENCES lists of 1..MAX_BAD_WORD_TOKENS ids in [0, vocab_size)."""
    field = "bad_words_token_ids"
    if not isinstance(seqs, list) or not all(isinstance(s, list) for s in seqs):
        raise InvalidRequest(field, "a list of token id lists", type(seqs).__name__)
    if len(seqs) > MAX_BAD_WORD_SEQUENCES:
        raise InvalidRequest(field, f"at most {MAX_BAD_WORD_SEQUENCES} sequences", len(seqs))
    for s in seqs:
        if not 1 <= len(s) <= MAX_BAD_WORD_TOKENS:
            raise InvalidRequest(field, f"sequences of 1 to {MAX_BAD_WORD_TOKENS} tokens", len(s))
        bad = [t for t in s if not _is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(field, f"token ids in [0, {vocab_size})", bad[0])


def _check_choice(choice: object) -> None:
    """1..MAX_CHOICE_STRINGS strings, MAX_GRAMMAR_CHARS characters in all."""
    if not isinstance(choice, list) or not all(isinstance(c, str) for c in choice):
        raise InvalidRequest("choice", "a list of strings", type(choice).__name__)
    if not 1 <= len(choice) <= MAX_CHOICE_STRINGS:
        raise InvalidRequest("choice", f"1 to {MAX_CHOICE_STRINGS} strings", len(choice))
    total = sum(len(c) for c in choice)
    if total > MAX_GRAMMAR_CHARS:
        raise InvalidRequest("choice", f"at most {MAX_GRAMMAR_CHARS} characters in all", total)


def _check_json_schema(schema: object) -> None:
    """A JSON Schema as text: a JSON object or boolean (the grammar library checks the keywords)."""
    if not isinstance(schema, str):
        raise InvalidRequest("json_schema", "a string (JSON text)", type(schema).__name__)
    if len(schema) > MAX_JSON_SCHEMA_CHARS:
        raise InvalidRequest("json_schema", f"at most {MAX_JSON_SCHEMA_CHARS} characters", len(schema))
    try:
        value = json.loads(schema)
    except (ValueError, RecursionError):
        raise InvalidRequest("json_schema", "JSON text (a JSON Schema)", schema[:200]) from None
    if not isinstance(value, dict | bool):
        raise InvalidRequest("json_schema", "a JSON object (a JSON Schema)", schema[:200])


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


class NewRequest(msgspec.Struct, array_like=True, gc=False):
    """A request that is new to the shard (first admission, re-admission after preemption or migration).

    `token_ids` is the whole history known so far (prompt + generated), so the worker can rebuild its
    token history and lookback exactly. `block_ids[g]` lists the request's blocks in group g (0 = the null
    block, for window blocks wholly below `replay_start`).
    """

    req_id: str
    token_ids: bytes  # int32 LE [num_tokens]
    num_prompt_tokens: int
    num_computed: int
    replay_start: int
    block_ids: list[list[int]]
    num_scheduled: int  # tokens computed in this step (0: admitted but not scheduled)
    sampling: SamplingParams


class RunningDelta(msgspec.Struct, array_like=True, gc=False):
    """A running request scheduled this step: its new blocks per group and how many tokens it computes."""

    req_id: str
    new_block_ids: list[list[int]]  # appended to the request's block list per group
    num_scheduled: int


class StepMessage(msgspec.Struct, array_like=True, gc=False):
    """One shard's step. Batch rows are new_requests (with num_scheduled > 0) then running, in order.

    `finished_ids` and `preempted_ids` are released before the step runs.
    """

    step_id: int
    new_requests: list[NewRequest] = []
    running: list[RunningDelta] = []
    finished_ids: list[str] = []
    preempted_ids: list[str] = []


class StepResult(msgspec.Struct, array_like=True, gc=False):
    """The shard's answer: one sampled id per scheduled row, -1 where a prefill chunk ended mid-prompt,
    FAILED_ROW where the row failed (`errors[req_id]` says why, when the worker knows more than that its
    logits were not finite)."""

    step_id: int
    req_ids: list[str]
    sampled: bytes  # int32 LE [len(req_ids)]
    execute_ns: int = 0
    errors: dict[str, str] = {}
    # Rows whose request asks for logprobs: the sampled token's record (pack_logprobs). Prompt logprobs:
    # one record per position p of the row's chunk with p + 1 < its prompt length (the prompt token at
    # p + 1 given the logits at p).
    logprobs: dict[str, bytes] = {}
    prompt_logprobs: dict[str, bytes] = {}


class RequestUpdate(msgspec.Struct, array_like=True, gc=False):
    """What one step changed for one request, as the client sees it."""

    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "abort" | "error" once finished
    num_cached_tokens: int  # prefix hit h used at the latest admission (0: none or dropped)
    replay_start: int  # replay start of the latest admission (DESIGN 3.3; 0 without replay)
    error: str | None = None  # why, when finish_reason is "error" (this request alone failed)
    logprobs: bytes = b""  # records of new_token_ids (pack_logprobs), when the request asks for them
    # With prompt_logprobs: records of prompt tokens 1..P-1, on the update carrying the first output token
    prompt_logprobs: bytes = b""


# -- log-probability records ------------------------------------------------------------------------------
# A record per token: int32 LE [2 + 2 W]: W (entries), rank (of the token: 1 + tokens with a larger
# logprob), then W (id int32, logprob fp32) pairs: the token itself first, then its top W - 1 alternatives.
# Records of one request share W, so blobs concatenate.


def pack_logprobs(ids, logprobs, ranks) -> bytes:
    """ids int [n, W], logprobs float [n, W], ranks int [n] (numpy or lists) -> records."""
    import numpy as np

    ids = np.asarray(ids, dtype="<i4")
    n, w = ids.shape if ids.ndim == 2 else (0, 0)
    out = np.empty((n, 2 + 2 * w), dtype="<i4")
    out[:, 0] = w
    out[:, 1] = np.asarray(ranks, dtype="<i4").reshape(n)
    out[:, 2::2] = ids
    out[:, 3::2] = np.asarray(logprobs, dtype="<f4").reshape(n, w).view("<i4")
    return out.tobytes()


def unpack_logprobs(data: bytes):
    """Records -> (ids int32 [n, W], logprobs fp32 [n, W], ranks int32 [n]) as numpy arrays."""
    import numpy as np

    if not data:
        return np.zeros((0, 0), "<i4"), np.zeros((0, 0), "<f4"), np.zeros(0, "<i4")
    a = np.frombuffer(data, dtype="<i4")
    w = int(a[0])
    rec = a.reshape(-1, 2 + 2 * w)
    return rec[:, 2::2].copy(), rec[:, 3::2].copy().view("<f4"), rec[:, 1].copy()


def logprob_record_size(data: bytes) -> int:
    """Bytes per record of a non-empty blob."""
    return 4 * (2 + 2 * int.from_bytes(data[:4], "little", signed=True))


# -- client <-> scheduler actor (the Ray backend) ---------------------------------------------------------


class AddRequest(msgspec.Struct, array_like=True, gc=False):
    """A request a client submits to the scheduler actor (sent in batches: `AddBatch`)."""

    req_id: str
    token_ids: bytes  # int32 LE [num_prompt_tokens]
    sampling: SamplingParams
    fork_of: str = ""  # a sibling with the same prompt to fork from (`Scheduler.add_request`); "": none


class AddBatch(msgspec.Struct, array_like=True, gc=False):
    """Requests one client submits at once. The batch is atomic: one bad request withdraws the others."""

    client_id: str
    requests: list[AddRequest]


class Rejected(msgspec.Struct, array_like=True, gc=False):
    """Why a batch was refused: `requests[index]` broke a limit (the fields of InvalidRequest)."""

    index: int
    field: str
    limit: str
    got: str  # repr of the offending value

    def to_error(self) -> InvalidRequest:
        err = InvalidRequest(self.field, self.limit, self.got)
        err.args = (f"{self.field}: must be {self.limit}, got {self.got}",)  # `got` is a repr already
        return err


class UpdateBatch(msgspec.Struct, array_like=True, gc=False):
    """The updates a client's poll collected, in step order; `error` set once the engine is dead."""

    updates: list[RequestUpdate]
    error: str | None = None


WireType = (
    SamplingParams
    | NewRequest
    | RunningDelta
    | StepMessage
    | StepResult
    | RequestUpdate
    | AddRequest
    | AddBatch
    | Rejected
    | UpdateBatch
)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {
    t: msgspec.msgpack.Decoder(t) for t in (StepMessage, StepResult, AddBatch, Rejected, UpdateBatch)
}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _decode(kind: type, data: bytes):
    try:
        return _decoders[kind].decode(data)
    except msgspec.DecodeError as e:
        raise msgspec.DecodeError(f"{kind.__name__}: cannot decode {len(data)} bytes: {e}") from e


def decode_step(data: bytes) -> StepMessage:
    return _decode(StepMessage, data)


def decode_result(data: bytes) -> StepResult:
    return _decode(StepResult, data)


def decode_add_batch(data: bytes) -> AddBatch:
    return _decode(AddBatch, data)


def decode_rejected(data: bytes) -> Rejected:
    return _decode(Rejected, data)


def decode_update_batch(data: bytes) -> UpdateBatch:
    return _decode(UpdateBatch, data)
