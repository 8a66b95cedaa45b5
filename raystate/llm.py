"""`raystate.LLM`: offline batch generation, the programmatic entry point.

    llm = LLM(model="tiny")  # backend="ray" (a Ray deployment, num_shards=1); "inprocess" for debugging
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
    llm.shutdown()

    llm = LLM(model="/models/Qwen3-0.6B")  # a Hugging Face checkpoint folder or hub id
    outs = llm.chat([{"role": "user", "content": "Hi!"}])  # its chat template and generation defaults

Arguments mirror what a vLLM user expects: the engine's knobs are `raystate.engine_args.EngineArgs`, validated
once here into a frozen `EngineConfig` by the builder every front end shares. Text goes through the
model's own tokenizer (`raystate.serve.text.ModelText`, shared with the OpenAI server): prompt strings are
encoded with the special tokens it adds, output text is decoded with special tokens skipped, and
`generate` without sampling params uses `get_default_sampling_params()` (the checkpoint's
generation_config.json sampling fields over our defaults).
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from raystate.beam_search import (
    BeamSearch,
    BeamSearchBatch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from raystate.engine_args import (
    BACKENDS,
    Backend,
    EngineArgs,
    build_engine_config,
    resolve_engine_model,
)
from raystate.errors import InvalidRequest, RequestFailed
from raystate.fanout import ChildRequest, child_requests
from raystate.messages import SamplingParams, unpack_logprobs
from raystate.serve.text import load_model_text


@dataclass
class Logprob:
    """One token's log-probability (vLLM's `Logprob`): rank 1 is the most likely token."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per token: {token_id: Logprob} holding the token itself and its top alternatives (vLLM's shape).
TokenLogprobs = dict[int, Logprob]


def logprob_dicts(data: bytes) -> list[TokenLogprobs]:
    """Wire records (`raystate.messages.pack_logprobs`) as one dict per token; the token's own entry
    first, then its alternatives, ranked 1, 2, ... (a token among them keeps its own rank)."""
    ids, lps, ranks = unpack_logprobs(data)
    out: list[TokenLogprobs] = []
    for row_ids, row_lps, rank in zip(ids.tolist(), lps.tolist(), ranks.tolist(), strict=True):
        d = {row_ids[0]: Logprob(row_lps[0], rank)}
        for j in range(1, len(row_ids)):
            d.setdefault(row_ids[j], Logprob(row_lps[j], j))
        out.append(d)
    return out


@dataclass
class CompletionOutput:
    """One of a request's n choices (`RequestOutput.outputs`), as in vLLM."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """One prompt's result. `outputs` holds its n choices (SamplingParams.n); the flat fields (token_ids,
    text, finish_reason, error, logprobs, num_cached_tokens, replay_start) are those of choice 0."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # the prefix-cache hit h in tokens, 0 when none was used
    replay_start: int = 0
    error: str | None = None  # why, when finish_reason is "error" (this request alone failed)
    # With SamplingParams.logprobs: one {token_id: Logprob} per output token (the token and its top k).
    logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    def __init__(
        self,
        model: str = "tiny",
        *,
        backend: Backend = "ray",
        num_shards: int = 1,
        address: str | None = None,
        ray_options: dict | None = None,
        **engine_args: Any,
    ) -> None:
        """`backend="ray"` (the default) starts a deployment: a scheduler actor and `num_shards` worker
        actors, on the Ray cluster at `address` (or a local one); `ray_options` are
        `raystate.launch.LaunchOptions` fields (dispatch, num_cpus_per_shard, ...). `backend="inprocess"`
        runs the scheduler and one worker in this process, for debugging.

        `engine_args` are the fields of `raystate.engine_args.EngineArgs` (device, max_model_len,
        max_num_seqs, kv_cache_bytes, ...), the knobs the Serve app and `raystate serve` take too. E.g.
        `num_blocks` gives every KV cache group that many blocks per shard; `kv_cache_bytes` instead
        splits a per-shard byte budget (see `raystate.kv_layout.plan_group_blocks`); `share_replay`:
        requests admitted in one step with the same replayed prefix hit rebuild its sliding window once
        (`raystate.scheduler.kv_manager`)."""
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        resolved = resolve_engine_model(args)
        self.config = build_engine_config(args, resolved)
        self.text = load_model_text(resolved, model)
        self.tokenizer = self.text.tokenizer
        self._ids = itertools.count()
        self.backend = backend
        self.engine = None  # the in-process engine
        self.cluster = None  # the Ray deployment
        if backend == "inprocess":
            if num_shards != 1:
                raise InvalidRequest("num_shards", "1 with backend='inprocess'", num_shards)
            if ray_options:
                raise InvalidRequest("ray_options", "none with backend='inprocess'", sorted(ray_options))
            from raystate.engine import InProcessEngine

            self.engine = InProcessEngine(self.config)
            self.config = self.engine.config  # KV blocks fixed (a CUDA worker may size them at start)
        elif backend == "ray":
            from raystate import launch
            from raystate.cluster import Cluster, ensure_ray

            ensure_ray(address)
            self.cluster = Cluster.start(
                self.config, name=launch.free_name("raystate"), num_shards=num_shards, **(ray_options or {})
            )
            self.config = self.cluster.config
        else:
            raise InvalidRequest("backend", " or ".join(map(repr, BACKENDS)), backend)

    def shutdown(self) -> None:
        """Stops the Ray deployment (nothing to do in-process)."""
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def _prompts(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if prompts is not None and prompt_token_ids is not None:
            raise InvalidRequest("prompts", "given alone (not with prompt_token_ids)", "both")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            return [(p, self.text.encode(p)) for p in prompts]
        if prompt_token_ids is None:
            raise InvalidRequest("prompts", "a string, a list of strings or prompt_token_ids", None)
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        return [(None, list(ids)) for ids in prompt_token_ids]

    def beam_search(
        self,
        prompts: str | Sequence[str | Sequence[int] | Mapping[str, Any]],
        params: BeamSearchParams,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best continuations of each prompt (a string,
        token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}), best first
        (`raystate.beam_search`). Every step runs the live beams of all prompts as one `generate` call
        of one greedy token with 2 * beam_width logprobs each."""
        params.validate()
        items = []
        for i, p in enumerate([prompts] if isinstance(prompts, str) else list(prompts)):
            if isinstance(p, Mapping):
                p = p.get("prompt_token_ids", p.get("prompt"))
            if isinstance(p, str):
                items.append(self.text.encode(p))
            elif isinstance(p, Sequence) and p and all(isinstance(t, int) for t in p):
                items.append(list(p))
            else:
                raise InvalidRequest(
                    f"prompts[{i}]", "a string or a non-empty list of token ids", type(p).__name__
                )
        room = self.config.max_model_len
        for ids in items:
            if len(ids) + params.max_tokens > room:
                limit = f"<= {room - len(ids)} (max_model_len={room}; the prompt has {len(ids)} tokens)"
                raise InvalidRequest("max_tokens", limit, params.max_tokens)
        eos = frozenset(self.config.model.eos_token_ids)
        searches = [
            BeamSearch(
                ids, params.beam_width, params.max_tokens, eos, params.ignore_eos, params.length_penalty
            )
            for ids in items
        ]
        k = 2 * params.beam_width
        step = SamplingParams(max_tokens=1, logprobs=k, ignore_eos=True)
        batch = BeamSearchBatch(searches)
        while flat := batch.pending():
            alternatives = []
            for out in self.generate(prompt_token_ids=flat, sampling_params=step, use_tqdm=False):
                if out.finish_reason == "error" or not out.logprobs:
                    raise RequestFailed(f"beam search: a step failed: {out.error}")
                ranked = sorted(out.logprobs[0].items(), key=lambda kv: kv[1].rank)[:k]
                alternatives.append([(t, lp.logprob) for t, lp in ranked])
            batch.advance(alternatives)
        results = []
        for search in searches:
            sequences = []
            for beam in search.best():
                text = self.text.decode(beam.text_ids())
                sequences.append(BeamSearchSequence(beam.tokens, text, beam.cum_logprob, beam.finish_reason))
            results.append(BeamSearchOutput(sequences))
        return results

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params `generate` and `chat` use when given none: `SamplingParams()` with the
        fields the checkpoint's generation_config.json sets (temperature, top_p, top_k; max_tokens from
        max_new_tokens) in place of ours, as vLLM's method of that name. The byte models: SamplingParams()."""
        return self.text.default_sampling_params()

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generates a reply to each conversation (one list of `{"role", "content"}` messages, or a list of
        them), rendered with the model's chat template exactly as the OpenAI server renders a
        /v1/chat/completions request: `tools` (OpenAI tool definitions, given to the template as
        transformers' `tools`), `chat_template_kwargs` (template variables such as `enable_thinking`) and
        `continue_final_message` as the server takes them, as vLLM's `LLM.chat` does; `chat_template` (a
        Jinja template's text or file) is rendered in place of the checkpoint's, as the server's
        `--chat-template`. The reply is text:
        reading tool calls out of it is the server's (`raystate.serve.tool_calls`). A template that refuses
        a conversation, or a model without one, raises InvalidRequest naming `messages`. Each output's
        `prompt` is the rendered prompt text."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequest("messages", "a conversation or a list of conversations", messages)
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        text = self.text
        if chat_template is not None:
            from raystate.hf.chat_template import read_chat_template

            text = text.with_chat_template(read_chat_template(chat_template))
        items = []
        for conversation in conversations:
            if isinstance(conversation, str) or not isinstance(conversation, Sequence):
                raise InvalidRequest("messages", "lists of message objects", conversation)
            items.append(
                text.chat_prompt(
                    conversation,
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    continue_final_message=continue_final_message,
                    template_kwargs=chat_template_kwargs,
                    tools=tools,
                )
            )
        return self._run(items, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: str | list[str] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order.

        A bad prompt raises InvalidRequest (a ValueError) naming the field and the limit; the call's other
        prompts are withdrawn and requests accepted before the call are not touched.
        """
        if isinstance(prompt_token_ids, SamplingParams) or (
            isinstance(prompt_token_ids, list)
            and prompt_token_ids
            and isinstance(prompt_token_ids[0], SamplingParams)
        ):
            # generate(prompts, params), the vLLM call shape.
            if sampling_params is not None:
                raise InvalidRequest("sampling_params", "given once", "twice")
            prompt_token_ids, sampling_params = None, prompt_token_ids
        return self._run(self._prompts(prompts, prompt_token_ids), sampling_params, use_tqdm)

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | list[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise InvalidRequest("sampling_params", f"one per prompt ({len(items)})", len(params))
        encoded = {id(p): self.text.with_bad_words_encoded(p) for p in params}  # words: the engine's ids
        params = [encoded[id(p)] for p in params]
        if self.cluster is not None:
            return self._generate_ray(items, params, use_tqdm)
        children, outputs, groups = self._expand(items, params)
        try:
            for c in children:
                self.engine.add_request(c.req_id, c.prompt_token_ids, c.sampling, fork_of=c.fork_of)
        except ValueError:
            # Withdraw this call's earlier prompts; requests accepted before the call run on.
            for queued in outputs:
                self.engine.abort(queued)
            raise
        progress = _Progress(groups, use_tqdm)
        pending = set(outputs)
        while pending:
            for u in self.engine.step():
                _apply_update(outputs, pending, u)
                progress.update(u)
        return self._finish(outputs, groups, progress)

    def _generate_ray(self, items, params, use_tqdm: bool) -> list[RequestOutput]:
        """Submits the call's prompts as one atomic batch and collects the streamed updates."""
        children, outputs, groups = self._expand(items, params)
        batch = [(c.req_id, c.prompt_token_ids, c.sampling, c.fork_of) for c in children]
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.cluster.submit(batch, inbox.put)  # InvalidRequest withdraws the whole batch
        progress = _Progress(groups, use_tqdm)
        pending = set(outputs)
        try:
            while pending:
                item = inbox.get()
                if isinstance(item, BaseException):
                    raise item
                _apply_update(outputs, pending, item)
                progress.update(item)
        except BaseException:  # e.g. Ctrl-C: the deployment must not keep generating for nobody
            progress.bar.close()
            self.cluster.abort_nowait(pending)
            raise
        return self._finish(outputs, groups, progress)

    def _expand(
        self, items: list[tuple[str | None, list[int]]], params: list[SamplingParams]
    ) -> tuple[list[ChildRequest], dict[str, RequestOutput], list[tuple[str, list[str]]]]:
        """The call's engine requests (a prompt's n choices: `raystate.fanout`), an output per engine
        request, and per prompt its id and its engine requests' ids."""
        children: list[ChildRequest] = []
        outputs: dict[str, RequestOutput] = {}
        groups: list[tuple[str, list[str]]] = []
        for (text, ids), sp in zip(items, params, strict=True):
            rid = f"req-{next(self._ids)}"
            mine = child_requests(rid, ids, sp)
            for c in mine:
                outputs[c.req_id] = _new_output(c.req_id, text, ids, sp)
            children += mine
            groups.append((rid, [c.req_id for c in mine]))
        return children, outputs, groups

    def _finish(
        self, outputs: dict[str, RequestOutput], groups: list[tuple[str, list[str]]], progress: _Progress
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt: choice 0's, with every choice in `outputs`."""
        progress.bar.close()
        for out in outputs.values():
            # the id that ended the request (EOS or a stop_token_ids id) writes no text, as in vLLM
            ended = out.finish_reason == "stop" and bool(out.token_ids)
            out.text = self.text.decode(out.token_ids[:-1] if ended else out.token_ids)
            for per_token in (out.logprobs or [], out.prompt_logprobs or []):
                for d in per_token:
                    for tid, lp in (d or {}).items():
                        lp.decoded_token = self.text.decode([tid], skip_special_tokens=False)
        results = []
        for rid, children in groups:
            first = outputs[children[0]]
            first.request_id = rid
            first.outputs = [
                CompletionOutput(i, o.text, o.token_ids, o.finish_reason, o.logprobs, o.error)
                for i, o in enumerate(outputs[c] for c in children)
            ]
            results.append(first)
        return results


class _Progress:
    """The progress bar of a call: a prompt counts once all its choices finished."""

    def __init__(self, groups: list[tuple[str, list[str]]], use_tqdm: bool) -> None:
        self.prompt_of = {c: i for i, (_, children) in enumerate(groups) for c in children}
        self.choices_left = [len(children) for _, children in groups]
        self.bar = tqdm(total=len(groups), desc="generate", disable=not use_tqdm or len(groups) < 2)

    def update(self, u) -> None:
        if u.finished and (i := self.prompt_of.pop(u.req_id, None)) is not None:
            self.choices_left[i] -= 1
            if not self.choices_left[i]:
                self.bar.update(1)


def _new_output(rid: str, text: str | None, ids: list[int], sp: SamplingParams) -> RequestOutput:
    out = RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids)
    if sp.logprobs is not None:
        out.logprobs = []
    if sp.prompt_logprobs is not None:
        out.prompt_logprobs = [None]
    return out


def _apply_update(outputs: dict[str, RequestOutput], pending: set[str], u) -> None:
    out = outputs.get(u.req_id)
    if out is None:
        return
    out.token_ids.extend(u.new_token_ids)
    if u.logprobs and out.logprobs is not None:
        out.logprobs.extend(logprob_dicts(u.logprobs))
    if u.prompt_logprobs and out.prompt_logprobs is not None:
        out.prompt_logprobs.extend(logprob_dicts(u.prompt_logprobs))
    out.num_cached_tokens = u.num_cached_tokens
    out.replay_start = u.replay_start
    if u.finished:
        out.finish_reason = u.finish_reason
        out.error = u.error
        pending.discard(u.req_id)
