"""Structured output: JSON (a JSON Schema, or any JSON object) forced by a grammar, token by token.

The grammar library is llguidance (README, "Structured output", says why). One `LLMatcher` per
structured request lives here, on the worker, keyed by the request's state slot: the worker owns the
token history, so the matcher advances with it and a re-admitted request (preemption, migration) gets a
new matcher that replays the output so far from `NewRequest.token_ids`.

Per step, for a batch with structured rows (a host-side flag per slot; other batches never get here):

1. `apply`: each structured row's matcher fills its row of an int32 bitmask [B, ceil(V / 32)] in host
   memory (llguidance's format, bit t of word t // 32 = token t allowed; pinned on CUDA), every other row
   all ones; one copy to the device, no sync; the logits get -inf where a bit is 0 (a select, so rows
   with all bits set are bit-identical to the input). This runs after the logit controls and before
   any sampling, greedy rows included.
2. `accept`: once the step's ids are on the host, each structured row's matcher consumes its id; an id
   the matcher rejects (it cannot be sampled through the mask, but a row that failed for another reason,
   or a grammar error, ends here) fails that row alone with the matcher's reason.

The mask allows EOS only where the grammar accepts the output so far (the JSON is complete) and, then,
only EOS; the scheduler's EOS rule ends the request there. The matchers need step N's id before they can
mask step N + 1, so the worker finishes a step with structured rows before `launch` returns (see
`Worker._graph_decode`): async scheduling may still plan the next step on top, but it cannot overtake.

The token vocabulary for the grammar (`LLTokenizer`, ~0.5 s for a 150k vocabulary) is built on the first
structured request: the byte tokenizer's 256 one-byte tokens plus its specials, or the checkpoint's
`tokenizer.json` as the `tokenizers` library serialises it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from raystate.grammar import first_line, grammar_for
from raystate.messages import FAILED_ROW, NewRequest, bytes_to_ids

logger = logging.getLogger(__name__)

NO_ALLOWED_TOKEN = (
    "structured output: no token is allowed by both the grammar and the request's other constraints "
    "(min_tokens, logit_bias), or the model produced non-finite logits"
)
GRAMMAR_CACHE_SIZE = 64  # compiled matchers kept (copied per request), by schema text


class _ByteVocab:
    """The byte tokenizer's vocabulary as llguidance's TokenizerWrapper reads it: ids 0..255 are one byte
    each; the rest (BOS, EOS, PAD) are special tokens."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        from raystate.config import BOS_ID, EOS_ID, NUM_BYTES, PAD_ID

        names = {BOS_ID: b"<|bos|>", EOS_ID: b"<|eos|>", PAD_ID: b"<|pad|>"}
        self.tokens = [bytes([i]) for i in range(NUM_BYTES)]
        self.tokens += [names.get(i, b"<|special_%d|>" % i) for i in range(NUM_BYTES, vocab_size)]
        self.special_token_ids = list(range(NUM_BYTES, vocab_size))
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else EOS_ID
        self.bos_token_id = BOS_ID

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def grammar_tokenizer(config) -> Any:
    """The llguidance tokenizer of the model an EngineConfig runs (byte model or HF checkpoint)."""
    import llguidance

    model = config.model
    eos = [int(i) for i in model.eos_token_ids]
    if model.architecture == "raystate_hybrid":
        vocab = _ByteVocab(model.vocab_size, tuple(eos))
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(vocab), n_vocab=model.vocab_size, eos_token=eos
        )
    folder = config.tokenizer_path or config.model_path  # a tokenizer given apart, or its own
    if folder is None:
        raise ValueError("structured output: a Hugging Face model needs model_path (its tokenizer.json)")
    from raystate.hf import HFTokenizer

    backend = HFTokenizer.from_pretrained(folder).backend
    n_vocab = max(model.vocab_size, backend.get_vocab_size(with_added_tokens=True))
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


class StructuredOutputs:
    """The matchers of a worker's structured requests and the step's bitmask."""

    def __init__(
        self, num_slots: int, vocab_size: int, device: torch.device, tokenizer_factory: Callable[[], Any]
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.host_enabled = np.zeros(num_slots, dtype=bool)
        self.matchers: dict[int, Any] = {}  # slot -> llguidance.LLMatcher
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> a fresh matcher
        self._words = 0  # int32 words per mask row (from the grammar tokenizer's vocabulary)
        self._host: torch.Tensor | None = None  # int32 [num_slots, words], pinned on CUDA
        self._dev: torch.Tensor | None = None  # int32 [num_slots, words]
        self._bits: torch.Tensor | None = None  # int32 [32]: 0..31
        self._executor = None
        self._num_slots = num_slots

    # -- per request (host side) ----------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            tok = self._tokenizer_factory()
            self._words = -(-max(tok.vocab_size, self.vocab_size) // 32)
            pin = self.device.type == "cuda"
            self._host = torch.full((self._num_slots, self._words), -1, dtype=torch.int32, pin_memory=pin)
            self._dev = torch.full((self._num_slots, self._words), -1, dtype=torch.int32, device=self.device)
            self._bits = torch.arange(32, dtype=torch.int32, device=self.device)
            self._tokenizer = tok
        return self._tokenizer

    def new_matcher(self, req: NewRequest) -> tuple[Any, str | None]:
        """(a matcher for `req` with its output so far consumed, None) or (None, why it cannot have one)."""
        import llguidance

        p = req.sampling
        try:
            grammar = grammar_for(p)
            template = self._compiled.get(grammar)
            if template is None:
                template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        except Exception as e:  # the request fails alone, never the worker
            logger.warning("structured output: no matcher for %s", req.req_id, exc_info=True)
            return None, f"structured output: {type(e).__name__}: {first_line(str(e))}"
        if grammar not in self._compiled:
            if template.is_error():
                field = p.structured_fields[0]
                return None, f"invalid request: {field}: {first_line(template.get_error())}"
            self._compiled[grammar] = template
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        matcher = template.deep_copy()
        output = bytes_to_ids(req.token_ids)[req.num_prompt_tokens :]
        if output and not matcher.consume_tokens(output):
            return None, f"structured output: the output so far breaks the grammar: {self._why(matcher)}"
        return matcher, None

    def add(self, slot: int, matcher: Any) -> None:
        self.matchers[slot] = matcher
        self.host_enabled[slot] = True

    def remove(self, slot: int) -> None:
        if self.host_enabled[slot]:
            self.host_enabled[slot] = False
            self.matchers.pop(slot, None)

    def any_enabled(self, slots: np.ndarray) -> bool:
        return bool(self.host_enabled[slots].any())

    @staticmethod
    def _why(matcher) -> str:
        return first_line(matcher.get_error())

    # -- per step -------------------------------------------------------------------------------------

    def apply(
        self,
        logits: torch.Tensor,  # fp32 [B, V]
        slots: np.ndarray,  # int64 [B]: each row's slot
        rows: np.ndarray | None = None,  # bool [B]: rows that sample now (None: all)
    ) -> torch.Tensor:  # fp32 [B, V], a new tensor
        """The logits with -inf where a structured row's grammar forbids the token. No host sync."""
        b, v = logits.shape
        host = self._host[:b]
        host.fill_(-1)
        todo = [
            (self.matchers[int(s)], i)
            for i, s in enumerate(slots)
            if self.host_enabled[s] and (rows is None or rows[i])
        ]
        if not todo:
            return logits
        nbytes = self._words * 4
        if len(todo) == 1:
            m, i = todo[0]
            m.unsafe_compute_mask_ptr(host[i].data_ptr(), nbytes)
        else:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(todo, host.data_ptr(), nbytes, b)
        dev = self._dev[:b]
        dev.copy_(host, non_blocking=True)
        allowed = ((dev.unsqueeze(-1) >> self._bits) & 1).view(b, self._words * 32)[:, :v]
        return logits.masked_fill(allowed == 0, float("-inf"))

    def accept(
        self,
        slots: np.ndarray,  # int64 [B]
        ids: np.ndarray,  # int [B]: the step's ids, on the host
        rows: np.ndarray | None = None,  # bool [B]: rows whose id is kept (None: all)
    ) -> dict[int, str]:
        """Each kept structured row's matcher consumes its id. Returns {row: why} for the rows that fail
        (their id must become FAILED_ROW): an id the grammar rejects, or a row that sampled nothing."""
        failures: dict[int, str] = {}
        for i, s in enumerate(slots):
            if not self.host_enabled[s] or (rows is not None and not rows[i]):
                continue
            m = self.matchers[int(s)]
            t = int(ids[i])
            if t == FAILED_ROW:  # the caller keeps a reason the sampler gave
                failures[i] = NO_ALLOWED_TOKEN if not m.is_error() else f"structured output: {self._why(m)}"
                continue
            if not m.consume_token(t):
                failures[i] = f"structured output: token {t} is not allowed by the grammar: {self._why(m)}"
        return failures
