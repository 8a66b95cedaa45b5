"""One assistant turn's text, split as it streams into reasoning, content and tool-call pieces.

A chat choice (and a Responses answer) is the model's text read through up to two readers: the reasoning
parser's `ThinkStream`, which takes the thinking out (`raystate.serve.reasoning`), then the request's
`ToolCallStream`, which takes its calls out of the rest (`raystate.serve.tool_calls`). `TurnSplitter`
chains them for one choice, delta by delta; the whole text is one delta that is also the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raystate.serve.tool_calls import ToolCallDelta


class TurnSplitter:
    """Splits one choice's text deltas into (thinking, content, call pieces), with the request's reasoning
    parser and tool-call reader (either may be absent: its part is then empty, or all content)."""

    def __init__(
        self, think_factory: Callable[[], Any] | None, calls_factory: Callable[[], Any] | None
    ) -> None:
        self.think = think_factory() if think_factory is not None else None
        self.calls = calls_factory() if calls_factory is not None else None

    def feed(self, text: str, last: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """The next delta of the text (`last`: the final one, which flushes what the readers hold)."""
        thinking = ""
        if self.think is not None:
            thinking, text = self.think.feed(text)
            if last:
                more_thinking, more_text = self.think.finish()
                thinking, text = thinking + more_thinking, text + more_text
        made: list[ToolCallDelta] = []
        if self.calls is not None:
            text, made = self.calls.feed(text)
            if last:
                more_text, more_made = self.calls.finish()
                text, made = text + more_text, made + more_made
        return thinking, text, made
