"""Token ids -> text deltas for one streamed request, with OpenAI stop strings.

The byte model emits one UTF-8 byte per token, so a character can span several tokens and a sampled byte
sequence need not be valid UTF-8. An incremental decoder (errors="replace") holds an unfinished character
back until its last byte arrives, and gives exactly the text `ByteTokenizer.decode` gives for the whole
sequence. Special tokens (BOS, EOS, PAD) carry no text and are skipped, as `decode` skips them.

Stop strings are matched on the decoded text. A suffix that could still grow into a stop string is held
back, so no text is ever sent that a later token would have to retract; the stop string itself is not
sent (OpenAI semantics) unless the request asks for it (`include_stop_str_in_output`, vLLM's extension).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable

from raystate.config import NUM_BYTES


class StopStrings:
    """Text deltas in, text safe to send out, cut before the first stop string (`TextStream`'s rule, for
    the byte tokenizer and a checkpoint's alike)."""

    def __init__(self, stop: list[str] | None = None, include_stop: bool = False) -> None:
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop  # the text ends after the stop string, not before it
        self._longest = max((len(s) for s in self._stop), default=0)
        self._text = ""  # everything received
        self._sent = 0  # characters of _text handed out
        self.stopped = False  # a stop string was found; nothing more is handed out

    @property
    def text(self) -> str:
        """The text handed out so far (the completion's text once the request is done)."""
        return self._text[: self._sent]

    def push(self, text: str, final: bool = False) -> str:
        """Adds decoded text; returns the text that is now safe to send ("" when none is)."""
        if self.stopped:
            return ""
        # A stop string can start at most (longest - 1) characters before the old end: earlier ones were
        # looked for on earlier pushes (the text they would start in was held back, not sent).
        search_from = max(self._sent, len(self._text) - self._longest + 1)
        self._text += text
        end = self._find_stop(search_from)
        if end is not None:
            self.stopped = True
            if self._include_stop:  # of the stop strings found there, the shortest: it completed first
                end += min(len(s) for s in self._stop if self._text.startswith(s, end))
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _find_stop(self, start: int) -> int | None:
        """Start of the earliest stop string at or after `start`, if any."""
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        unsent = len(self._text) - self._sent
        for k in range(min(unsent, self._longest - 1), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


def byte_decoder(special_text: Callable[[int], str] | None = None) -> Callable[[Iterable[int], bool], str]:
    """The byte models' incremental decoder, `decode(token_ids, final) -> text`: the byte ids through an
    incremental UTF-8 decoder (never half a character); a special id (>= NUM_BYTES) dropped, or, with
    `special_text`, written as its text after the bytes before it."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(token_ids: Iterable[int], final: bool) -> str:
        if special_text is None:
            return utf8.decode(bytes(t for t in token_ids if 0 <= t < NUM_BYTES), final=final)
        out = []
        for t in token_ids:
            if 0 <= t < NUM_BYTES:
                out.append(utf8.decode(bytes((t,))))
            else:
                out.append(utf8.decode(b"", final=True) + special_text(t))
        out.append(utf8.decode(b"", final=final))
        return "".join(out)

    return decode


class TextStream:
    """Token ids in, text deltas out: an incremental decoder in front of `StopStrings`.

    The decoder is `decode(token_ids, final) -> text`: by default the byte tokenizer's (an incremental
    UTF-8 decoder over the byte ids, special tokens skipped); `raystate.hf.detokenize.HFTextStream` passes
    a checkpoint tokenizer's incremental detokenizer.
    """

    def __init__(
        self,
        stop: list[str] | None = None,
        decode: Callable[[Iterable[int], bool], str] | None = None,
        include_stop: bool = False,
    ) -> None:
        self._decode = decode if decode is not None else byte_decoder()
        self._stop = StopStrings(stop, include_stop)

    @property
    def text(self) -> str:
        """The text handed out so far (the completion's text once the request is done)."""
        return self._stop.text

    @property
    def stopped(self) -> bool:
        """A stop string was found; nothing more will be handed out."""
        return self._stop.stopped

    def push(self, token_ids: Iterable[int], final: bool = False) -> str:
        """Decodes the new tokens and returns the text that is now safe to send ("" when none is)."""
        if self._stop.stopped:
            return ""
        return self._stop.push(self._decode(token_ids, final), final=final)
