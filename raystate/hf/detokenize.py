"""Token ids -> text deltas for one streamed request on a checkpoint's tokenizer, with OpenAI stop strings.

`IncrementalDetokenizer` decodes a sliding window of the ids: each step decodes the window
`ids[start:]` and hands out the part of its text not handed out yet, less any trailing U+FFFD run (the
decode of an unfinished UTF-8 character, whether its bytes come from byte-level BPE pieces or from
byte-fallback tokens like `<0xE2>`), which waits for the tokens that complete it. Once everything decoded
is out, the window moves up to the last token that carries text, so that token is the next step's
context: decoders that treat the first token specially (SentencePiece's leading space, `Strip`) see the
new tokens as not first, exactly as in a decode of the whole sequence. The last step (`final=True`)
compares with one decode of every id and hands out the rest of it, so a finished stream's text is
`tokenizer.decode(all_ids)` (transformers' clean-up of spaces included, when it applies: that text is
held back by `CLEANUP_REACH` characters until the end, the farthest a later token can change it).

One exception, for invalid UTF-8 only: `ByteFallback` (SentencePiece-style `<0xNN>` tokens) decodes a run
of byte tokens all or nothing, so a run that starts with whole characters and then turns invalid decodes
to one U+FFFD per byte in `decode(all_ids)`, while the stream has already sent the whole characters. Valid
text, and byte-level BPE (decoded lossily byte by byte) in every case, end equal to `decode(all_ids)`.
Ids are taken one at a time however they arrive, so a stream's text depends on its ids alone, never on
how they were grouped into updates.

`HFTextStream` is serve's `raystate.serve.detokenize.TextStream` with this detokenizer as its decoder:
the same stop-string rule (a tail that could still grow into a stop string is held back, the text is cut
before the first stop string, which is never sent) and interface (`push(token_ids, final) -> str`,
`text`, `stopped`).

Works with any tokenizer that has `decode(ids, skip_special_tokens=...)`; an `HFTokenizer` is decoded
through its `decode_raw` (no clean-up) window by window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from raystate.hf.tokenizer import CLEANUP_REACH, HFTokenizer, clean_up_tokenization
from raystate.serve.detokenize import TextStream

REPLACEMENT = "\ufffd"


def _trailing_replacements(text: str, start: int) -> int:
    """How many U+FFFD end `text` (not counting before `start`)."""
    n = 0
    while len(text) - n > start and text[-1 - n] == REPLACEMENT:
        n += 1
    return n


class IncrementalDetokenizer:
    """Token ids in, complete text out: never half a character, and in the end `decode(all_ids)`."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        if isinstance(tokenizer, HFTokenizer):
            self._decode_window = tokenizer.decode_raw
            self._cleanup = tokenizer._cleanup_applies()
        else:
            self._decode_window = tokenizer.decode
            self._cleanup = False
        self.token_ids: list[int] = []
        self._start = 0  # the window: token_ids[_start:]
        self._window_out = 0  # characters of the window's text already taken into _raw
        self._raw = ""  # text taken from the windows (before any clean-up of spaces)
        self._sent = 0  # characters of the output text handed out
        self._final: str | None = None  # the output text, once the last step has decided it
        self.finished = False

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return self._output()[: self._sent]

    def _decode(self, ids: list[int]) -> str:
        return self._decode_window(ids, skip_special_tokens=self._skip)

    def _output(self) -> str:
        if self._final is not None:
            return self._final
        return clean_up_tokenization(self._raw) if self._cleanup else self._raw

    def push(self, token_ids: Iterable[int], final: bool = False) -> str:
        """Takes the new ids; returns the text that is now complete ("" while a character is unfinished).
        After `final=True` nothing more is taken. The ids are taken one at a time, so the text does not
        depend on how a request's tokens were grouped into updates (which follows the server's load: a
        byte-fallback run pushed at once could decode to U+FFFD where pushed token by token it gave whole
        characters)."""
        if self.finished:
            return ""
        new = [int(t) for t in token_ids]
        if len(new) > 1:
            last = len(new) - 1
            return "".join(self._step([t], final and i == last) for i, t in enumerate(new))
        return self._step(new, final)

    def _step(self, new: list[int], final: bool) -> str:
        self.token_ids.extend(new)
        window = self._decode(self.token_ids[self._start :])
        end = len(window)
        if not final:
            end -= _trailing_replacements(window, self._window_out)
        if end > self._window_out:
            self._raw += window[self._window_out : end]
            self._window_out = end
        if end == len(window) and not final:
            self._slide()
        out = self._output()
        if final:
            self.finished = True
            whole = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip)
            if whole.startswith(out[: self._sent]):  # always, but for a decoder that rewrites earlier text
                out = whole
            self._final = out
        safe = len(out) if final or not self._cleanup else max(self._sent, len(out) - CLEANUP_REACH)
        delta = out[self._sent : safe]
        self._sent = max(self._sent, safe)
        return delta

    def _slide(self) -> None:
        """Moves the window up to the last token that decodes alone to whole characters (non-empty, no
        U+FFFD): such a token starts and ends on character boundaries, so the window's text from it on
        is the text of the whole sequence from it on. Looks back a few tokens only; past a run of tokens
        that are textless (skipped specials) or parts of characters (byte-fallback runs, where
        `ByteFallback` decodes each run of byte tokens as one unit) the window stays where it is."""
        ids = self.token_ids
        for start in range(len(ids) - 1, max(self._start, len(ids) - 9), -1):
            text = self._decode(ids[start:])
            if text and REPLACEMENT not in text:
                self._start, self._window_out = start, len(text)
                return


class HFTextStream(TextStream):
    """One streamed request's text on a checkpoint's tokenizer: serve's `TextStream` (stop strings applied)
    with an `IncrementalDetokenizer` as its decoder."""

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        super().__init__(stop, lambda token_ids, final: detok.push(token_ids, final=final), include_stop)
