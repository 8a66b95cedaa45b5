"""Chat templates of Hugging Face checkpoints, rendered as transformers' `apply_chat_template` renders them.

Checked against transformers 5.24 (`utils/chat_template_utils.py`, `tokenization_utils_base.py`):

- Environment: jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the
  `loopcontrols` extension (`{% break %}`, `{% continue %}`) and a `{% generation %}` block tag
  (transformers marks assistant text with it for training masks; for inference its body renders as it
  is, in a scope of its own, as transformers' call block does). The `tojson` filter is plain
  `json.dumps` (no HTML escaping, non-ASCII kept; `ensure_ascii`, `indent`, `separators`, `sort_keys`
  passed through). Globals: `raise_exception(message)` (a template's way to refuse a conversation),
  `strftime_now(format)` (local time), `dict(...)` (a plain dict factory in place of the class) and
  `namespace(...)` (jinja's, refusing attribute names that start with "_").
- Inputs: each message with its None-valued keys dropped (OpenAI clients send `"tool_calls": null`);
  a message's reasoning, under `reasoning_content`, `thinking` or `reasoning`, is given under
  `reasoning_content` and `thinking` both. The template sees `messages`, `tools` (None when none are
  given), `documents`, `add_generation_prompt`, the named special tokens (`bos_token`, `eos_token`,
  ...) and any extra keyword (`enable_thinking`, ...), which wins over a special token of the same name.
- `continue_final_message` (true, or the name of the field to continue) renders with the last message
  left open: a marker is appended to the field's text and the rendered text is cut at the marker.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.utils
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from raystate.errors import InvalidRequest

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(InvalidRequest):
    """The chat template refused the conversation (its `raise_exception`) or failed on it."""

    def __init__(self, message: str) -> None:
        super().__init__("messages", "a conversation the model's chat template accepts", message)


class _GenerationBlock(Extension):
    """`{% generation %} ... {% endgeneration %}`: renders its body in a scope of its own."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without handing it the class itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing attribute names that start with "_"."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' chat template environment (cached by its text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def read_chat_template(value: str, field: str = "chat_template") -> str:
    """A chat template given by the user (vLLM's `--chat-template`): the text of the file `value` names,
    or `value` itself when it is template text (it holds `{{` or `{%`). Compiled here, so a syntax error
    is reported where the template is given, with its line, not at the first chat request."""
    from pathlib import Path

    looks_like_template = "{{" in value or "{%" in value
    path = Path(value).expanduser() if not looks_like_template and "\n" not in value else None
    if path is not None and path.is_file():
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidRequest(field, "a readable UTF-8 template file", f"{value} ({e})") from None
    elif looks_like_template:
        source = value
    else:
        raise InvalidRequest(field, "a template file or Jinja template text", f"{value} (no such file)")
    return request_chat_template(source, field, where=f"{value}, " if path is not None else "")


def request_chat_template(source: str, field: str = "chat_template", where: str = "") -> str:
    """A chat template sent in a request (vLLM's request `chat_template`): only its text, never a file of
    the server's; compiled here so a syntax error is a 400 naming the field and the line (after `where`,
    the file it came from, for `read_chat_template`)."""
    try:
        compile_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequest(field, "a Jinja template", f"{where}line {e.lineno}: {e.message}") from None
    return source


def select_chat_template(
    templates: str | Mapping[str, str] | None, name: str | None = None, has_tools: bool = False
) -> str:
    """The template to render, chosen as transformers chooses: a checkpoint with named templates uses the
    one asked for by `name`, else "tool_use" when tools are given and it has one, else "default"; a `name`
    that is no template's name is itself the template text."""
    if isinstance(templates, Mapping):
        if name is not None and name in templates:
            return templates[name]
        if name is not None:
            return name
        if has_tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise InvalidRequest(
            "chat_template", f"one of the checkpoint's named templates {sorted(templates)}", name
        )
    if name is not None:
        return name
    if templates is None:
        raise InvalidRequest("chat_template", "set (the checkpoint has no chat template)", None)
    return templates


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fresh copies of the messages as the template sees them: None-valued keys dropped, reasoning
    given under `reasoning_content` and `thinking` both."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{i}]", "an object", message)
        msg = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool | str = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    special_tokens: Mapping[str, Any] | None = None,
    **template_kwargs: Any,
) -> str:
    """One conversation rendered to the prompt text. A template's `raise_exception`, or any error while
    rendering, raises ChatTemplateError (an InvalidRequest naming `messages`)."""
    if not messages:
        raise InvalidRequest("messages", "at least one message", [])
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message", "false when add_generation_prompt is true", continue_final_message
        )
    if tools is not None:
        tools = list(tools)
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise InvalidRequest(f"tools[{i}]", "a JSON schema object", tool)
    if documents is not None:
        documents = list(documents)
        for i, doc in enumerate(documents):
            if not isinstance(doc, Mapping):
                raise InvalidRequest(f"documents[{i}]", "an object", doc)
    chat = normalize_messages(messages)
    final_text = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_text = chat[-1].get(field)
        if final_text is None:
            raise InvalidRequest(f"messages[-1].{field}", "present to continue", None)
        fields = [field]
        if field in REASONING_FIELDS:  # reasoning is given under several names: mark every copy
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final_text]
        if not any(f in source for f in fields):
            raise InvalidRequest("continue_final_message", "a field the chat template reads", field)
        if isinstance(final_text, list | tuple):
            for block in reversed(final_text):
                if isinstance(block, dict) and "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise InvalidRequest(f"messages[-1].{field}", "a message with text to continue", final_text)
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    kwargs = {**(special_tokens or {}), **template_kwargs}
    try:
        text = compile_chat_template(source).render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from None
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in text or tag not in text:
            raise ChatTemplateError("continue_final_message: the template drops the final message's text")
        loc = text.rindex(tag)
        # a template that keeps the message as it is keeps the tag's trailing space too; one that strips
        # the message loses it, and the text before the tag is stripped likewise
        text = text[:loc] if text[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:loc].rstrip()
    return text
