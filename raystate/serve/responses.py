"""OpenAI's Responses API (POST /v1/responses), served through the chat route.

A Responses request is a chat in another shape: `instructions` is a system message; `input` is one user
message (a string) or a list of items (messages with text parts, earlier `function_call`s and their
`function_call_output`s, earlier `reasoning`); `tools` are flat function definitions; `text.format` is
response_format; `max_output_tokens` is max_completion_tokens. `to_chat` rewrites it as a
ChatCompletionRequest, so that the prompt, the sampling defaults, the grammar of a forced call and the
tool-call and reasoning parsers are the chat route's own, and says how to name a chat field's error as
the Responses field it came from.

The answer is a list of output items rather than one message, in the order the model wrote them: a
`reasoning` item (its thinking, with a reasoning parser), `message` items (`output_text`) and one
`function_call` item per call. `ResponseWriter` builds them from the text as it comes, split by
`TurnSplitter` into thinking, content and call pieces; the same writer makes the whole response and, when
streamed, the event sequence (response.created, response.in_progress, then per item output_item.added,
its deltas and its .done events, output_item.done, and last response.completed, response.incomplete at
max_output_tokens, or response.failed), each event numbered by `sequence_number`. One item is open at a
time: a piece of another kind closes it.

With `include: ["message.output_text.logprobs"]` (and `top_logprobs` alternatives) the message text
carries its tokens' logprobs, in its part and in its delta events, as the chat route computes them.

raystate keeps no responses (as vLLM by default): `store` is answered false, and `previous_response_id`,
`background`, `conversation` and stored `item_reference`s are refused, naming the field; so are input
parts other than text, and tools other than functions.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from raystate.errors import InvalidRequest
from raystate.serve.protocol import (
    FUNCTION_NAME,
    MAX_CONTENT_PARTS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_MODEL_CHARS,
    MAX_SCHEMA_NAME_CHARS,
    MAX_TOOL_ARGUMENTS_CHARS,
    MAX_TOOL_CALL_ID_CHARS,
    MAX_TOOLS,
    MAX_USER_CHARS,
    ChatCompletionRequest,
    Usage,
    _Request,
    first_error,
)
from raystate.serve.tool_calls import ToolCallDelta

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_INSTRUCTIONS_CHARS = 1 << 20  # the body cap bounds it first

# The fields of OpenAI's request that need a stored response, a background run or a prompt template:
# accepted only unset (false), since raystate keeps none of these.
_UNSUPPORTED = {
    "previous_response_id": "unset: raystate stores no responses (send the whole conversation in input)",
    "conversation": "unset: raystate stores no conversations (send the whole conversation in input)",
    "background": "false: raystate runs no background responses",
    "prompt": "unset: raystate has no stored prompt templates",
    "max_tool_calls": "unset: the calls of one turn are bounded by max_output_tokens only",
}
# `include` entries: the message text's token logprobs; reasoning as "encrypted content" (stateless
# clients ask for it to send the reasoning back; raystate's reasoning items carry it as text, which
# comes back as it is).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content")
# Input content parts that carry text, and what else OpenAI's input may carry (refused by name).
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class FunctionTool(_Request):
    """A function the model may call (the Responses API's flat form of the chat route's tool)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Request):
    """`text.format`: plain text, any JSON object, or JSON that `schema` accepts."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=MAX_SCHEMA_NAME_CHARS)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ReasoningConfig(_Request):
    """`reasoning`: the effort goes to the chat template as `reasoning_effort` (templates that read it:
    gpt-oss's); raystate writes no summaries."""

    effort: str | None = Field(None, max_length=16)
    summary: str | None = Field(None, max_length=16)


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    input: str | list[dict[str, Any]]
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTIONS_CHARS)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    # "none", "auto", "required" or {"type": "function", "name": ...}; absent: "auto" with tools
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None  # answered false: nothing is stored
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_KEYS)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    include: list[str] | None = Field(None, max_length=16)  # extra output data (_INCLUDABLE)
    truncation: Literal["disabled"] | None = None  # "auto" (drop the middle of a long input) is refused
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    # alternatives per token in the message text's logprobs (read with include's OUTPUT_LOGPROBS only)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v or not all(isinstance(item, dict) for item in v):
            raise ValueError("must be a string or a non-empty list of input items (objects)")
        if len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} input items, got {len(v)}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function":
            name = v.get("name")
            if isinstance(name, str) and re.match(FUNCTION_NAME, name):
                return {"type": "function", "name": name}
        raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v: Any, info: Any) -> Any:
        if v not in (None, False):
            raise ValueError(_UNSUPPORTED[info.field_name])
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for name in v or ():
            if name not in _INCLUDABLE:
                raise ValueError(
                    f"{name!r}: raystate adds no such output data (only {', '.join(_INCLUDABLE)})"
                )
        return v

    @property
    def output_logprobs(self) -> bool:
        """Whether the message text carries its tokens' logprobs (OpenAI's and vLLM's rule: asked for in
        `include`; `top_logprobs` alone adds nothing)."""
        return OUTPUT_LOGPROBS in (self.include or ())


# -- the request as a chat ------------------------------------------------------------------------------


def _part_text(parts: Any, where: str) -> str:
    """The text of a content value: a string, or a list of text parts (joined)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise InvalidRequest(where, "a string or a list of content parts", type(parts).__name__)
    if len(parts) > MAX_CONTENT_PARTS:
        raise InvalidRequest(where, f"at most {MAX_CONTENT_PARTS} content parts", len(parts))
    texts = []
    for j, p in enumerate(parts):
        kind = p.get("type")
        if kind not in _TEXT_PARTS:
            limit = f"a text part ({', '.join(_TEXT_PARTS)}): this model reads text only"
            raise InvalidRequest(f"{where}[{j}].type", limit, kind)
        text = p.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}[{j}].text", "a string", type(text).__name__)
        texts.append(text)
    return "".join(texts)


def _string(item: dict, key: str, where: str, max_chars: int) -> str:
    v = item.get(key)
    if not isinstance(v, str) or not v or len(v) > max_chars:
        raise InvalidRequest(f"{where}.{key}", f"a string of 1 to {max_chars} characters", v)
    return v


def chat_messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The request's conversation as chat messages, and for each the Responses path it came from
    ("instructions", "input", "input[3]"). An assistant turn is the items of one Responses output in a
    row: a reasoning item's text becomes the turn's reasoning_content, an assistant message its content,
    and the function calls after them its tool_calls."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
        sources.append("instructions")
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}], [*sources, "input"]
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn it begins

    def turn(where: str, content: str | None = None) -> dict[str, Any]:
        """The assistant turn an item joins: the last message if it is an assistant turn that can take it
        (calls join any; a message joins a turn with no content yet), else a new one."""
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and reasoning is None:
            if content is None:
                return last
            if last["content"] is None and not last.get("tool_calls"):
                last["content"] = content
                return last
        new = {"role": "assistant", "content": content}
        if reasoning is not None:
            new["reasoning_content"], reasoning = reasoning, None
        messages.append(new)
        sources.append(where)
        return new

    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}.role", "'user', 'system', 'developer' or 'assistant'", role)
            content = _part_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                turn(where, content)
                continue
            reasoning = None  # thinking that no assistant turn followed
            messages.append({"role": role, "content": content})
            sources.append(where)
        elif kind == "function_call":
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str) or len(arguments) > MAX_TOOL_ARGUMENTS_CHARS:
                limit = f"a string (JSON text) of at most {MAX_TOOL_ARGUMENTS_CHARS} characters"
                raise InvalidRequest(f"{where}.arguments", limit, type(arguments).__name__)
            call = {
                "id": _string(item, "call_id", where, MAX_TOOL_CALL_ID_CHARS),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where, MAX_SCHEMA_NAME_CHARS),
                    "arguments": arguments,
                },
            }
            turn(where).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where, MAX_TOOL_CALL_ID_CHARS)
            output = _part_text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            sources.append(where)
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                raise InvalidRequest(
                    f"{where}.content", "a list of reasoning_text parts", type(parts).__name__
                )
            texts = [p.get("text") for p in parts if p.get("type") == "reasoning_text"]
            if not all(isinstance(t, str) for t in texts):
                raise InvalidRequest(f"{where}.content", "reasoning_text parts with text", "not a string")
            reasoning = (reasoning or "") + "".join(texts)  # (encrypted content alone: nothing to read)
        else:
            limit = (
                "'message', 'function_call', 'function_call_output' or 'reasoning' (raystate stores no items)"
            )
            raise InvalidRequest(f"{where}.type", limit, kind)
    return messages, sources


def to_chat(req: ResponsesRequest) -> tuple[ChatCompletionRequest, Callable[[str], str]]:
    """The chat request this Responses request runs as, and the function that names a chat field's error
    as the Responses field it came from (messages[2].content -> input[4].content)."""
    messages, sources = chat_messages(req)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {k: v for k, v in t.known_fields(exclude_none=True).items() if k != "type"},
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    if req.output_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort}

    def rename(field: str) -> str:
        m = re.match(r"messages\[(\d+)\](.*)", field)
        if m:
            k = int(m.group(1))
            return (sources[k] if k < len(sources) else "input") + m.group(2)
        for chat, ours in _RENAMED:
            if field == chat or field.startswith(chat + ".") or field.startswith(chat + "["):
                return ours + field[len(chat) :]
        return re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", field)

    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        param, message = first_error(e)
        field = rename(param or "input")
        raise InvalidRequest(field, message, None) from None
    return chat, rename


_RENAMED = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
    ("chat_template_kwargs", "reasoning.effort"),
    ("logprobs", "include"),
)


def renamed(e: InvalidRequest, rename: Callable[[str], str]) -> InvalidRequest:
    """`e` naming the Responses field (the same error when the name does not change)."""
    field = rename(e.field)
    if field == e.field:
        return e
    out = InvalidRequest(field, e.limit, e.got)
    text = str(e)
    out.args = (field + text[len(e.field) :] if text.startswith(e.field) else text,)
    return out


# -- the answer -----------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """The output items and events of one response, from its pieces as they come (`feed`), and the
    Response object, in progress (`response`) or final (after `finish` or `fail`)."""

    def __init__(
        self,
        req: ResponsesRequest,
        response_id: str,
        model: str,
        created: int,
        sampling: Any,
        streamed: bool | None = True,
    ) -> None:
        """`streamed` false: the events are numbered but not written (a whole response sends none)."""
        self.req = req
        self.streamed = bool(streamed)
        self.id = response_id
        self.model = model
        self.created = created
        self.temperature = sampling.temperature
        self.top_p = sampling.top_p
        self.items: list[dict[str, Any]] = []  # in output order; the last may be open
        self.open: dict[str, Any] | None = None
        self.status = "in_progress"
        self.incomplete_details: dict[str, str] | None = None
        self.error: dict[str, str] | None = None
        self.usage: dict[str, Any] | None = None
        self._seq = 0
        # token logprob entries not yet given to message text: the tokens of text the splitter holds back
        self._pending_logprobs: list[dict[str, Any]] = []

    # -- events ----------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        seq, self._seq = self._seq, self._seq + 1
        if not self.streamed:
            return ""
        data = {"type": kind, "sequence_number": seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(
        self,
        thinking: str,
        content: str,
        calls: list[ToolCallDelta],
        logprobs: list[dict[str, Any]] | None = None,
    ) -> list[str]:
        """One piece of the turn: its thinking, message text and call pieces (split by TurnSplitter), and
        the logprob entries of the tokens it came from (with include's OUTPUT_LOGPROBS). The entries go
        with the message text: a token's entry joins the first message text at or after it, unless
        thinking or a call comes out first (its text was that, not message text)."""
        events: list[str] = []
        self._pending_logprobs += logprobs or ()
        if thinking:
            events += self._text("reasoning", thinking)
        if content:
            events += self._text("message", content, self._pending_logprobs)
            self._pending_logprobs = []
        elif thinking or calls:
            self._pending_logprobs = []
        for d in calls:
            events += self._call(d)
        return events

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] = ()) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            events += self._open_text(kind)
        item = self.open
        item["content"][0]["text"] += text
        at = dict(item_id=item["id"], output_index=len(self.items) - 1, content_index=0)
        if kind == "message":
            item["content"][0]["logprobs"] += logprobs
            events.append(self._event("response.output_text.delta", **at, delta=text, logprobs=logprobs))
        else:
            events.append(self._event("response.reasoning_text.delta", **at, delta=text))
        return events

    def _open_text(self, kind: str) -> list[str]:
        if kind == "message":
            item = {
                "id": _id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": _id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events = [self._event("response.output_item.added", output_index=index, item=_copy(item))]
        item["content"].append(part)
        if kind == "message":
            at = dict(item_id=item["id"], output_index=index, content_index=0)
            events.append(self._event("response.content_part.added", **at, part=_copy(part)))
        return events

    def _call(self, d: ToolCallDelta) -> list[str]:
        events = []
        if d.id is not None:  # a new call's first piece
            events += self._close()
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "call_id": d.id,
                "name": d.name,
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            self.open = item
            events.append(
                self._event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))
            )
        item = self.open
        if item is None or item["type"] != "function_call":  # (the reader sends a call's pieces in a row)
            raise RuntimeError("a function call's arguments before its first piece")
        if d.arguments:
            item["arguments"] += d.arguments
            at = dict(item_id=item["id"], output_index=len(self.items) - 1)
            events.append(self._event("response.function_call_arguments.delta", **at, delta=d.arguments))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        """Ends the open item (if any): its .done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        at = dict(item_id=item["id"], output_index=index)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done",
                    **at,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
            )
            events.append(self._event("response.content_part.done", **at, content_index=0, part=_copy(part)))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._event("response.reasoning_text.done", **at, content_index=0, text=text))
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **at,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    # -- the end ---------------------------------------------------------------------------------------

    def finish(self, finish_reason: str | None, usage: Usage) -> list[str]:
        """Closes the last item and the response: completed, or incomplete at max_output_tokens. A turn
        that wrote nothing (or only thinking) still has its message, empty."""
        truncated = finish_reason == "length"
        events = []
        if not any(item["type"] in ("message", "function_call") for item in self.items):
            events += self._close()
            events += self._open_text("message")
        events += self._close("incomplete" if truncated else "completed")
        self.usage = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        }
        if truncated:
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return [*events, self._event("response.completed", response=self.response())]

    def fail(self, message: str, code: str = "server_error") -> list[str]:
        """Ends a response whose generation failed (after its stream began): response.failed."""
        events = self._close("incomplete")
        self.status = "failed"
        self.error = {"code": code, "message": message}
        return [*events, self._event("response.failed", response=self.response())]

    def response(self) -> dict[str, Any]:
        """The Response object as it stands."""
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": [_copy(item) for item in self.items],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": False,
            "temperature": self.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": req.tool_choice
            if req.tool_choice is not None
            else ("auto" if req.tools else "none"),
            "tools": [t.known_fields(exclude_none=True) for t in req.tools or ()],
            "top_logprobs": req.top_logprobs,
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": self.usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as an event carries it: a snapshot, so that later text does not change an event sent."""
    return json.loads(json.dumps(item))
