"""Beam search (vLLM's `use_beam_search` and `LLM.beam_search`), driven from the front end.

The engine samples one token per request; beam search keeps the `width` most likely continuations
instead. Each step asks the engine for one greedy token of every live beam with the log-probabilities of
its 2 * width most likely next tokens (a request of max_tokens 1 and logprobs 2W on the beam's tokens,
which the prefix cache mostly has already); every beam's candidates are the beam extended by each of
those tokens, with the summed log-probability. A candidate that ends with EOS (unless ignore_eos) is
finished and set aside; of the others the `width` best by score live on. After max_tokens steps, or
when no beam is left, the answer is the `width` best of the finished and the live beams.

As vLLM scores them: score = cumulative logprob / L ** length_penalty, where L counts the prompt's tokens
and the beam's (its final EOS not counted). 2W candidates per beam hold every beam's W best, so the W
survivors are those a search over the whole vocabulary would keep. Ties keep the order of the
candidates (beam by beam, each by rank). logprobs are at most 20, so width is at most 10.

Torch-free: `LLM` drives it with `generate`, the OpenAI server with its client, each through
`BeamSearchBatch.pending` and `.advance` (all prompts' beams in one engine call a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raystate.errors import InvalidRequest
from raystate.messages import MAX_LOGPROBS

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    """What `LLM.beam_search` takes (vLLM's names)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def validate(self) -> None:
        check_beam_width(self.beam_width, "beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.length_penalty, int | float) or not -100 <= self.length_penalty <= 100:
            raise InvalidRequest("length_penalty", "a number in [-100, 100]", self.length_penalty)


def check_beam_width(width: object, name: str) -> None:
    if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_BEAM_WIDTH:
        limit = f"an integer in [1, {MAX_BEAM_WIDTH}] with beam search (2 * width alternatives a step)"
        raise InvalidRequest(name, limit, width)


@dataclass
class Beam:
    """One continuation: the prompt's tokens and the beam's, and their summed log-probability."""

    tokens: list[int]
    cum_logprob: float
    num_prompt_tokens: int
    ended: bool = False  # its last token is an EOS

    @property
    def output_ids(self) -> list[int]:
        """The beam's own tokens (its EOS included)."""
        return self.tokens[self.num_prompt_tokens :]

    def text_ids(self, keep_eos: bool = False) -> list[int]:
        """The ids the beam's text is decoded from: its own, its final EOS left out unless `keep_eos`."""
        out = self.output_ids
        return out[:-1] if self.ended and not keep_eos else out

    @property
    def finish_reason(self) -> str:
        return "stop" if self.ended else "length"


@dataclass
class BeamSearch:
    prompt_ids: list[int]
    width: int
    max_tokens: int
    eos_ids: frozenset[int]
    ignore_eos: bool = False
    length_penalty: float = 1.0
    live: list[Beam] = field(default_factory=list)
    finished: list[Beam] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        self.live = [Beam(list(self.prompt_ids), 0.0, len(self.prompt_ids))]

    @property
    def num_candidates(self) -> int:
        """Alternatives a step asks for per beam (its logprobs)."""
        return 2 * self.width

    def pending(self) -> list[list[int]]:
        """The token ids of every beam to extend this step (none: the search is over)."""
        if self.steps >= self.max_tokens:
            return []
        return [b.tokens for b in self.live]

    def advance(self, alternatives: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One step: for each pending beam, its most likely next tokens as (id, logprob), best first."""
        if len(alternatives) != len(self.live):
            raise ValueError(f"beam search: {len(alternatives)} results for {len(self.live)} beams")
        candidates: list[Beam] = []
        for beam, alts in zip(self.live, alternatives, strict=True):
            seen: set[int] = set()
            for token, logprob in alts:
                if token in seen:
                    continue
                seen.add(token)
                new = Beam([*beam.tokens, token], beam.cum_logprob + logprob, beam.num_prompt_tokens)
                if token in self.eos_ids and not self.ignore_eos:
                    new.ended = True
                    self.finished.append(new)
                else:
                    candidates.append(new)
        self.live = sorted(candidates, key=self.score, reverse=True)[: self.width]
        self.steps += 1

    def score(self, beam: Beam) -> float:
        length = len(beam.tokens) - (1 if beam.ended else 0)
        return beam.cum_logprob / (length**self.length_penalty)

    def best(self) -> list[Beam]:
        """The answer: the `width` best beams, finished or not, best first."""
        return sorted([*self.finished, *self.live], key=self.score, reverse=True)[: self.width]


class BeamSearchBatch:
    """Several prompts' searches stepped together: one engine call a step for every live beam of all."""

    def __init__(self, searches: list[BeamSearch]) -> None:
        self.searches = searches
        self._counts: list[int] = []

    def pending(self) -> list[list[int]]:
        """Every search's beams to extend this step, in search order (none: all are over)."""
        beams = [search.pending() for search in self.searches]
        self._counts = [len(b) for b in beams]
        return [ids for b in beams for ids in b]

    def advance(self, alternatives: Sequence[Sequence[tuple[int, float]]]) -> None:
        """The alternatives of the beams `pending` gave, in its order."""
        at = 0
        for search, count in zip(self.searches, self._counts, strict=True):
            if count:
                search.advance(alternatives[at : at + count])
                at += count


@dataclass
class BeamSearchSequence:
    """One answer of `LLM.beam_search`: the prompt's and the beam's tokens, the beam's text (its EOS not
    written; vLLM's also holds the prompt's), its summed log-probability, "stop" (EOS) or "length"."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """`LLM.beam_search`'s result for one prompt: the best beams, best first."""

    sequences: list[BeamSearchSequence]


def ranked_alternatives(ids: Sequence[int], logprobs: Sequence[float], k: int) -> list[tuple[int, float]]:
    """A step's logprob record (the sampled token, then its top k alternatives best first: the wire's
    order, `raystate.messages.pack_logprobs`) as the k alternatives, best first."""
    return list(zip(ids[1 : k + 1], logprobs[1 : k + 1], strict=True))
