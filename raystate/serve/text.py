"""A served model's text side: its tokenizer, chat prompts, stream detokenizer and sampling defaults.

`LLM` and the OpenAI server (`RaystateServer`) both take their text handling from a `ModelText`, so that a
prompt, a chat conversation or a completion's text comes out the same through either front end:

- the reference models ("tiny", "bench", our own saves) use `ByteTokenizer`: prompts get a BOS, chats are
  rendered by its plain template (then BOS + the text), streams are decoded by the byte `TextStream`, and
  the sampling defaults are our own;
- a Hugging Face checkpoint uses its own tokenizer (`raystate.hf.HFTokenizer`): prompt strings are encoded
  with the special tokens its post-processor adds (as vLLM and transformers' `tokenizer(text)` do); chats
  are rendered with the checkpoint's chat template as transformers' `apply_chat_template(messages,
  add_generation_prompt=True, tokenize=False)` renders them, then encoded WITHOUT adding special tokens
  (the template writes its own BOS, as transformers' `tokenize=True` assumes); streams are decoded by
  `HFTextStream` (never half a UTF-8 character, special tokens skipped); and the sampling fields that
  `generation_config.json` sets replace our defaults wherever a request leaves them out (vLLM's
  `--generation-config auto`).

Torch-free: the serving layer imports this (raystate.hf needs only `tokenizers` and `jinja2`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from raystate.engine_args import ResolvedModel, load_tokenizer, with_local_checkpoint
from raystate.errors import InvalidRequest
from raystate.hf.generation_config import GenerationDefaults, load_generation_defaults
from raystate.messages import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, SamplingParams
from raystate.serve.detokenize import TextStream, byte_decoder

REFERENCE_ARCHITECTURE = "raystate_hybrid"

# generation_config.json's field -> our SamplingParams field (vLLM's `--generation-config auto` takes the
# same ones).
_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


class NoChatTemplate(InvalidRequest):
    """A chat request to a model whose checkpoint has no chat template (a 400 naming `messages`)."""

    def __init__(self, model: str) -> None:
        super().__init__("messages", "sent to a model with a chat template", model)
        self.args = (
            f"messages: the model {model!r} has no chat template (its tokenizer_config.json sets none "
            "and there is no chat_template.jinja), so it takes no chat requests; send a prompt to "
            "/v1/completions instead, or give the server a template (--chat-template)",
        )


@dataclass(frozen=True)
class ModelText:
    """One model's tokenizer, generation defaults and the ways the front ends use them."""

    tokenizer: Any  # raystate.tokenizer.ByteTokenizer or raystate.hf.HFTokenizer
    is_hf: bool = False
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    name: str = ""
    # A template the user gave in place of the checkpoint's (`--chat-template`); None: the checkpoint's.
    chat_template: str | None = None

    def with_chat_template(self, source: str | None) -> ModelText:
        """This model's text side with `source` as its chat template (None: unchanged). Only a Hugging Face
        checkpoint renders one: the byte models have a plain format of their own."""
        if source is None:
            return self
        if not self.is_hf:
            raise InvalidRequest("chat_template", "given only for a Hugging Face checkpoint", self.name)
        return replace(self, chat_template=source)

    # -- prompts -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt string's ids, by default with the special tokens the tokenizer adds (BOS where it adds
        one). Text no tokenizer takes (a lone surrogate) raises InvalidRequest."""
        if self.is_hf:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.tokenizer.encode(text, add_bos=add_special_tokens)

    def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """vLLM's bad_words as the engine takes them (`SamplingParams.bad_words_token_ids`): each word, its
        leading whitespace dropped, encoded without special tokens as it would start the text, and again
        after a space where that makes another first token in as many tokens (the word in mid-text, for
        tokenizers that fold the space into the word's token). InvalidRequest names `bad_words`."""
        if not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words):
            raise InvalidRequest("bad_words", "a list of strings", type(words).__name__)
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequest("bad_words", f"at most {MAX_BAD_WORDS} words", len(words))
        seqs: list[list[int]] = []
        for word in words:
            word = word.lstrip()
            if not word:
                raise InvalidRequest("bad_words", "words with a character other than whitespace", "")
            try:
                alone = self.encode(word, add_special_tokens=False)
                spaced = self.encode(" " + word, add_special_tokens=False)
            except InvalidRequest as e:  # the tokenizer's "text"
                raise InvalidRequest("bad_words", e.limit, e.got) from None
            if not alone or not spaced:
                raise InvalidRequest("bad_words", "words the tokenizer encodes to some token", word[:40])
            for ids in (alone, spaced) if spaced[0] != alone[0] and len(spaced) == len(alone) else (alone,):
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    limit = f"words of at most {MAX_BAD_WORD_TOKENS} tokens"
                    raise InvalidRequest("bad_words", limit, f"{word[:40]!r}: {len(ids)} tokens")
                if ids not in seqs:
                    seqs.append(ids)
        return seqs

    def with_bad_words_encoded(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad_words encoded into bad_words_token_ids (unchanged without bad_words)."""
        if params.bad_words is None:
            return params
        seqs = [*(params.bad_words_token_ids or ()), *self.bad_words_token_ids(params.bad_words)]
        return msgspec.structs.replace(params, bad_words=None, bad_words_token_ids=seqs or None)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ids, by default with the special tokens left out (as outputs are shown)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """(prompt text, prompt ids) of one conversation.

        A Hugging Face checkpoint: its chat template rendered as transformers renders it (with
        `continue_final_message`, the last message left open and no generation prompt; `template_kwargs`
        as extra template variables, e.g. `enable_thinking`), encoded without adding special tokens; no
        template raises NoChatTemplate, a template that refuses the conversation ChatTemplateError (both
        InvalidRequest naming `messages`). A byte model: its plain template (a `developer` message
        rendered as a `system` one; no template variables; continuing the final message drops the
        newline that closes it), then BOS + the text's bytes. `add_special_tokens` True or False
        overrides the encoding's special tokens (/tokenize's option). `tools`: OpenAI tool definitions,
        given to the template as transformers' `tools` (a byte model lists them as JSON first)."""
        if not messages:
            raise InvalidRequest("messages", "at least one message", [])
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message", "false when add_generation_prompt is true", continue_final_message
            )
        if not self.is_hf:
            chat = [dict(m) for m in messages]
            for m in chat:
                if m.get("role") == "developer":
                    m["role"] = "system"
            text = self.tokenizer.apply_chat_template(
                chat, add_generation_prompt=add_generation_prompt, tools=list(tools) if tools else None
            )
            if continue_final_message:
                text = text.removesuffix("\n")
            return text, self.tokenizer.encode(text, add_bos=add_special_tokens is not False)
        if self.chat_template is None and self.tokenizer.chat_template is None:
            raise NoChatTemplate(self.name)
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=list(tools) if tools else None,
            chat_template=self.chat_template,
            **dict(template_kwargs or {}),
        )
        return text, self.tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))

    def chat_template_source(self) -> str | None:
        """The chat template's text (every named template of a checkpoint that has several, joined), to
        recognise the tool-call format it writes; None for a byte model or a checkpoint without one."""
        if self.chat_template is not None:
            return self.chat_template
        templates = getattr(self.tokenizer, "chat_template", None) if self.is_hf else None
        if isinstance(templates, Mapping):
            return "\n".join(templates.values())
        return templates

    # -- outputs -------------------------------------------------------------------------------------

    def text_stream(
        self, stop: list[str] | None = None, include_stop: bool = False, skip_special_tokens: bool = True
    ):
        """A stream for one request's output ids: `push(ids, final) -> text delta`, `text`, `stopped`;
        stop strings applied on the text (the text ends before the one found, or after it with
        `include_stop`), special tokens skipped unless `skip_special_tokens` is false."""
        if self.is_hf:
            from raystate.hf.detokenize import HFTextStream

            return HFTextStream(self.tokenizer, stop, skip_special_tokens, include_stop=include_stop)
        if skip_special_tokens:
            return TextStream(stop, include_stop=include_stop)

        def special_text(token_id: int) -> str:  # "<|eos|>"
            return self.tokenizer.decode([token_id], skip_special_tokens=False)

        return TextStream(stop, byte_decoder(special_text), include_stop=include_stop)

    # -- sampling defaults ---------------------------------------------------------------------------

    def sampling_defaults(self) -> dict[str, Any]:
        """The SamplingParams fields the checkpoint's generation_config.json sets (temperature, top_p,
        top_k, min_p, repetition_penalty; max_tokens from max_new_tokens). Empty for the byte models and
        for checkpoints whose file sets none."""
        given = self.defaults.sampling_overrides()
        out = {ours: given[theirs] for theirs, ours in _DEFAULT_FIELDS.items() if theirs in given}
        if "max_new_tokens" in given:
            out["max_tokens"] = given["max_new_tokens"]
        return out

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's defaults laid over ours (vLLM's
        `LLM.get_default_sampling_params`)."""
        return SamplingParams(**self.sampling_defaults())


def load_model_text(model: ResolvedModel, name: str | None = None) -> ModelText:
    """The text side of a resolved model: `load_tokenizer`'s tokenizer and, for a Hugging Face checkpoint,
    the generation defaults of its folder. A tokenizer given apart from the checkpoint must not make ids
    past the model's vocabulary (its embedding has no row for them)."""
    tokenizer = load_tokenizer(model)
    is_hf = model.tokenizer != "byte"
    if is_hf and model.tokenizer != model.path and len(tokenizer) > model.config.vocab_size:
        raise InvalidRequest(
            "tokenizer",
            f"a tokenizer of at most {model.config.vocab_size} ids (the model's vocab_size)",
            f"{model.tokenizer}: {len(tokenizer)} ids",
        )
    defaults = GenerationDefaults()
    folder = model.path if model.generation_config == "auto" else model.generation_config
    if is_hf and folder is not None and folder != "vllm":
        defaults = load_generation_defaults(folder)
    return ModelText(tokenizer, is_hf, defaults, name or model.config.name)


def model_text_for_config(config: Any, name: str | None = None) -> ModelText:
    """The text side of the model an `EngineConfig` runs (a backend's `client.config`): the byte tokenizer
    for the reference architecture, else the tokenizer and generation defaults of `config.model_path`,
    the checkpoint folder `resolve_model` found (on the machine that reads it), with the tokenizer of
    `config.tokenizer_path` where one was given apart. A hub snapshot resolved on another node (this
    replica's node lacks it) is this node's copy (`with_local_checkpoint`)."""
    if getattr(config, "model_hub", None) or getattr(config, "tokenizer_hub", None):
        config = with_local_checkpoint(config)
    model_config = config.model
    architecture = getattr(model_config, "architecture", REFERENCE_ARCHITECTURE)
    path = getattr(config, "model_path", None)
    if architecture == REFERENCE_ARCHITECTURE:
        resolved = ResolvedModel(model_config, path=path)
    elif path is None:
        raise InvalidRequest("model_path", "the checkpoint folder of a Hugging Face model", None)
    else:
        tokenizer = getattr(config, "tokenizer_path", None) or path
        generation = getattr(config, "generation_config", "auto")
        resolved = ResolvedModel(model_config, path=path, tokenizer=tokenizer, generation_config=generation)
    return load_model_text(resolved, name)
