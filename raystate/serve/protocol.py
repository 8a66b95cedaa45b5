"""The subset of the OpenAI HTTP API that raystate serves, as pydantic models, and the JSON body reader.

Unknown request fields are ignored, as vLLM ignores them (OpenAI's SDKs send fields such as `store`,
`metadata` or `service_tier` that a server need not act on): `ignored_fields` names them, and the ingress
logs one warning per request naming them. Fields whose JSON type is a union (`prompt`, `stop`, message
`content`, `tool_choice`) are checked by our own validators, so that a validation error's location is
always the field's own name (`prompt`, `messages[0].role`) and never a pydantic union tag. Parameters
raystate does not implement (`_NEUTRAL_ONLY`: `suffix`) are accepted only
at their neutral value (and `best_of` only equal to `n`), so a client that relies on them gets a 400
naming the field instead of a quietly different answer.

Every bad input must be a 400 naming the field, never a 500, and nothing a client sends may reach the
engine in a form that breaks it: so `load_body` rejects, before pydantic sees the body, what Python's
`json` would otherwise let through (NaN and Infinity, floats that overflow to inf, integers past 64 bits,
lone UTF-16 surrogates that no UTF-8 encoder takes, nesting deep enough to exhaust the recursion limit),
each with the path of the value at fault; and the models bound every string and list a request may send.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from raystate.messages import MAX_BAD_WORDS, MAX_CHOICE_STRINGS, MAX_GRAMMAR_CHARS, MAX_N

# -- limits ---------------------------------------------------------------------------------------------
# The body as a whole is capped by the ingress (max_body_bytes, 1 MiB by default); these bound what one
# field may hold, so that no field costs more than its use is worth and no value overflows downstream.

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_INT32 = 2**31 - 1
# The body object is level 1; the deepest field raystate reads, messages[i].content[j].text, is at
# level 5. 32 leaves room for clients that send (rejected) tools or schemas with some structure, and is
# far below the ~1000 levels at which json.loads or pydantic hit Python's recursion limit.
MAX_JSON_DEPTH = 32
MAX_SEED = INT64_MAX
MAX_TOP_K = MAX_INT32  # any top_k >= the vocabulary size means "off"; bounded so it fits every int field
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: the detokenizer holds back up to this many characters
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit; SamplingParams.validate checks it too)
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 1024  # text parts in one message's content
MAX_NAME_CHARS = 64  # a message's `name` (OpenAI's own limit)
MAX_MODEL_CHARS = 256  # `model`: echoed back in the error when it names no served model
MAX_USER_CHARS = 256  # `user`: an end-user id, kept by nobody here
MAX_ERROR_CHARS = 1024  # an error's message and param (see error_body)
MAX_PARAM_PART_CHARS = 64  # a client-made name (an unknown field) in an error's param (see field_path)
MAX_TEMPLATE_KWARGS = 64  # chat_template_kwargs entries
MAX_CHAT_TEMPLATE_CHARS = 1 << 17  # a request's own chat template (real ones are under 40k characters)
MAX_DETOKENIZE_IDS = 1 << 17  # /detokenize ids (the body cap bounds them first)
MAX_LOGPROBS = 20  # completions `logprobs`, chat `top_logprobs` (OpenAI's limit)
# Choices of one request, all prompts together (n × the prompts of a completions prompt list): one
# request cannot flood the queue. n itself is at most MAX_N (raystate.messages).
MAX_CHOICES = 1024
# Variables the chat template renderer sets itself: not settable through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
     "tokenize", "special_tokens"}
)  # fmt: skip


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- the JSON body --------------------------------------------------------------------------------------


class BodyError(ValueError):
    """A body that is not a JSON object raystate can validate. `param` names the field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Unusable:
    """Stands in for an integer literal too long for int() (past 4300 digits Python refuses it, and json
    with it), so that such a body is still a 400 naming the field; see load_body."""

    __slots__ = ()


_HUGE_INT = _Unusable()
_NOT_FINITE = "must be a finite number (NaN and Infinity are not JSON numbers)"
_OUT_OF_INT64 = f"integer out of range (must be in [{INT64_MIN}, {INT64_MAX}])"


def _parse_int_leniently(literal: str) -> int | _Unusable:
    return _HUGE_INT if len(literal) > len(str(INT64_MIN)) else int(literal)


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # escapes included
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")  # one pass of sub() removes exactly one level
_DEPTH_TOKEN = re.compile(rf"{_JSON_STRING.pattern}|[\[\]{{}}]", re.DOTALL)  # a string or a bracket


def _too_deep(text: str) -> tuple[bool, str | None]:
    """(whether some value is nested deeper than MAX_JSON_DEPTH, the top-level key it sits under).

    Runs before json.loads, which recurses once per level (RecursionError at ~1000 levels, and the C
    stack at risk past that wherever the recursion limit is raised), and without recursion itself: the
    text less its strings is cut down to its brackets, from which each pass of re.sub removes the
    innermost level ("[]", "{}"); brackets left after MAX_JSON_DEPTH passes mean a deeper value (or
    unbalanced brackets, which json.loads reports). Only then does a token scan look for the key. Bodies
    with at most MAX_JSON_DEPTH brackets cannot be too deep and are not looked at.
    """
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False, None
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    for _ in range(MAX_JSON_DEPTH):
        brackets = _INNERMOST.sub("", brackets)
        if not brackets:
            return False, None
    depth, key = 0, None
    for m in _DEPTH_TOKEN.finditer(text):
        token = m.group()
        if token[0] == '"':
            if depth == 1:  # in the body object: the last string before a container is that value's key
                key = token
        elif token in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                try:
                    name = json.loads(key) if key is not None else None
                except ValueError:
                    name = None
                return True, field_path((name,)) if isinstance(name, str) else None
        else:
            depth -= 1
    return False, None  # unbalanced brackets: json.loads says where


def _is_unicode(s: str) -> bool:
    """False for a string holding a lone surrogate ("\\ud800" in JSON): valid JSON, but no UTF-8 encoder
    (the tokenizer's, the response's) takes it."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_values(body: dict) -> None:
    """Raises BodyError naming the first value (in a walk without recursion) that is a NaN or infinite
    float (json takes NaN, Infinity and 1e999), an integer past 64 bits, or a string with a lone
    surrogate, keys included. Types are compared exactly: json makes no subclasses, and a bool is no int."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if type(value) is dict:
            for k in value:
                if not _is_unicode(k):
                    p = field_path((*path, k))
                    raise BodyError(f"{p}: field name is not valid Unicode (a lone surrogate)", p)
            children = value.items()
        else:
            children = enumerate(value)
        nested = []
        for k, v in children:
            t = type(v)
            if t is str:
                why = None if _is_unicode(v) else "not valid Unicode text (it holds a lone surrogate)"
            elif t is int:
                why = None if INT64_MIN <= v <= INT64_MAX else _OUT_OF_INT64
            elif t is float:
                why = None if math.isfinite(v) else _NOT_FINITE
            elif t is dict or t is list:
                nested.append((v, (*path, k)))
                continue
            elif t is _Unusable:
                why = _OUT_OF_INT64
            else:
                continue
            if why is not None:
                p = field_path((*path, k))
                raise BodyError(f"{p}: {why}", p)
        stack.extend(reversed(nested))


def load_body(body: bytes) -> dict:
    """The request body as a JSON object whose every number is finite and fits 64 bits, every string is
    valid Unicode and nothing is nested deeper than MAX_JSON_DEPTH; else BodyError (a 400)."""
    try:
        text = body.decode("utf-8-sig")  # RFC 8259: JSON between systems is UTF-8 (a BOM is tolerated)
    except UnicodeDecodeError as e:
        raise BodyError(f"request body is not valid UTF-8 (byte {e.start})") from None
    deep, param = _too_deep(text)
    if deep:
        where = f"{param}: " if param else ""
        raise BodyError(f"{where}nested deeper than {MAX_JSON_DEPTH} levels", param)
    try:
        try:
            data = json.loads(text)  # the C parser at full speed; _check_values then walks the result
        except ValueError:
            # Perhaps only an integer literal int() refuses: parsed again with those set aside, the body's
            # walk names the field; a body that is not JSON fails again, with json's own message.
            data = json.loads(text, parse_int=_parse_int_leniently)
    except RecursionError:  # cannot happen below MAX_JSON_DEPTH; kept so it can never be a 500
        raise BodyError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise BodyError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BodyError("request body must be a JSON object")
    _check_values(data)
    return data


# -- requests -------------------------------------------------------------------------------------------


MAX_IGNORED_NAMES = 16  # unknown fields named in the warning (the rest are counted)


class _Request(BaseModel):
    """A request body or a part of one. Unknown fields are kept aside (pydantic's `model_extra`), never
    used: `ignored_fields` names them, `known_fields` dumps the rest."""

    # allow_inf_nan=False: also when a model is built from Python values rather than load_body's output.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        """The paths of the unknown fields of this request and of its parts (`store`, `messages[0].foo`),
        made printable and bounded (field_path), at most MAX_IGNORED_NAMES of them plus a count."""
        names: list[str] = []
        total = 0
        stack: list[tuple[_Request, tuple]] = [(self, ())]
        while stack:
            model, path = stack.pop()
            extra = model.model_extra or {}
            total += len(extra)
            for key in extra:
                if len(names) < MAX_IGNORED_NAMES:
                    names.append(field_path((*path, key)))
            for name in type(model).model_fields:
                value = getattr(model, name, None)
                if isinstance(value, _Request):
                    stack.append((value, (*path, name)))
                elif isinstance(value, list):
                    stack.extend(
                        (v, (*path, name, i)) for i, v in enumerate(value) if isinstance(v, _Request)
                    )
        if total > len(names):
            names.append(f"... ({total - len(names)} more)")
        return names

    def known_fields(self, **kwargs: Any) -> dict[str, Any]:
        """model_dump() without the unknown fields."""
        return self.model_dump(exclude=set(self.model_extra or ()), **kwargs)


class StreamOptions(_Request):
    include_usage: bool | None = False


def _unset(v: Any) -> bool:
    return not v  # None, or the zero/false/empty value that means "off"


# Parameters raystate does not implement, accepted only at their neutral value: field -> (whether a value
# is neutral, the 400's message). One table for both endpoints (a field absent from a request's model is
# never checked); `_neutral_only` checks the value after pydantic has checked its type.
_NEUTRAL_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_unset, "suffix is not supported"),
}


MAX_SCHEMA_NAME_CHARS = 64  # response_format.json_schema.name (OpenAI's limit)


class JsonSchemaSpec(_Request):
    """response_format.json_schema: the schema the output must satisfy (`strict` is accepted; the grammar
    always holds the output to the schema)."""

    name: str = Field(max_length=MAX_SCHEMA_NAME_CHARS)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """`response_format`: plain text, any JSON object, or JSON that a JSON Schema accepts (structured
    output through a grammar: `SamplingParams.json_schema` / `json_object`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _spec(cls, v: JsonSchemaSpec | None, info: ValidationInfo) -> JsonSchemaSpec | None:
        if info.data.get("type") == "json_schema" and (v is None or v.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema (a JSON Schema)")
        return v

    def schema_text(self) -> str | None:
        """The JSON Schema as JSON text when type is json_schema, else None."""
        if self.type != "json_schema" or self.json_schema is None:
            return None
        return json.dumps(self.json_schema.schema_, separators=(",", ":"))


class StructuredOutputsSpec(_Request):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one of a JSON Schema (`json`: an object,
    or its JSON text), `regex`, `choice`, a Lark `grammar`, or `json_object`. vLLM's tuning fields
    (`disable_any_whitespace`, ...) are not read: JSON is always written without free whitespace."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICE_STRINGS)
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    temperature: float | None = Field(None, ge=0.0)  # None: 1.0, OpenAI's default
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)  # raystate extension; 0 or -1: off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] | None = None
    include_stop_str_in_output: bool | None = False  # vLLM's extension: the text keeps the stop string
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)  # choices (per prompt); None: 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # token id (a JSON string key) -> bias; ranges checked by SamplingParams.validate, naming the field
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    # raystate extensions (vLLM spells them the same way)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    return_token_ids: bool | None = False
    repetition_penalty: float | None = None  # vLLM's extensions, like the two above
    min_p: float | None = None
    min_tokens: int | None = None
    response_format: ResponseFormat | None = None  # structured output (json_object, json_schema)
    # vLLM's structured outputs: `structured_outputs` (vLLM 0.11 on) and the older `guided_*` fields; at
    # most one structured output per request, these and response_format together
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | bool | str | None = None  # a JSON Schema, or its JSON text
    guided_regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICE_STRINGS)
    guided_grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len); >= 1 or -1
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's: false writes special tokens' text into the output (None: true)
    skip_special_tokens: bool | None = None
    # vLLM's: only these ids may be sampled (checked by SamplingParams.validate, naming the field)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never to be generated (encoded by ModelText.bad_words_token_ids, which names the field)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    # vLLM's: changes nothing either way. vLLM's detokenizer for a tokenizer.json tokenizer (every
    # tokenizer raystate loads; the byte models' likewise) writes special tokens' text with no space
    # between them whatever this says; only its transformers "slow" tokenizers read it.
    spaces_between_special_tokens: bool | None = None
    # vLLM's beam search: n beams per prompt (n <= 10), scored by cumulative logprob / length ** penalty
    use_beam_search: bool | None = None
    length_penalty: float | None = Field(None, ge=-100.0, le=100.0)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
        longest = max(len(s) for s in v) if v else 0
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"stop strings of at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return v

    @field_validator(*_NEUTRAL_ONLY, check_fields=False)
    @classmethod
    def _neutral_only(cls, v: Any, info: ValidationInfo) -> Any:
        is_neutral, message = _NEUTRAL_ONLY[info.field_name]
        if not is_neutral(v):
            raise ValueError(message)
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        """`n`, None read as 1."""
        return self.n or 1


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is one text or one list of token ids, or a list of several texts or
    of several token id lists (a batch: n choices of each, indexed prompt_index * n + choice_index, as
    OpenAI does). A batch of one is that one prompt."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo (the server checks): the prompt alone
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)  # only equal to n (no ranking of extra candidates)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(_is_int(t) for t in v):
            return v
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts, got {len(v)}")
            if all(isinstance(p, str) for p in v):
                return v
            for i, p in enumerate(v):
                if not (isinstance(p, list) and p and all(_is_int(t) for t in p)):
                    raise ValueError(
                        f"a batch of prompts is all texts or all token id lists (prompt {i} is not a "
                        "non-empty list of token ids)"
                    )
            return v
        raise ValueError("must be a string or a non-empty list of token ids, or a list of either")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and v != n:
            if v > n:
                raise ValueError(f"best_of > n is not supported (best_of must equal n={n} when set)")
            raise ValueError(f"must be at least n={n}")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or more."""
        p = self.prompt
        if isinstance(p, str) or _is_int(p[0]):
            return [p]
        return list(p)


MAX_TOOLS = 128  # tools of one request (OpenAI's limit)
MAX_TOOL_CALLS = 128  # tool_calls of one assistant message
MAX_TOOL_CALL_ID_CHARS = 256
MAX_TOOL_ARGUMENTS_CHARS = 1 << 16
# A function's name: OpenAI's rule (letters, digits, underscores and dashes, at most 64).
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Request):
    """A function the model may call: its name, what it does, and its arguments' JSON Schema."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; a called function's arguments always follow the grammar


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The request's tools as a chat template reads them (transformers' `tools`): the OpenAI definitions
    with their unset fields left out."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class ToolCallFunction(_Request):
    name: str = Field(max_length=MAX_SCHEMA_NAME_CHARS)
    arguments: str = Field("", max_length=MAX_TOOL_ARGUMENTS_CHARS)  # JSON text, as the model wrote it


class MessageToolCall(_Request):
    """A call an earlier assistant turn made (sent back with the tool's answer in a later request)."""

    id: str = Field(max_length=MAX_TOOL_CALL_ID_CHARS)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    # `developer`: OpenAI's newer name for `system` (given to the chat template as it is; see ModelText)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # assistant turns
    tool_call_id: str | None = Field(None, max_length=MAX_TOOL_CALL_ID_CHARS)  # tool turns: the call answered
    # An earlier assistant turn's thinking, as a reasoning parser returned it (the template decides
    # whether to show it; transformers gives it under both names, as raystate.hf.chat_template does).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def template_fields(self) -> dict[str, Any]:
        """The message as a chat template reads it: the known fields that are set, and each tool call's
        arguments as the object they encode (templates write them with `tojson`, as transformers expects
        them; arguments that are not a JSON object stay text)."""
        message = self.known_fields(exclude_none=True)
        for call in message.get("tool_calls", ()):
            function = call["function"]
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                continue
            if isinstance(arguments, dict):
                function["arguments"] = arguments
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> str | None:
        """A string, or OpenAI content parts of which only the text ones are kept."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            if len(v) > MAX_CONTENT_PARTS:
                raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts, got {len(v)}")
            if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in v):
                raise ValueError("only text content parts are supported")
            return "".join(p["text"] for p in v)
        raise ValueError("must be a string or a list of text content parts")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions, rendered through the model's chat template (`ModelText.chat_prompt`)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # with logprobs: true only
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; absent: "auto" with
    # tools, else "none". Typed Any and checked by _tool_choice, so that an error names the field itself.
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # chat template controls (vLLM's extensions, spelt as vLLM spells them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    # A template rendered in place of the server's: taken only from a server started with
    # --trust-request-chat-template (a template runs in the replica: a costly one slows every request).
    chat_template: str | None = Field(None, max_length=MAX_CHAT_TEMPLATE_CHARS)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        function = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and re.match(FUNCTION_NAME, name):
            return {"type": "function", "function": {"name": name}}
        raise ValueError(
            'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
        )

    @property
    def tool_mode(self) -> str | tuple[str, str]:
        """The tool choice in effect: "none", "auto", "required" or ("function", name) (OpenAI's default:
        "auto" when tools are given, else "none")."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if isinstance(choice, dict):
            return ("function", choice["function"]["name"])
        return choice

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs` may set any template variable but those the renderer sets itself."""
    for key in v or ():
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise ValueError(f"{field_path((key,))!s} cannot be set through chat_template_kwargs")
    return v


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt: its ids as /v1/completions makes them (special tokens added)."""

    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request):
    """POST /tokenize with messages: the prompt ids /v1/chat/completions would run. `add_special_tokens`
    unset: as the chat route encodes (a Hugging Face template writes its own BOS; a byte model gets one);
    set: the rendered text encoded with or without the tokenizer's special tokens."""

    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    chat_template: str | None = Field(None, max_length=MAX_CHAT_TEMPLATE_CHARS)  # as the chat route's
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)  # rendered as the chat route does

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(v)


class DetokenizeRequest(_Request):
    """POST /detokenize: the text of token ids, special tokens included (as vLLM decodes them)."""

    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


# -- responses ----------------------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # the prefix-cache hit used for this request
    # raystate extension: hit tokens whose sliding-window KV was rebuilt for this request (by itself, or
    # with shared replay by a request of the same step that hit the same prefix)
    replayed_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: per token its text, logprob, top alternatives (text ->
    logprob) and character offset in the choice's text. The echoed prompt's first token has null ones."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    """One call the model made: `function.arguments` is JSON text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the turn is tool calls only
    tool_calls: list[ToolCallOut] | None = None  # absent from the JSON when None
    reasoning_content: str | None = None  # with a reasoning parser: the <think> text; absent when None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallFunctionDelta(BaseModel):
    name: str | None = None
    arguments: str = ""


class ToolCallDeltaOut(BaseModel):
    """A streamed piece of call `index`: its first piece has the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None  # absent from the JSON when None
    reasoning_content: str | None = None  # absent from the JSON when None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """A streamed completion event (OpenAI reuses the text_completion object for chunks)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "raystate"
    # vLLM's: the model behind the served name (a hub id, a checkpoint folder or a named model) and the
    # model this one derives from (none: raystate serves no adapters).
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors ---------------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None  # a name ("invalid_api_key"), or the HTTP status where vLLM sends one


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _printable(text: str, limit: int) -> str:
    """`text` as a response may carry it: lone surrogates escaped (no UTF-8 encoder takes them), at most
    `limit` characters."""
    if not _is_unicode(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """The JSON body OpenAI's clients parse into an APIError (they read `error.message` and `.param`).

    Message and param may quote what the client sent: they are made encodable and bounded here, so that
    rendering an error can never fail (a 500) or echo a megabyte back."""
    message = _printable(message, MAX_ERROR_CHARS)
    param = None if param is None else _printable(param, MAX_ERROR_CHARS)
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


def dump_response(payload: BaseModel, keep_token_ids: bool) -> dict:
    """JSON-ready dict of a response or chunk. `finish_reason: null` stays (clients read it on every chunk);
    `token_ids` appears only when the request asked for it, `usage` only when there is one."""
    data = payload.model_dump()
    for choice in data.get("choices", []):
        if not keep_token_ids or choice.get("token_ids") is None:
            choice.pop("token_ids", None)
        for part in (choice.get("message"), choice.get("delta")):
            for key in ("tool_calls", "reasoning_content"):
                if part is not None and part.get(key) is None:
                    part.pop(key, None)
            for call in (part or {}).get("tool_calls") or ():
                for key in ("id", "type"):  # a call's later pieces carry only index and arguments
                    if call.get(key) is None:
                        call.pop(key, None)
                if call["function"].get("name") is None:
                    call["function"].pop("name", None)
    if "usage" in data and data["usage"] is None:
        del data["usage"]
    return data


def field_path(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'. A name the client made up (an unknown field, a
    logit_bias key) is shown escaped and cut to MAX_PARAM_PART_CHARS; an empty one as '""'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = _printable(str(part), MAX_PARAM_PART_CHARS) if part != "" else '""'
            out += f".{name}" if out else name
    return out


def first_error(exc: ValidationError) -> tuple[str | None, str]:
    """The first invalid field's path and a message naming it."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(err.get("loc", ()))
    param = field_path(loc) or None
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field"
    elif err.get("type") == "missing":
        msg = "field required"
    return param, f"{param}: {msg}" if param else msg
