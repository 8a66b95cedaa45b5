"""A reasoning model's thinking, split from its answer, for OpenAI-style chat responses.

Reasoning models (Qwen3, QwQ, DeepSeek-R1 and their distillations) write their thinking between `<think>`
and `</think>` before the answer. With a reasoning parser set (`--reasoning-parser`, as vLLM's flag of
that name), the server sends that text as the message's `reasoning_content` and only the answer as
`content`; without one the whole text is content, as before. Some templates open the think block in the
prompt (DeepSeek-R1's newer ones, Qwen3's thinking-only releases), so the output starts inside it and
only the closing tag appears: the server says so (`starts_inside`) from the rendered prompt. A model told
not to think (Qwen3 with `enable_thinking: false` gets an empty block in its prompt) writes no tag at
all, and its output is all answer.

`ThinkStream` reads one choice's text deltas as they come and says, delta by delta, what is reasoning
and what is answer; a piece that may be the start of a tag is held back until the next delta decides it.
"""

from __future__ import annotations

from raystate.serve.tool_calls import partial_tag_length

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered chat prompt leaves a think block open for the model (its last tag is <think>)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


class ThinkStream:
    """One choice's text -> (reasoning, answer) deltas.

    Before any text the stream waits for a leading `<think>` (whitespace before it allowed); output that
    starts otherwise is all answer. Inside the block, text is reasoning until `</think>`; what follows is
    answer (its leading newlines dropped, as the templates write "</think>\\n\\n"). Joining every
    returned reasoning piece gives `reasoning`, every answer piece `answer`."""

    def __init__(self, starts_inside: bool = False) -> None:
        self._state = "thinking" if starts_inside else "start"  # start, thinking, answer_start, answer
        self._held = ""  # text not decided yet (a possible tag, or leading whitespace)
        self.reasoning = ""
        self.answer = ""
        self._finished = False

    def feed(self, text: str) -> tuple[str, str]:
        """One text delta in; (reasoning, answer) to send now (either may be "")."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        reasoning, answer = [], []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if not stripped or THINK_OPEN.startswith(stripped):
                    self._held = text  # whitespace, or what may still become <think>
                    break
                if stripped.startswith(THINK_OPEN):
                    self._state, text = "thinking", stripped[len(THINK_OPEN) :]
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                at = text.find(THINK_CLOSE)
                if at >= 0:
                    reasoning.append(text[:at])
                    self._state, text = "answer_start", text[at + len(THINK_CLOSE) :]
                    continue
                keep = partial_tag_length(text, THINK_CLOSE)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep :]
                break
            elif self._state == "answer_start":
                text = text.lstrip("\n")
                if text:
                    self._state = "answer"
            else:
                answer.append(text)
                break
        return self._record("".join(reasoning), "".join(answer))

    def finish(self) -> tuple[str, str]:
        """The output ended: held text goes where it stood (an unclosed block's text is reasoning)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        held, self._held = self._held, ""
        if self._state == "thinking":
            return self._record(held, "")
        return self._record("", held if self._state != "answer_start" else "")

    def _record(self, reasoning: str, answer: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.answer += answer
        return reasoning, answer
