"""Tool calls out of the model's text, for OpenAI's chat API.

A chat request with `tools` expects the assistant's answer split in two: `content` (text for the user)
and `tool_calls` (each an id, a function name and its arguments as JSON text). Streamed, the calls come
as `delta.tool_calls` pieces: a call's first piece carries its id and name, the later ones more arguments
text. The model writes only text, so a `ToolCallStream` reads one choice's text deltas as they come and
says, delta by delta, what to send as content and what as call pieces. There are three modes, after
`tool_choice`:

- a named function (`NamedToolStream`): the grammar holds the whole output to that function's arguments
  object, so every piece of text is arguments of the one call;
- "required" (`RequiredToolStream`): the grammar holds the output to a JSON array of
  `{"name": ..., "parameters": {...}}` objects (`required_schema`), each element one call;
- "auto": the model writes free text with calls in its own format; raystate reads Hermes'
  `<tool_call>{...}</tool_call>` blocks (`HermesToolStream`: Qwen2.5, Qwen3, Hermes models) and Llama
  3.1-3.3's bare JSON calls (`Llama3JsonToolStream`).

`make_stream` picks the stream for a request, `finish_reason` the reason its choice reports.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_CALL_PARSERS",
    "HermesToolStream",
    "Llama3JsonToolStream",
    "NamedToolStream",
    "RequiredToolStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "finish_reason",
    "make_stream",
    "named_schema",
    "new_call_id",
    "parser_for_template",
    "partial_tag_length",
    "required_schema",
]

# The formats of calls written in free text that raystate reads (tool_choice "auto").
TOOL_CALL_PARSERS = ("hermes", "llama3_json")

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
# What Llama 3.1-3.3's chat templates tell the model when tools are given (the format of its calls).
LLAMA3_JSON_INSTRUCTION = '{"name": function name, "parameters": dictionary of argument name and its value}'


def new_call_id() -> str:
    """A fresh tool call id, shaped as OpenAI's: "call_" and 24 lowercase hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One complete call, as a non-streamed response's `message.tool_calls[i]` carries it."""

    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of one call (OpenAI's `delta.tool_calls[i]`). A client joins a call's pieces
    by `index`; the id and name come once, on its first piece."""

    index: int  # the call's position among the choice's calls (0, 1, ...)
    id: str | None  # the call's first piece only
    name: str | None  # the call's first piece only
    arguments: str  # arguments text to append ("" allowed)


Output = tuple[str, list[ToolCallDelta]]


class ToolCallStream:
    """Reads one choice's text deltas and tells what to send as content and as call pieces.

    `feed` takes each text delta as it comes, `finish` ends the output; each returns (content text to
    send now, possibly "", call deltas to send now). Joining every returned content gives the message's
    content, and `calls` is every complete call so far, so a non-streamed response feeds the whole text
    once and reads both. A stream is used once: `feed` after `finish`, or a second `finish`, is a bug in
    the caller and raises RuntimeError.
    """

    # Whether the choice's natural end ("stop") is reported as "tool_calls" once a call was made: true
    # where the model chose to call (or was made to pick among the tools); OpenAI reports a forced named
    # function with the engine's own "stop".
    reports_tool_calls = True
    # Whether the model may write content beside its calls: false where the grammar holds the whole
    # output to calls, so an answer cut before its first call has null content, as a call turn has.
    writes_content = True

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> Output:
        if self._finished:
            raise RuntimeError("feed() after finish(): the output already ended")
        return self._feed(text)

    def finish(self) -> Output:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return self._finish()

    def _feed(self, text: str) -> Output:
        raise NotImplementedError

    def _finish(self) -> Output:
        raise NotImplementedError

    def _new_call(self, name: str, arguments: str) -> ToolCallDelta:
        """Records a complete call and returns it as one delta that carries it whole."""
        call = ToolCall(new_call_id(), name, arguments)
        self.calls.append(call)
        return ToolCallDelta(len(self.calls) - 1, call.id, call.name, call.arguments)


class NamedToolStream(ToolCallStream):
    """tool_choice names one function: the grammar already holds the whole output to its arguments
    object, so the text is streamed as that call's arguments as it comes, with no parsing.

    The call's first delta (id and name) goes out on the first feed, even an empty one, so that a client
    sees the call start at once. Whitespace around the JSON is no part of the arguments: leading
    whitespace is dropped and trailing whitespace held back until more text follows it (dropped at the
    end), so the streamed pieces join to exactly the `arguments` of the final call.
    """

    reports_tool_calls = False
    writes_content = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._call_id = new_call_id()
        self._started = False  # the first delta (id, name) went out
        self._in_json = False  # a non-whitespace character came
        self._held_whitespace = ""  # trailing whitespace not sent yet
        self._arguments: list[str] = []  # the arguments text sent so far

    def _feed(self, text: str) -> Output:
        if not self._in_json:
            text = text.lstrip()
            self._in_json = bool(text)
        text = self._held_whitespace + text
        sent = text.rstrip()
        self._held_whitespace = text[len(sent) :]
        return "", self._delta(sent)

    def _finish(self) -> Output:
        deltas = self._delta("")  # a stream that was never fed still opens its call
        self.calls.append(ToolCall(self._call_id, self.name, "".join(self._arguments)))
        return "", deltas

    def _delta(self, arguments: str) -> list[ToolCallDelta]:
        self._arguments.append(arguments)
        if not self._started:
            self._started = True
            return [ToolCallDelta(0, self._call_id, self.name, arguments)]
        return [ToolCallDelta(0, None, None, arguments)] if arguments else []


# Outside a JSON string: the characters that change the scanner's state; inside one: its end or an escape.
_STRUCTURAL = re.compile(r'[\[\]{}"]')
_STRING_STOP = re.compile(r'["\\]')


class RequiredToolStream(ToolCallStream):
    """tool_choice "required": the grammar holds the output to a JSON array of `{"name": <str>,
    "parameters": <object>}` objects (`required_schema`), each element one call.

    A call is sent as soon as its element is complete, so that a client can start on it while the model
    writes the next. Finding where an element ends needs no parsing of the whole buffer: a small scanner
    tracks JSON strings, escapes and bracket depth across deltas (O(length of the output) in all), and
    only a complete element is parsed. A call's arguments are its parameters re-serialised with
    `json.dumps(parameters, ensure_ascii=False)` (separators ", " and ": ", OpenAI's own style), sent
    whole in the call's one delta. An element left incomplete when the output ends (cut by max_tokens)
    is dropped, as is an element not of that shape (which the grammar never lets through).
    """

    writes_content = False

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0  # open brackets ([ and {) outside strings
        self._in_string = False
        self._escaped = False  # inside a string, right after a backslash
        self._top_is_array = False  # the outermost value opened with "["
        self._done = False  # the outermost value closed: the rest of the text is ignored
        self._element_parts: list[str] | None = None  # the open element's text so far; None: none open

    def _feed(self, text: str) -> Output:
        deltas: list[ToolCallDelta] = []
        pos, end = 0, len(text)
        element_start = 0  # where the open element's text begins in `text`
        while pos < end and not self._done:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    pos += 1
                    continue
                found = _STRING_STOP.search(text, pos)
                if found is None:
                    break
                pos = found.end()
                if found.group() == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                continue
            found = _STRUCTURAL.search(text, pos)
            if found is None:
                break
            char, pos = found.group(), found.end()
            if char == '"':
                self._in_string = True
            elif char in "[{":
                if self._depth == 0:
                    self._top_is_array = char == "["
                elif self._depth == 1 and self._top_is_array and char == "{":
                    self._element_parts, element_start = [], found.start()
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 1 and self._element_parts is not None:
                    element = "".join(self._element_parts) + text[element_start:pos]
                    self._element_parts = None
                    delta = self._element_call(element)
                    if delta is not None:
                        deltas.append(delta)
                elif self._depth <= 0:
                    self._done = True
        if self._element_parts is not None:
            self._element_parts.append(text[element_start:])
        return "", deltas

    def _finish(self) -> Output:
        self._element_parts = None  # an element cut off: no call
        return "", []

    def _element_call(self, element: str) -> ToolCallDelta | None:
        try:
            value = json.loads(element)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict):
            return None
        name, parameters = value.get("name"), value.get("parameters", {})
        if not isinstance(name, str) or not isinstance(parameters, dict):
            return None
        return self._new_call(name, json.dumps(parameters, ensure_ascii=False))


class HermesToolStream(ToolCallStream):
    """tool_choice "auto" for models that write calls as Hermes blocks (Qwen2.5, Qwen3, Hermes):

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    among free text. Text outside blocks is content, sent as it comes, except a trailing piece that may
    be the start of `<tool_call>` ("<", "<tool", ...): that waits for the next delta to tell. A block is
    held until its closing tag, then parsed: an object with a string "name" and "arguments" (or
    "parameters", which some models write) that is an object (re-serialised with
    `json.dumps(..., ensure_ascii=False)`), a string (taken as is) or absent ("{}"). A valid block is one
    call, sent whole in one delta; any other block is not lost but sent, tags and all, as content, since
    the model evidently meant it as text or botched it and the user should see it.

    After the first call, whitespace-only text between blocks (the newlines a model puts between them)
    is dropped; a stretch of text that holds anything else is sent whole. At the end, a held partial tag
    is content, and a block never closed is a call if what it holds is a valid call (a model may stop at
    EOS before the closing tag), else content with its opening tag. Tags match exactly, case and all.
    JSON inside a block is read leniently about control characters in strings (`strict=False`), as
    models write raw newlines there.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held_tag = ""  # outside blocks: trailing text that may begin HERMES_OPEN
        self._in_block = False
        self._block_parts: list[str] = []  # the open block's text after HERMES_OPEN
        self._block_tail = ""  # its last len(HERMES_CLOSE) - 1 characters, where the close tag may begin
        # After a call, until other text comes: the whitespace since, dropped unless other text follows.
        self._after_call = False
        self._held_whitespace = ""

    def _feed(self, text: str) -> Output:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        text, self._held_tag = self._held_tag + text, ""
        while text:
            if self._in_block:
                rest = self._block_text(text, content, deltas)
                if rest is None:
                    break
                text = rest
                continue
            at = text.find(HERMES_OPEN)
            if at < 0:
                keep = partial_tag_length(text, HERMES_OPEN)
                content.append(self._content(text[: len(text) - keep]))
                self._held_tag = text[len(text) - keep :]
                break
            content.append(self._content(text[:at]))
            self._in_block, self._block_parts, self._block_tail = True, [], ""
            text = text[at + len(HERMES_OPEN) :]
        return "".join(content), deltas

    def _finish(self) -> Output:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._in_block:
            self._in_block = False
            body = "".join(self._block_parts)
            delta = self._block_call(body)
            if delta is not None:
                deltas.append(delta)
            else:
                content.append(self._content(HERMES_OPEN + body))
        else:
            content.append(self._content(self._held_tag))
            self._held_tag = ""
        self._held_whitespace = ""  # whitespace after the last call is never sent
        return "".join(content), deltas

    def _block_text(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> str | None:
        """Takes text inside a block. Once the block closes, adds its call (or its raw text, as content)
        and returns the text after the close tag; None while it stays open. Only the last few characters
        held are searched again, so a long block costs O(its length)."""
        window = self._block_tail + text
        at = window.find(HERMES_CLOSE)
        if at < 0:
            self._block_parts.append(text)
            self._block_tail = window[-(len(HERMES_CLOSE) - 1) :]
            return None
        self._block_parts.append(text)
        held = "".join(self._block_parts)
        close_at = len(held) - len(window) + at
        body, rest = held[:close_at], held[close_at + len(HERMES_CLOSE) :]
        self._in_block, self._block_parts, self._block_tail = False, [], ""
        delta = self._block_call(body)
        if delta is not None:
            deltas.append(delta)
        else:
            content.append(self._content(HERMES_OPEN + body + HERMES_CLOSE))
        return rest

    def _block_call(self, body: str) -> ToolCallDelta | None:
        """The call a block's text holds (a delta of it, recorded in `calls`), or None if it holds none."""
        try:
            value = json.loads(body.strip(), strict=False)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        key = "arguments" if "arguments" in value else "parameters"
        arguments = value.get(key, {})
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif not isinstance(arguments, str):
            return None
        # whitespace since the last call is dropped; so is whitespace-only text up to the next one
        self._held_whitespace, self._after_call = "", True
        return self._new_call(value["name"], arguments)

    def _content(self, text: str) -> str:
        """What to send of content `text`: after a call, whitespace waits until other text comes (then
        goes out with it), and is dropped if a call or the end comes first."""
        if not self._after_call or not text:
            return text
        if text.isspace():
            self._held_whitespace += text
            return ""
        text, self._held_whitespace, self._after_call = self._held_whitespace + text, "", False
        return text


class Llama3JsonToolStream(ToolCallStream):
    """Llama 3.1-3.3's calls: given tools, their chat template asks the model to answer a call with a JSON
    object `{"name": ..., "parameters": {...}}` and nothing else (several calls separated by ";"),
    sometimes after the `<|python_tag|>` token. So an output whose first text (past whitespace) is "{" or
    that tag is held whole and read at the end: calls if it is nothing but such objects, else the text it
    was, sent as content then. Any other output is content, streamed as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None: not decided yet; "content"; "json"
        self._held: list[str] = []

    def _feed(self, text: str) -> Output:
        if self._mode == "content":
            return text, []
        self._held.append(text)
        if self._mode == "json":
            return "", []
        held = "".join(self._held)
        start = held.lstrip()
        if not start or (LLAMA3_PYTHON_TAG.startswith(start) and start != LLAMA3_PYTHON_TAG):
            return "", []  # only whitespace, or what may still become the tag
        if start.startswith(("{", LLAMA3_PYTHON_TAG)):
            self._mode = "json"
            return "", []
        self._mode, self._held = "content", []
        return held, []

    def _finish(self) -> Output:
        held, self._held = "".join(self._held), []
        if self._mode != "json":
            return held, []
        calls = _llama3_calls(held.strip().removeprefix(LLAMA3_PYTHON_TAG))
        if calls is None:
            return held, []
        return "", [self._new_call(name, arguments) for name, arguments in calls]


def _llama3_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each `{"name": ..., "parameters"|"arguments": {...}}` object in `text`,
    objects separated by ";" and whitespace; None if the text is anything else."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        arguments = value.get("parameters", value.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        calls.append((value["name"], json.dumps(arguments, ensure_ascii=False)))


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag` (0: none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


# -- schemas and choosing a stream -----------------------------------------------------------------------


def named_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema that holds a forced named call to its arguments: the function's parameters, or
    any object when it declares none."""
    parameters = function.get("parameters")
    return dict(parameters) if parameters is not None else {"type": "object"}


def required_schema(functions: Sequence[Mapping[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON Schema that holds tool_choice "required" to calls of the given OpenAI function
    definitions: an array of at least one `{"name": <one function's name>, "parameters": <its
    arguments>}` object (at most one when `parallel` is False, as parallel_tool_calls false asks)."""
    choices = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": named_schema(function),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": choices}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parser_for_template(template: str | None) -> str | None:
    """The call format a chat template teaches its model, if raystate reads it: "hermes" for a template
    that writes `<tool_call>` blocks, "llama3_json" for one that asks for Llama 3.1's JSON calls; None
    otherwise (also for no template)."""
    if template is not None and HERMES_OPEN in template:
        return "hermes"
    if template is not None and LLAMA3_JSON_INSTRUCTION in template:
        return "llama3_json"
    return None


def make_stream(
    tool_choice: str | tuple[str, str], functions: Sequence[Mapping[str, Any]], parser: str | None
) -> ToolCallStream | None:
    """The stream for one choice of a chat request.

    `tool_choice`: the request's choice, normalised: "none", "auto", "required", or ("function", name)
    for a named function. `functions`: the request's OpenAI function definitions. `parser`: the format
    the model writes calls in (one of TOOL_CALL_PARSERS), needed for "auto" only. Returns None for
    "none" (the text is all content). Raises ValueError for "auto" without a known parser, a named
    function not among `functions`, or an unknown choice.
    """
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        if parser == "hermes":
            return HermesToolStream()
        if parser == "llama3_json":
            return Llama3JsonToolStream()
        raise ValueError(f"tool_choice 'auto' needs a tool call parser ({TOOL_CALL_PARSERS}), not {parser!r}")
    if tool_choice == "required":
        return RequiredToolStream()
    if isinstance(tool_choice, tuple) and len(tool_choice) == 2 and tool_choice[0] == "function":
        name = tool_choice[1]
        if name not in [f.get("name") for f in functions]:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
        return NamedToolStream(name)
    raise ValueError(f"unknown tool_choice {tool_choice!r}")


def finish_reason(stream: ToolCallStream | None, engine_reason: str | None) -> str | None:
    """The finish_reason a choice reports: "tool_calls" where the model ended naturally ("stop") after
    calls it chose to make ("auto") or picked ("required"); otherwise the engine's reason, so a cut
    output stays "length" and a forced named function "stop", as OpenAI reports them."""
    if stream is not None and stream.reports_tool_calls and stream.calls and engine_reason == "stop":
        return "tool_calls"
    return engine_reason
