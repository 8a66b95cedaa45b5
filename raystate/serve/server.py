"""RaystateServer: the OpenAI endpoints as plain async methods around an injected `Client`.

No HTTP and no Ray Serve here (ingress.py maps routes onto these methods; app.py makes the deployment), so
the same server runs over the Ray backend in a Serve replica, over `InProcessClient` in a test, or behind any
other front end. It turns OpenAI requests into token ids and `SamplingParams`, streams `RequestUpdate`s
back as text, and records latency metrics.

A request of n choices (and a completions prompt list) runs as one engine request per choice, all
submitted in one `Client.generate_group` call (the later choices of a prompt are forked from its first);
choice i of prompt p has index p * n + i. A streamed response interleaves the choices' chunks as their
tokens come (`merged_deltas`), each chunk one choice, each choice ending with its own finish_reason, then
one usage chunk if asked for and one `data: [DONE]`; usage counts each prompt once and every choice's
output.

Every request is validated before anything is queued: field errors raise `InvalidRequest` named after the
OpenAI field (`prompt`, `messages[0].role`, `max_tokens`), never after an internal one. A request whose
consumer goes away (a disconnected stream, a matched stop string) is aborted at once, so its KV blocks go
back to the pool without waiting for max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from raystate.beam_search import BeamSearch, BeamSearchBatch, check_beam_width, ranked_alternatives
from raystate.client import Client
from raystate.errors import EngineDead, InvalidRequest, RequestFailed
from raystate.fanout import ChildRequest
from raystate.grammar import check_grammar, check_schema
from raystate.messages import MAX_JSON_SCHEMA_CHARS, SamplingParams, unpack_logprobs
from raystate.serve import tool_calls
from raystate.serve.generation import (
    EventStream,
    Generation,
    Prepared,
    PromptPart,
    close_all,
    merged_deltas,
    total_usage,
)
from raystate.serve.metrics import ServeMetrics
from raystate.serve.protocol import (
    MAX_CHOICES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCallOut,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    ToolCallDeltaOut,
    ToolCallFunctionDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
    VersionResponse,
    dump_response,
    error_body,
    template_tools,
)
from raystate.serve.reasoning import REASONING_PARSERS, ThinkStream, prompt_opens_thinking
from raystate.serve.responses import ResponsesRequest, ResponseWriter, renamed, to_chat
from raystate.serve.text import ModelText, model_text_for_config
from raystate.serve.turns import TurnSplitter

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 60.0
DRAIN_CUT_MARGIN_S = 5.0  # after the cut, time for the cut streams to send their last events


class ServerShuttingDown(Exception):
    """A request still running when the drain's grace period ended (the ingress answers 503)."""


class ModelNotFound(InvalidRequest):
    """A request naming a model this server does not serve (the ingress answers 404, as vLLM does)."""

    def __init__(self, model: str, served: str) -> None:
        super().__init__("model", f"'{served}' (see GET /v1/models)", model)
        self.args = (f"The model `{model}` does not exist (this server serves '{served}').",)


def _sse(payload: BaseModel, keep_token_ids: bool) -> str:
    data = dump_response(payload, keep_token_ids)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _stream_error_body(exc: BaseException) -> dict:
    """The error body of a stream that failed after its headers were sent."""
    if isinstance(exc, InvalidRequest):
        return error_body(str(exc), "invalid_request_error", exc.field)
    if isinstance(exc, RequestFailed):  # our own one-line reason (no traceback, no paths)
        return error_body(f"the request failed: {exc}", "internal_error")
    # EngineDead may carry the scheduler actor's traceback: it goes to the log, not to the client
    logger.warning("stream failed: %s", exc, exc_info=not isinstance(exc, EngineDead))
    return error_body(f"generation failed: {type(exc).__name__}", "internal_error")


def _stream_error(exc: BaseException) -> str:
    return f"data: {json.dumps(_stream_error_body(exc))}\n\n"


@dataclass(frozen=True)
class _Shape:
    """How one endpoint words its answer: the response and chunk models, and a choice of each from
    (index, text, finish_reason, token_ids, logprobs). The two endpoints differ in nothing else."""

    response: type[BaseModel]
    chunk: type[BaseModel]
    choice: Callable[[int, str, str | None, list[int] | None, Any], BaseModel]
    delta: Callable[[int, str, str | None, list[int] | None, Any], BaseModel]
    opening: Callable[[int], BaseModel] | None = None  # a stream's first choice i, before any token


def _check_beam_search(req: CompletionRequest | ChatCompletionRequest, prep: Prepared) -> None:
    """The fields a beam search cannot honour, refused by name (each step is one token of one beam)."""
    check_beam_width(prep.n, "n")
    p = prep.sampling
    asked = [
        ("stream", bool(req.stream)),
        ("logprobs", p.logprobs is not None),
        ("prompt_logprobs", p.prompt_logprobs is not None),
        ("echo", bool(getattr(req, "echo", False))),
        ("stop", bool(req.stop)),
        ("stop_token_ids", bool(p.stop_token_ids)),
        ("presence_penalty", bool(p.presence_penalty)),
        ("frequency_penalty", bool(p.frequency_penalty)),
        ("min_tokens", bool(p.min_tokens)),
        ("bad_words", bool(p.bad_words_token_ids)),
        ("max_tokens", prep.prompt_only),
    ]
    sources = _structured_sources(req)
    asked += [(name, True) for name, _ in sources]
    if p.structured and not sources:
        asked.append(("tool_choice", True))  # a forced call: through the grammar
    for name, used in asked:
        if used:
            raise InvalidRequest(
                name, "unset with use_beam_search (each step is one token of one beam)", "set"
            )


def _structured_sources(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    """Each structured output the request asks for, as (the field that asks, SamplingParams fields):
    response_format, vLLM's `structured_outputs.*` and its older `guided_*` fields."""
    out: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        out.append(("response_format.json_schema.schema", {"json_schema": fmt.schema_text()}))
    spec = req.structured_outputs
    vllm_fields = [
        ("guided_json", req.guided_json, "json_schema"),
        ("guided_regex", req.guided_regex, "regex"),
        ("guided_choice", req.guided_choice, "choice"),
        ("guided_grammar", req.guided_grammar, "grammar"),
    ]
    if spec is not None:
        vllm_fields += [
            ("structured_outputs.json", spec.json_, "json_schema"),
            ("structured_outputs.regex", spec.regex, "regex"),
            ("structured_outputs.choice", spec.choice, "choice"),
            ("structured_outputs.grammar", spec.grammar, "grammar"),
            ("structured_outputs.json_object", spec.json_object or None, "json_object"),
        ]
    for where, value, ours in vllm_fields:
        if value is None:
            continue
        if ours == "json_schema" and not isinstance(value, str):
            value = json.dumps(value, separators=(",", ":"))
        out.append((where, {ours: value}))
    return out


_STRUCTURED_LIMITS = {
    "json_schema": "a JSON Schema the grammar supports",
    "regex": "a regular expression the grammar supports (Rust regex syntax)",
    "choice": "strings the grammar can hold the output to",
    "grammar": "a Lark grammar (llguidance's dialect) with a start rule",
}


def _structured(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The request's structured output as SamplingParams fields (at most one may be asked for); one the
    grammar library refuses is a 400 naming the field that asked for it."""
    sources = _structured_sources(req)
    if not sources:
        return {}
    if len(sources) > 1:
        raise InvalidRequest(
            sources[1][0], f"unset when {sources[0][0]} is set (one structured output per request)", "set"
        )
    where, fields = sources[0]
    if fields.get("json_object"):
        return fields
    try:
        params = SamplingParams(**fields)
        params.validate(vocab_size=1)  # the structured fields' own checks (no token ids involved)
    except InvalidRequest as e:
        raise InvalidRequest(where, e.limit, e.got) from None
    (kind,) = fields
    why = check_schema(fields[kind]) if kind == "json_schema" else check_grammar(params)
    if why is not None:
        raise InvalidRequest(where, _STRUCTURED_LIMITS[kind], why)
    return fields


def _tool_call_deltas(deltas: list[tool_calls.ToolCallDelta]) -> list[ToolCallDeltaOut] | None:
    out = [
        ToolCallDeltaOut(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=ToolCallFunctionDelta(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]
    return out or None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON string keys) as SamplingParams takes it; the ranges are
    SamplingParams.validate's."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        k = key.strip()
        if not (k.isdecimal() and k.isascii()) or len(k) > 10:
            raise InvalidRequest("logit_bias", "keys that are token ids (decimal integers)", key[:32])
        out[int(k)] = value
    return out


def _completion_choice(
    index: int,
    text: str,
    reason: str | None,
    ids: list[int] | None,
    logprobs: CompletionLogprobs | None = None,
) -> CompletionChoice:
    return CompletionChoice(index=index, text=text, finish_reason=reason, token_ids=ids, logprobs=logprobs)


def _logprob_rows(blob: bytes) -> list[tuple[list[int], list[float]]]:
    """Wire records as (ids, logprobs) per token: the token's own first, then its alternatives."""
    ids, lps, _ = unpack_logprobs(blob)
    return list(zip(ids.tolist(), lps.tolist(), strict=True))


_COMPLETIONS = _Shape(
    CompletionResponse, CompletionChunk, choice=_completion_choice, delta=_completion_choice
)
_CHAT = _Shape(
    ChatCompletionResponse,
    ChatCompletionChunk,
    choice=lambda index, text, reason, ids, logprobs=None, tool_calls=None, reasoning=None: ChatChoice(
        index=index,
        message=AssistantMessage(content=text, tool_calls=tool_calls, reasoning_content=reasoning),
        finish_reason=reason,
        token_ids=ids,
        logprobs=logprobs,
    ),
    delta=lambda index, text, reason, ids, logprobs=None, tool_calls=None, reasoning=None: ChatChunkChoice(
        index=index,
        delta=ChatDelta(content=text, tool_calls=tool_calls, reasoning_content=reasoning),
        finish_reason=reason,
        token_ids=ids,
        logprobs=logprobs,
    ),
    opening=lambda index: ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")),
)


class RaystateServer:
    """The OpenAI endpoints over one `Client`. Methods return response models, or for `stream=True` an
    `EventStream` of server-sent-event strings (`data: {...}\\n\\n`, ending with `data: [DONE]`) that the
    caller must `aclose()` when done with it."""

    def __init__(
        self,
        client: Client,
        model_name: str | None = None,
        metrics: ServeMetrics | None = None,
        text: ModelText | None = None,
        tool_call_parser: str | None = "auto",
        reasoning_parser: str | None = None,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        """`model_name`: the id clients send as `model` and responses carry (default: the model's name).
        `text`: the model's tokenizer and generation defaults (default: those of the model
        `client.config` runs, `model_text_for_config`). `tool_call_parser`: how the model's free text
        writes tool calls, for tool_choice "auto" (`raystate.serve.tool_calls.TOOL_CALL_PARSERS`); "auto":
        the format its chat template writes, if raystate knows it; None: tool_choice "auto" is refused.
        `reasoning_parser` (`raystate.serve.reasoning.REASONING_PARSERS`): the model's `<think>` text goes
        to `reasoning_content`; None: it stays in the content. `chat_template`: template text rendered in
        place of the checkpoint's (`raystate.hf.chat_template.read_chat_template` reads a user's).
        `trust_request_chat_template`: a chat request's own `chat_template` is rendered in place of the
        server's (else such a request is a 400: a template is code that runs here). Tool calls in free
        text are still read in the format of the server's template (`tool_call_parser`)."""
        self.client = client
        config = client.config
        self.model_name = model_name or config.model.name
        self.vocab_size = config.model.vocab_size
        self.max_model_len = config.max_model_len  # the checkpoint's (or the max_model_len knob's)
        # /v1/models' root: the hub id (without its commit), else the checkpoint folder, else the model name
        hub = getattr(config, "model_hub", None)
        folder = getattr(config, "model_path", None)
        self.model_root = hub.rsplit("@", 1)[0] if hub else folder or config.model.name
        text = text if text is not None else model_text_for_config(config, self.model_name)
        self.text = text.with_chat_template(chat_template)
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = self.text.tokenizer
        # generation_config.json's sampling fields, for requests that leave them out
        self.sampling_defaults = self.text.sampling_defaults()
        if tool_call_parser == "auto":
            tool_call_parser = tool_calls.parser_for_template(self.text.chat_template_source())
        elif tool_call_parser is not None and tool_call_parser not in tool_calls.TOOL_CALL_PARSERS:
            raise InvalidRequest(
                "tool_call_parser",
                f"auto or one of {', '.join(tool_calls.TOOL_CALL_PARSERS)}",
                tool_call_parser,
            )
        self.tool_call_parser = tool_call_parser
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise InvalidRequest(
                "reasoning_parser", f"one of {', '.join(REASONING_PARSERS)}", reasoning_parser
            )
        self.reasoning_parser = reasoning_parser
        self.metrics = metrics or ServeMetrics()
        self.metrics.model_name = self.metrics.model_name or self.model_name  # vLLM series' label
        self._aborts: set[asyncio.Task] = set()
        # Shutdown drain (see `drain`): requests in progress, and the event loop time of the cut.
        self._in_flight = 0
        self._grace_s: float | None = None
        self._cut_at: float | None = None
        self._cut_scopes: set[asyncio.Timeout] = set()

    # -- request preparation --------------------------------------------------------------------------

    def _encode(self, text: str, field: str) -> list[int]:
        """The text's tokens, with the special tokens the tokenizer adds (BOS); text the tokenizer refuses
        (a lone surrogate) is a 400 naming `field`. The ingress refuses such text before this (load_body);
        this keeps other front ends safe too."""
        try:
            return self.text.encode(text)
        except InvalidRequest as e:
            raise InvalidRequest(field, e.limit, e.got) from None

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise ModelNotFound(model, self.model_name)

    def _chat_prompt(
        self,
        req: ChatCompletionRequest | TokenizeChatRequest,
        add_special_tokens: bool | None = None,
    ) -> tuple[str, list[int]]:
        """The conversation's prompt (text, ids) through the model's chat template (ModelText.chat_prompt),
        with the request's template controls; the tokenizer's errors named after `messages`."""
        messages = [m.template_fields() for m in req.messages]
        if not self.text.is_hf:
            for m in messages:
                m.setdefault("content", None)
        tools = None
        # tool_choice "none": the model is not shown the tools (/tokenize has no tool_choice: shown)
        if req.tools and getattr(req, "tool_mode", "auto") != "none":
            tools = template_tools(req.tools)
        model_text = self.text
        if req.chat_template is not None:
            if not self.trust_request_chat_template:
                raise InvalidRequest(
                    "chat_template",
                    "unset: this server renders its own chat template (start it with "
                    "--trust-request-chat-template to take one from requests)",
                    f"{len(req.chat_template)} characters",
                )
            from raystate.hf.chat_template import request_chat_template

            model_text = model_text.with_chat_template(request_chat_template(req.chat_template))
        try:
            text, ids = model_text.chat_prompt(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
                add_special_tokens=add_special_tokens,
                tools=tools,
            )
        except InvalidRequest as e:
            if e.field in ("messages", "chat_template", "continue_final_message") or e.field.startswith(
                "messages["
            ):
                raise
            raise InvalidRequest("messages", e.limit, e.got) from None  # the tokenizer's "text"
        return text, ids

    def _sampling(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        n_prompt: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        structured: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Where a field is absent: the checkpoint's generation_config.json value if it sets one, else
        OpenAI's default (temperature 1, top_p 1, top_k off). max_tokens: what fits, or less where the
        checkpoint sets max_new_tokens. A request's own values always win."""
        defaults = self.sampling_defaults
        room = max(1, self.max_model_len - n_prompt)
        if max_tokens is None:
            max_tokens = min(room, defaults.get("max_tokens", room))
        temperature = req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)
        top_k = req.top_k if req.top_k is not None else defaults.get("top_k", 0)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=(
                req.repetition_penalty
                if req.repetition_penalty is not None
                else defaults.get("repetition_penalty", 1.0)
            ),
            logit_bias=_logit_bias(req.logit_bias),
            min_p=req.min_p if req.min_p is not None else defaults.get("min_p", 0.0),
            min_tokens=req.min_tokens or 0,
            allowed_token_ids=req.allowed_token_ids,
            bad_words_token_ids=self.text.bad_words_token_ids(req.bad_words) if req.bad_words else None,
            **(structured if structured is not None else _structured(req)),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=req.num_choices,
        )
        params.validate(self.vocab_size)
        if n_prompt + params.max_tokens > self.max_model_len:
            room = self.max_model_len - n_prompt
            limit = f"<= {room} (max_model_len={self.max_model_len}; the prompt has {n_prompt} tokens)"
            raise InvalidRequest("max_tokens", limit, params.max_tokens)
        return params

    def _truncate(self, ids: list[int], k: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the last max_model_len)."""
        if k is None:
            return ids
        if k == 0 or k > self.max_model_len:
            limit = f"-1 or an integer in [1, max_model_len={self.max_model_len}]"
            raise InvalidRequest("truncate_prompt_tokens", limit, k)
        k = self.max_model_len if k == -1 else k
        return ids[-k:]

    def _prepare_completion(self, req: CompletionRequest) -> Prepared:
        self._check_model(req.model)
        prompts, n = req.prompts, req.num_choices
        if n * len(prompts) > MAX_CHOICES:  # before any prompt is encoded
            p = len(prompts)
            limit = f"at most {MAX_CHOICES // p} with {p} prompts (at most {MAX_CHOICES} choices in all)"
            raise InvalidRequest("n", limit, n)
        # max_tokens 0 with echo: the prompt (and its logprobs) alone, lm-eval's loglikelihood call. The
        # engine runs one token, which is dropped.
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise InvalidRequest("max_tokens", "at least 1 (0 only with echo: the prompt alone)", 0)
        k = req.logprobs
        parts = []
        for i, prompt in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = self._encode(prompt, name)
            else:
                ids = list(prompt)
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise InvalidRequest(name, f"token ids in [0, {self.vocab_size})", bad[0])
            whole = len(ids)
            ids = self._truncate(ids, req.truncate_prompt_tokens)
            if len(ids) >= self.max_model_len:
                raise InvalidRequest(
                    name, f"shorter than max_model_len={self.max_model_len} tokens", len(ids)
                )
            echo_text = None
            if req.echo:
                echo_text = prompt if isinstance(prompt, str) and len(ids) == whole else self.text.decode(ids)
            sampling = self._sampling(
                req,
                1 if prompt_only else req.max_tokens,
                len(ids),
                logprobs=k,
                prompt_logprobs=k if req.echo else None,
            )
            parts.append(PromptPart(ids, sampling, echo_text))
        return Prepared(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            endpoint="completions",
            prompts=parts,
            stop=req.stop,
            include_stop=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False,
            return_token_ids=bool(req.return_token_ids),
            include_usage=req.include_usage,
            prompt_only=prompt_only,
        )

    def _prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self._check_model(req.model)
        prompt_text, ids = self._chat_prompt(req)
        ids = self._truncate(ids, req.truncate_prompt_tokens)
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                "messages", f"shorter than max_model_len={self.max_model_len} tokens", len(ids)
            )
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.max_tokens is not None and req.max_tokens != req.output_limit:
            raise InvalidRequest(
                "max_completion_tokens", f"equal to max_tokens={req.max_tokens}", req.output_limit
            )
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs", "set only with logprobs: true", req.top_logprobs)
        structured, tool_stream = self._tool_calling(req)
        try:
            sampling = self._sampling(
                req,
                req.output_limit,
                len(ids),
                logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                structured=structured,
            )
        except InvalidRequest as e:
            if e.field != "max_tokens":
                raise
            raise InvalidRequest(max_field, e.limit, e.got) from None
        return Prepared(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            endpoint="chat",
            prompts=[PromptPart(ids, sampling)],
            stop=req.stop,
            include_stop=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False,
            return_token_ids=bool(req.return_token_ids),
            include_usage=req.include_usage,
            tool_stream=tool_stream,
            reasoning_stream=self._reasoning_stream(prompt_text),
        )

    def _reasoning_stream(self, prompt_text: str) -> Callable[[], ThinkStream] | None:
        """The factory of each choice's ThinkStream, with the server's reasoning parser; None without one."""
        if self.reasoning_parser is None:
            return None
        inside = prompt_opens_thinking(prompt_text)
        return lambda: ThinkStream(starts_inside=inside)

    def _tool_calling(self, req: ChatCompletionRequest) -> tuple[dict[str, Any] | None, Callable | None]:
        """(the structured output that holds the model to a call, or None; the factory of each choice's
        ToolCallStream, or None) for the request's tool_choice. A forced call ("required", a named
        function) is generated through the grammar: the named function's arguments, or an array of
        {name, parameters} objects; "auto" lets the model write calls in its own format, which the
        server's tool_call_parser reads."""
        mode = req.tool_mode
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools or ()]
        if mode == "none" or (mode == "auto" and not functions):
            return None, None
        if not functions:
            raise InvalidRequest(
                "tool_choice", "'none' or 'auto' when the request has no tools", req.tool_choice
            )
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidRequest("tools", "functions of distinct names", dup)
        if mode == "auto":
            if self.tool_call_parser is None:
                raise InvalidRequest(
                    "tool_choice",
                    "'none', 'required' or a named function: this model's chat template writes tool calls in "
                    "no format raystate reads (start the server with --tool-call-parser to name one)",
                    "auto",
                )
            parser = self.tool_call_parser
            return None, lambda: tool_calls.make_stream(mode, functions, parser)
        asked = _structured_sources(req)
        if asked:
            raise InvalidRequest(asked[0][0], "unset when tool_choice forces a call", "set")
        if isinstance(mode, tuple):
            if mode[1] not in names:
                raise InvalidRequest(
                    "tool_choice.function.name", f"the name of one of the tools ({', '.join(names)})", mode[1]
                )
            i = names.index(mode[1])
            schema, where = tool_calls.named_schema(functions[i]), f"tools[{i}].function.parameters"
        else:
            schema = tool_calls.required_schema(functions, parallel=req.parallel_tool_calls is not False)
            where = "tools"
        text = json.dumps(schema, separators=(",", ":"))
        if len(text) > MAX_JSON_SCHEMA_CHARS:
            raise InvalidRequest(where, f"schemas of at most {MAX_JSON_SCHEMA_CHARS} characters", len(text))
        why = check_schema(text)
        if why is not None:
            raise InvalidRequest(where, "JSON Schemas the grammar supports", why)
        return {"json_schema": text}, lambda: tool_calls.make_stream(mode, functions, None)

    async def _start(self, prep: Prepared) -> list[Generation]:
        """Submits every choice of every prompt in one `generate_group` call (so that a prompt's later
        choices are forked from its first) and waits for each one's first update, so that a request the
        backend refuses fails before any response. The generations, in index order."""
        children = prep.child_requests()
        async with self._until_cut():  # a request still queued at the drain's cut is cut too
            try:
                streams = await self.client.generate_group(children)
            except InvalidRequest as e:  # the backend's own checks, renamed to the OpenAI field
                if e.field == "prompt_token_ids":
                    raise InvalidRequest(
                        "prompt" if prep.endpoint == "completions" else "messages", e.limit, e.got
                    ) from None
                raise
            gens = [
                Generation(
                    self.client,
                    prep,
                    self.metrics,
                    self._aborts,
                    c,
                    u,
                    self.text.text_stream(prep.stop, prep.include_stop, prep.skip_special_tokens),
                )
                for c, u in zip(children, streams, strict=True)
            ]
            if len(gens) == 1:
                await gens[0].start()  # closes it on failure
                return gens
            starts = [asyncio.ensure_future(g.start()) for g in gens]
            try:
                await asyncio.gather(*starts)
            except BaseException:
                for t in starts:
                    t.cancel()
                try:
                    await close_all(gens)  # also those whose start never ran: their requests are aborted
                finally:
                    await asyncio.gather(*starts, return_exceptions=True)
                raise
        return gens

    # -- endpoints ------------------------------------------------------------------------------------

    async def completion(self, req: CompletionRequest) -> CompletionResponse | EventStream:
        prep = self._prepare_completion(req)
        if req.use_beam_search:
            return await self._beam_search(req, prep, _COMPLETIONS)
        return await self._respond(prep, req.stream, _COMPLETIONS)

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        prep = self._prepare_chat(req)
        if req.use_beam_search:
            return await self._beam_search(req, prep, _CHAT)
        return await self._respond(prep, req.stream, _CHAT)

    async def _beam_search(
        self, req: CompletionRequest | ChatCompletionRequest, prep: Prepared, shape: _Shape
    ) -> BaseModel:
        """vLLM's use_beam_search: each prompt's n best beams (`raystate.beam_search`) as its n choices.
        Every step submits one greedy token of each live beam of every prompt, with 2n logprobs; the
        request's logit_bias, allowed_token_ids and repetition_penalty apply to those steps. What a beam
        cannot honour (a stream, stop strings and ids, output-count penalties, min_tokens, bad_words,
        logprobs, echo, structured output) is a 400 naming the field."""
        _check_beam_search(req, prep)
        sampling = prep.sampling
        width = sampling.n
        eos = frozenset(getattr(self.client.config.model, "eos_token_ids", ()))
        penalty = req.length_penalty if req.length_penalty is not None else 1.0
        searches = [
            BeamSearch(part.ids, width, part.sampling.max_tokens, eos, sampling.ignore_eos, penalty)
            for part in prep.prompts
        ]
        k = 2 * width
        step = msgspec.structs.replace(
            sampling, max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, n=1,
            logprobs=k, ignore_eos=True,
        )  # fmt: skip
        batch = BeamSearchBatch(searches)
        async with self._until_cut():
            for n_step in itertools.count():
                flat = batch.pending()
                if not flat:
                    break
                records = await self._one_token_each(f"{prep.request_id}-beam{n_step}", flat, step)
                batch.advance([ranked_alternatives(*r, k) for r in records])
        choices, completion = [], 0
        for p, search in enumerate(searches):
            for i, beam in enumerate(search.best()):
                out = beam.output_ids
                completion += len(out)
                shown = beam.text_ids(keep_eos=prep.include_stop)
                text = self.text.decode(shown, skip_special_tokens=prep.skip_special_tokens)
                ids = out if prep.return_token_ids else None
                choices.append(self._choice(prep, shape, p * width + i, text, beam.finish_reason, ids, None))
        prompt = sum(len(part.ids) for part in prep.prompts)
        usage = Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=0, replayed_tokens=0),
        )
        return shape.response(
            id=prep.request_id, created=prep.created, model=self.model_name, choices=choices, usage=usage
        )

    async def _one_token_each(
        self, base_id: str, prompts: list[list[int]], step: SamplingParams
    ) -> list[tuple[list[int], list[float]]]:
        """One engine request of `step` (one token, with logprobs) per prompt, all submitted at once;
        each one's logprob record as (ids, logprobs). A failure aborts the ones still running."""
        children = [ChildRequest(f"{base_id}-{j}", ids, step, None, j) for j, ids in enumerate(prompts)]
        streams = await self.client.generate_group(children)
        records: list[tuple[list[int], list[float]]] = []
        try:
            for stream in streams:
                blob = b""
                async for u in stream:
                    if u.finish_reason == "error":
                        raise RequestFailed(u.error or "a beam search step failed")
                    blob += u.logprobs
                    if u.finished:
                        break
                ids, logprobs, _ = unpack_logprobs(blob)
                if not len(ids):
                    raise RequestFailed("a beam search step returned no token")
                records.append((ids[0].tolist(), logprobs[0].tolist()))
        except BaseException:
            for c in children[len(records) :]:
                with contextlib.suppress(Exception):
                    await self.client.abort(c.req_id)
            raise
        return records

    async def responses(self, req: ResponsesRequest) -> dict[str, Any] | EventStream:
        """OpenAI's Responses API: the request run as a chat (`raystate.serve.responses`), its answer
        written as output items; an error names the Responses field."""
        chat, rename = to_chat(req)
        try:
            prep = self._prepare_chat(chat)
            prep.request_id = f"resp_{uuid.uuid4().hex}"
            gens = await self._start(prep)
        except InvalidRequest as e:
            raise renamed(e, rename) from None
        writer = ResponseWriter(
            req, prep.request_id, self.model_name, prep.created, prep.sampling, req.stream
        )
        if req.stream:
            events = self._response_events(gens, prep, writer, catch=True)
            cut = lambda why: writer.fail(why, "server_shutting_down")  # noqa: E731
            return EventStream(self._cuttable(events, cut), gens)
        events = self._response_events(gens, prep, writer, catch=False)  # an error: the route's answer
        try:
            async with self._until_cut():
                async for _ in events:
                    pass
        finally:
            await events.aclose()
            await close_all(gens)
        return writer.response()

    async def _response_events(
        self, gens: list[Generation], prep: Prepared, writer: ResponseWriter, catch: bool
    ) -> AsyncIterator[str]:
        """A response's events, from response.created to its end; with `catch`, a generation that fails
        ends them with response.failed (a stream whose headers are sent), else its error is raised."""
        split = TurnSplitter(prep.reasoning_stream, prep.tool_stream)
        for event in writer.start():
            yield event
        reason = None
        try:
            async with contextlib.aclosing(merged_deltas(gens)) as deltas:
                async for gen, d in deltas:
                    reason = d.finish_reason or reason
                    logprobs = None
                    if prep.sampling.logprobs is not None:  # (include's message.output_text.logprobs)
                        chat, _ = self._logprobs(prep, gen, d.token_ids, d.logprobs, b"", False, 0)
                        logprobs = [entry.model_dump() for entry in chat.content]
                    pieces = split.feed(d.text, d.finish_reason is not None)
                    for event in writer.feed(*pieces, logprobs):
                        yield event
        except Exception as e:
            if not catch:
                raise
            for event in writer.fail(_stream_error_body(e)["error"]["message"]):
                yield event
            return
        for event in writer.finish(reason, total_usage(gens)):
            yield event

    async def _respond(self, prep: Prepared, stream: bool | None, shape: _Shape) -> BaseModel | EventStream:
        """Starts the request, then answers with the whole response or with its event stream."""
        gens = await self._start(prep)
        if stream:
            return EventStream(self._cuttable(self._stream(gens, prep, shape)), gens)
        try:
            await self._run_to_end(gens)
        finally:
            await close_all(gens)  # (merged_deltas closed them already; this covers a cut before it ran)
        choices = []
        for gen in gens:  # in index order
            text, reason, out_ids = gen.text, gen.finish_reason, gen.token_ids
            if prep.prompt_only:
                text, reason, out_ids = "", "length", []
            echo = self._echo_text(prep, gen)
            if echo is not None:
                text = echo + text
            logprobs = None
            if prep.sampling.logprobs is not None:
                logprobs, _ = self._logprobs(
                    prep, gen, out_ids, bytes(gen.logprobs), gen.prompt_logprobs, True, 0
                )
            ids = gen.token_ids if prep.return_token_ids else None
            choices.append(self._choice(prep, shape, gen.index, text, reason, ids, logprobs))
        return shape.response(
            id=prep.request_id,
            created=prep.created,
            model=self.model_name,
            choices=choices,
            usage=total_usage(gens),
        )

    @staticmethod
    def _choice(
        prep: Prepared,
        shape: _Shape,
        index: int,
        text: str,
        reason: str | None,
        ids: list[int] | None,
        logprobs: BaseModel | None,
    ) -> BaseModel:
        """One choice of a whole (not streamed) response: its text split into reasoning, content and tool
        calls where the request has a reasoning parser or tools."""
        if prep.tool_stream is None and prep.reasoning_stream is None:
            return shape.choice(index, text, reason, ids, logprobs)
        split = TurnSplitter(prep.reasoning_stream, prep.tool_stream)
        thinking, content, _ = split.feed(text, True)
        thinking = thinking or None
        if split.calls is None:
            return shape.choice(index, content, reason, ids, logprobs, reasoning=thinking)
        made = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in split.calls.calls
        ]
        if (made or not split.calls.writes_content) and not content.strip():
            content = None  # a turn of calls only: content null, as OpenAI sends it
        reason = tool_calls.finish_reason(split.calls, reason)
        return shape.choice(
            index, content, reason, ids, logprobs, tool_calls=made or None, reasoning=thinking
        )

    @staticmethod
    def _echo_text(prep: Prepared, gen: Generation) -> str | None:
        """The echoed prompt text of the choice's prompt (None: no echo)."""
        return prep.prompts[gen.index // prep.n].echo_text

    async def _stream(self, gens: list[Generation], prep: Prepared, shape: _Shape) -> AsyncIterator[str]:
        head = dict(id=prep.request_id, created=prep.created, model=self.model_name)
        try:
            if shape.opening is not None:
                for gen in gens:
                    yield _sse(shape.chunk(**head, choices=[shape.opening(gen.index)]), False)
            offsets: dict[int, int] = {}  # per choice index: text offset after its chunks so far (logprobs)
            # per choice index, with a reasoning parser or tools: what splits its text
            splitters: dict[int, TurnSplitter] = {}
            async with contextlib.aclosing(merged_deltas(gens)) as deltas:
                async for gen, d in deltas:
                    text, reason, out_ids = d.text, d.finish_reason, d.token_ids
                    if prep.prompt_only:
                        text, reason, out_ids = "", "length" if reason else None, []
                    first = gen.index not in offsets
                    echo = self._echo_text(prep, gen) if first else None
                    if echo is not None:
                        text = echo + text
                    logprobs = None
                    offset = offsets.get(gen.index, 0)
                    if prep.sampling.logprobs is not None:
                        logprobs, offset = self._logprobs(
                            prep, gen, out_ids, d.logprobs, d.prompt_logprobs, first, offset
                        )
                    offsets[gen.index] = offset
                    if prep.tool_stream is None and prep.reasoning_stream is None:  # (completions too)
                        choice = shape.delta(gen.index, text, reason, d.token_ids, logprobs)
                    else:
                        split = splitters.get(gen.index)
                        if split is None:
                            split = splitters[gen.index] = TurnSplitter(
                                prep.reasoning_stream, prep.tool_stream
                            )
                        thinking, text, made = split.feed(text, reason is not None)
                        thinking = thinking or None
                        calls = _tool_call_deltas(made)
                        if split.calls is not None and reason is not None:
                            reason = tool_calls.finish_reason(split.calls, reason)
                        content = None if (calls or thinking) and not text else text
                        choice = shape.delta(
                            gen.index,
                            content,
                            reason,
                            d.token_ids,
                            logprobs,
                            tool_calls=calls,
                            reasoning=thinking,
                        )
                    yield _sse(shape.chunk(**head, choices=[choice]), prep.return_token_ids)
        except Exception as e:  # the headers are sent: an error event, never a cut connection
            yield _stream_error(e)
            yield SSE_DONE  # as vLLM does: a client reading to [DONE] is never left waiting
            return
        if prep.include_usage:
            yield _sse(shape.chunk(**head, choices=[], usage=total_usage(gens)), False)
        yield SSE_DONE

    def _token_text(self, token_id: int) -> str:
        return self.text.decode([token_id], skip_special_tokens=False)

    def _logprobs(
        self,
        prep: Prepared,
        gen: Generation,
        ids: list[int],
        blob: bytes,
        prompt_blob: bytes,
        first: bool,
        offset: int,
    ) -> tuple[BaseModel, int]:
        """The endpoint's logprobs object for choice `gen`'s output tokens `ids` (records `blob`), with,
        for an echoed completion's first chunk, the prompt's tokens first (records `prompt_blob`; the
        first token has none); and the text offset after them (completions' text_offset runs on across
        chunks)."""
        rows = _logprob_rows(blob)
        if prep.endpoint == "chat":
            content = []
            for tid, (rids, rlps) in zip(ids, rows, strict=False):
                tok = self._token_text(tid)
                tops = []
                for i, lp in zip(rids[1:], rlps[1:], strict=True):
                    t = self._token_text(i)
                    tops.append(TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))))
                content.append(
                    ChatTokenLogprob(
                        token=tok, logprob=rlps[0], bytes=list(tok.encode("utf-8")), top_logprobs=tops
                    )
                )
            return ChatLogprobs(content=content), offset
        entries: list[tuple[int, tuple[list[int], list[float]] | None]] = []
        if first and self._echo_text(prep, gen) is not None:
            prompt = gen.prompt_ids
            entries.append((prompt[0], None))
            entries += zip(prompt[1:], _logprob_rows(prompt_blob), strict=False)
        entries += zip(ids, rows, strict=False)
        out = CompletionLogprobs()
        for tid, row in entries:
            tok = self._token_text(tid)
            out.tokens.append(tok)
            out.text_offset.append(offset)
            offset += len(tok)
            if row is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            rids, rlps = row
            out.token_logprobs.append(rlps[0])
            top: dict[str, float] = {}
            for i, lp in zip(rids, rlps, strict=True):
                top.setdefault(self._token_text(i), lp)
            out.top_logprobs.append(top)
        return out, offset

    def models(self) -> ModelList:
        card = ModelCard(id=self.model_name, root=self.model_root, max_model_len=self.max_model_len)
        return ModelList(data=[card])

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's ids as /v1/completions makes them (`add_special_tokens`, default
        true), or a conversation's as /v1/chat/completions renders and encodes it."""
        self._check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            _, ids = self._chat_prompt(req, req.add_special_tokens)
        else:
            try:
                ids = self.text.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            except InvalidRequest as e:
                raise InvalidRequest("prompt", e.limit, e.got) from None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: the text of the ids, special tokens included."""
        self._check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("tokens", f"token ids in [0, {self.vocab_size})", bad[0])
        try:
            text = self.text.decode(req.tokens, skip_special_tokens=False)
        except Exception as e:  # an id the model has but its tokenizer lacks (a padded vocabulary)
            raise InvalidRequest("tokens", "ids the tokenizer can decode", type(e).__name__) from None
        return DetokenizeResponse(prompt=text)

    @staticmethod
    def version() -> VersionResponse:
        from raystate import __version__

        return VersionResponse(version=__version__)

    async def health(self) -> bool:
        """A real one-token step through every shard (Client.health), bounded in time."""
        try:
            return bool(await asyncio.wait_for(self.client.health(), HEALTH_TIMEOUT_S))
        except (TimeoutError, EngineDead):
            return False

    async def status(self) -> dict[str, Any]:
        """`Client.status()`, plus the usable KV blocks per group and shard (block 0 is the null block)."""
        status = dict(await self.client.status())
        status.setdefault("num_blocks", self.client.config.num_blocks - 1)
        return status

    async def metrics_text(self) -> bytes:
        try:
            status = await asyncio.wait_for(self.status(), HEALTH_TIMEOUT_S)
        except Exception:  # the scrape still reports latencies, with raystate_backend_up 0
            status = None
        return self.metrics.render(status)

    # -- shutdown drain -------------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        """True once `drain` began: the ingress answers new requests 503."""
        return self._cut_at is not None

    @property
    def in_flight(self) -> int:
        """Requests in progress, as counted by `track_request`."""
        return self._in_flight

    @contextlib.contextmanager
    def track_request(self):
        """Counts one request in progress while it runs; the front end wraps each request it admits in
        this (streams included, until their last event is sent), which is what `drain` waits for."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    async def drain(self, grace_s: float) -> bool:
        """Stops intake, lets the requests in progress run for `grace_s`, then cuts those still running.

        Why the cut: a process that simply exits leaves each open stream mid-body, which clients read as
        a network failure; a cut stream instead ends the way streams end, with an error event and
        `data: [DONE]`, and a cut request that is not streamed gets a 503. Returns True once no request
        is in progress, False if some still are DRAIN_CUT_MARGIN_S after the cut (a client that stopped
        reading its stream).
        """
        self.begin_drain(grace_s)
        return await self.wait_drained()

    def begin_drain(self, grace_s: float) -> None:
        """`drain` without the wait (call it on the server's event loop). A later call can only move the
        cut earlier: a second Ctrl-C passes 0 to end every stream now."""
        cut_at = asyncio.get_running_loop().time() + max(0.0, grace_s)
        if self._cut_at is None or cut_at < self._cut_at:
            self._grace_s, self._cut_at = grace_s, cut_at
            for scope in list(self._cut_scopes):
                scope.reschedule(cut_at)

    async def wait_drained(self) -> bool:
        """Waits until no request is in progress (True) or DRAIN_CUT_MARGIN_S past the cut (False)."""
        if self._cut_at is None:
            raise RuntimeError("wait_drained before begin_drain")
        loop = asyncio.get_running_loop()
        while self._in_flight > 0 and loop.time() < self._cut_at + DRAIN_CUT_MARGIN_S:
            await asyncio.sleep(0.05)
        return self._in_flight == 0

    def _cut_message(self, what: str) -> str:
        if not self._grace_s:  # a drain with no grace (a second Ctrl-C)
            return f"the server is shutting down: the {what} was ended"
        return f"the server is shutting down: the {what} was ended after the {self._grace_s:g} s grace period"

    @contextlib.asynccontextmanager
    async def _until_cut(self) -> AsyncIterator[None]:
        """Runs its body until the drain's cut (no bound before a drain); the cut raises ServerShuttingDown.

        The bound is an asyncio timeout whose deadline `drain` reschedules, so a body that began before
        the drain is cut all the same.
        """
        scope = asyncio.timeout_at(self._cut_at)
        try:
            async with scope:
                self._cut_scopes.add(scope)
                try:
                    yield
                finally:
                    self._cut_scopes.discard(scope)
        except TimeoutError:
            if not scope.expired():
                raise
            raise ServerShuttingDown(self._cut_message("request")) from None

    async def _run_to_end(self, gens: list[Generation]) -> None:
        """Consumes the generations of a request that is not streamed, up to the drain's cut."""
        async with self._until_cut(), contextlib.aclosing(merged_deltas(gens)) as deltas:
            async for _ in deltas:
                pass

    async def _cuttable(
        self, events: AsyncIterator[str], on_cut: Callable[[str], list[str]] | None = None
    ) -> AsyncIterator[str]:
        """`events` as they come; at the drain's cut, an error event and `data: [DONE]` instead (or the
        events `on_cut` makes of the reason: a response's response.failed).

        Only the wait for the next event is bounded, never the `yield`: a cut that landed while the event
        is being sent would cancel the ASGI server's send instead of ending the stream here. Cutting the
        wait closes `events`, which aborts the request (its KV blocks go back at once). `_until_cut`
        inlined: this runs once per token of every stream.
        """
        scopes = self._cut_scopes
        try:
            while True:
                scope = asyncio.timeout_at(self._cut_at)
                try:
                    async with scope:
                        scopes.add(scope)
                        try:
                            event = await anext(events)
                        finally:
                            scopes.discard(scope)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not scope.expired():
                        raise
                    break
                yield event
        finally:
            await events.aclose()
        if on_cut is not None:
            for event in on_cut(self._cut_message("stream")):
                yield event
            return
        body = error_body(self._cut_message("stream"), "service_unavailable", None, "server_shutting_down")
        yield f"data: {json.dumps(body)}\n\n"
        yield SSE_DONE

    async def shutdown(self) -> None:
        await self.client.shutdown()
