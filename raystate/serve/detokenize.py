"""Token ids -> text deltas for one streamed request, with OpenAI stop strings.

The byte model emits one UTF-8 byte per token, so a character can span several tokens and a sampled byte
sequence need not be valid UTF-8. An incremental decoder (errors="replace") holds an unfinished character
back until its last byte arrives, and gives exactly the text `ByteTokenizer.decode` gives for the whole
sequence. Special tokens (BOS, EOS, PAD) carry no text and are skipped, as `decode` skips them.

Stop strings are matched on the decoded text. A suffix that could still grow into a stop string is held
back, so no text is ever sent that a later token would have to retract; the stop string itself is never
sent (OpenAI semantics).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from raystate.config import NUM_BYTES


class TextStream:
    def __init__(self, stop: list[str] | None = None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in (stop or []) if s]
        self._text = ""  # everything decoded so far
        self._sent = 0  # characters of _text already handed out
        self.stopped = False  # a stop string was found; nothing more will be handed out

    @property
    def text(self) -> str:
        """The text handed out so far (the completion's text once the request is done)."""
        return self._text[: self._sent]

    def push(self, token_ids: Iterable[int], final: bool = False) -> str:
        """Decodes the new tokens and returns the text that is now safe to send ("" when none is)."""
        if self.stopped:
            return ""
        data = bytes(t for t in token_ids if 0 <= t < NUM_BYTES)
        self._text += self._decoder.decode(data, final=final)
        end = self._find_stop()
        if end is not None:
            self.stopped = True
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _find_stop(self) -> int | None:
        """Start of the earliest stop string in the unsent text, if any."""
        hits = [i for s in self._stop if (i := self._text.find(s, self._sent)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        unsent = len(self._text) - self._sent
        longest = max((len(s) - 1 for s in self._stop), default=0)
        for k in range(min(unsent, longest), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
