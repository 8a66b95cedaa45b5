"""A Hugging Face checkpoint's own tokenizer, without transformers (which may pull in torch).

`HFTokenizer.from_pretrained(folder)` loads `tokenizer.json` with the `tokenizers` library and applies the
checkpoint's `tokenizer_config.json` (and `special_tokens_map.json`, where present) the way transformers'
`TokenizersBackend` (the class behind `PreTrainedTokenizerFast` and `AutoTokenizer`) applies them:

- Special tokens: the named ones (`bos_token`, `eos_token`, `unk_token`, `sep_token`, `pad_token`,
  `cls_token`, `mask_token`, then any other `*_token` key with a string value, like Gemma 3's
  `image_token`) and the extra ones (`extra_special_tokens`, or the older `additional_special_tokens`)
  are added to the backend as special tokens, so text containing them encodes to their ids and
  `decode(skip_special_tokens=True)` drops them; `added_tokens_decoder` entries the backend does not
  already hold (with the same flags) are added with their flags. `special_tokens_map.json` is read only
  when `tokenizer_config.json` has no `added_tokens_decoder` (older checkpoints), and its values win.
- BOS/EOS: `tokenizer.json`'s post-processor decides (Llama 3's template adds `<|begin_of_text|>`,
  Gemma's adds `<bos>`, Qwen's byte-level one adds nothing). transformers 5 drops the config's
  `add_bos_token`/`add_eos_token` when the folder has a `tokenizer.json` (`_from_pretrained`); only
  flags passed to `from_pretrained` itself rebuild the post-processor (BOS and/or EOS around the text,
  a flag left out counting as false), as here. (transformers 4's Llama and Gemma classes rebuilt it
  from the config's flags; their saved `tokenizer.json` files agree with their flags.)
- Truncation and padding saved in `tokenizer.json` are turned off (transformers turns them off for a call
  that asks for neither).
- `decode` is the backend's decode; `clean_up_tokenization_spaces` (false unless the config sets it) is
  applied as transformers 5 applies it: not on a BPE model (see `_cleanup_applies`).

Chat templates: `chat_template.jinja` in the folder, else `tokenizer_config.json`'s `chat_template` (a string,
or a list of `{"name", "template"}`), plus `additional_chat_templates/NAME.jinja` as named templates;
rendered by `raystate.hf.chat_template` as transformers renders them.

Facts checked against transformers 5.24's `tokenization_utils_tokenizers.py` and
`tokenization_utils_base.py`. One known difference: for a checkpoint whose `tokenizer_class` is a
model-specific class with its own `__init__` (e.g. `LlamaTokenizer`, `GemmaTokenizer`, `Qwen2Tokenizer`),
transformers 5 rebuilds the pipeline (normalizer, pre-tokenizer, decoder) from the class's code around the
vocab and merges of `tokenizer.json`; this class always takes `tokenizer.json` as written (as the
checkpoint's authors saved it, which is what transformers 4 used).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from raystate.errors import InvalidRequest
from raystate.hf.chat_template import render_chat_template, select_chat_template

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(str(file), "valid JSON", str(e)) from None
    if not isinstance(data, dict):
        raise InvalidRequest(str(file), "a JSON object", type(data).__name__)
    return data


def _added_token(value: Any, *, special: bool) -> AddedToken | None:
    """A config's token value (a string, or an AddedToken written as a dict) as an AddedToken; None for
    null. A string is taken as transformers takes it: special, not normalized."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=not special)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: value[k] for k in _ADDED_TOKEN_FLAGS if k in value}
        if special:
            flags["special"] = True
        return AddedToken(value["content"], **flags)
    raise InvalidRequest("special token", "a string or an AddedToken object", value)


def _same_added_token(a: AddedToken, b: AddedToken) -> bool:
    return a.content == b.content and all(getattr(a, k) == getattr(b, k) for k in _ADDED_TOKEN_FLAGS)


_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
# How far (in characters) a change at the end of a text can reach back into the cleaned-up text: the sum
# over the replacements of their pattern length - 1 (each replacement, scanning left to right, can move
# the first difference back by at most that much). A stream holds back this many characters.
CLEANUP_REACH = sum(len(a) - 1 for a, _ in _CLEANUPS)


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: drops the space before some punctuation and English
    contractions (for WordPiece-era tokenizers)."""
    for a, b in _CLEANUPS:
        text = text.replace(a, b)
    return text


class HFTokenizer:
    """A checkpoint's tokenizer: encode, decode, special tokens, chat template. Thread-safe for the
    read-only calls it offers (nothing mutates the backend after loading)."""

    def __init__(
        self,
        backend: Tokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        name_or_path: str = "",
        *,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> None:
        config = dict(config or {})
        self.name_or_path = name_or_path
        self._backend = backend
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        # Named special tokens (the standard ones, then the checkpoint's own `*_token` keys) and extras.
        self._special_tokens: dict[str, AddedToken] = {}
        for name in NAMED_SPECIAL_TOKENS:
            tok = _added_token(config.get(name), special=True)
            if tok is not None:
                self._special_tokens[name] = tok
        for name, value in config.items():
            if name not in NAMED_SPECIAL_TOKENS and name.endswith("_token") and isinstance(value, str):
                self._special_tokens[name] = _added_token(value, special=True)
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, Mapping):  # named extras (multimodal configs): {"image_token": "<image>", ...}
            for name, value in extra.items():
                self._special_tokens[name] = _added_token(value, special=True)
            extra = []
        self._extra_special_tokens = [t for t in (_added_token(v, special=True) for v in extra) if t]

        # added_tokens_decoder entries the backend lacks (or holds with other flags), in id order.
        held = list(backend.get_added_tokens_decoder().values())
        decoder_cfg = config.get("added_tokens_decoder") or {}
        to_add = []
        for _, value in sorted(decoder_cfg.items(), key=lambda kv: int(kv[0])):
            tok = _added_token(value, special=False)
            if tok is not None and not any(_same_added_token(tok, h) for h in held):
                to_add.append(tok)
        if to_add:
            backend.add_tokens(to_add)
        specials = [*self._special_tokens.values(), *self._extra_special_tokens]
        if specials:
            backend.add_special_tokens(specials)

        # BOS/EOS: tokenizer.json's post-processor, unless the caller sets a flag (both flags rebuild it).
        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            self._set_bos_eos_post_processor(bool(add_bos_token), bool(add_eos_token))
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self.add_eos_token = self.eos_token_id is not None and probe[-1:] == [self.eos_token_id]

        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._cleanup_for_bpe = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        )
        self.chat_template = chat_template
        self.model_max_length = config.get("model_max_length")

    # -- loading -------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, add_bos_token: bool | None = None, add_eos_token: bool | None = None
    ) -> HFTokenizer:
        """The tokenizer of the checkpoint folder `path`. A folder without `tokenizer.json` (a
        SentencePiece-only or tiktoken checkpoint) is refused with an error that names the file.
        `add_bos_token`/`add_eos_token`, when given, override what `tokenizer.json` adds (as the same
        arguments to transformers' `from_pretrained` do)."""
        folder = Path(path)
        file = folder / TOKENIZER_FILE
        if not file.is_file():
            raise InvalidRequest(str(file), "present (the tokenizer is read from tokenizer.json)", "missing")
        config: dict[str, Any] = {}
        if (folder / TOKENIZER_CONFIG_FILE).is_file():
            config = _read_json(folder / TOKENIZER_CONFIG_FILE)
        if "added_tokens_decoder" not in config and (folder / SPECIAL_TOKENS_MAP_FILE).is_file():
            # Older checkpoints: its values win over tokenizer_config.json's, as in transformers.
            for key, value in _read_json(folder / SPECIAL_TOKENS_MAP_FILE).items():
                if key == "extra_special_tokens" and isinstance(value, list):
                    value = [*(config.get("extra_special_tokens") or []), *value]
                config[key] = value
        try:
            backend = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exception on a malformed file
            raise InvalidRequest(str(file), "a tokenizers serialization", str(e)) from None
        return cls(
            backend,
            config,
            _load_chat_templates(folder, config),
            name_or_path=str(folder),
            add_bos_token=add_bos_token,
            add_eos_token=add_eos_token,
        )

    # -- vocabulary ----------------------------------------------------------------------------------
    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` (read it; mutating it changes this tokenizer)."""
        return self._backend

    def __len__(self) -> int:
        """Base vocabulary plus added tokens, as transformers' `len(tokenizer)`."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' `vocab_size`)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(
        self, ids: int | Iterable[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        """Raw token strings ("Ġworld", "<0xE2>", "<|im_end|>"); None for an id outside the vocabulary."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    # -- special tokens ------------------------------------------------------------------------------
    def _special_id(self, name: str) -> int | None:
        tok = self._special_tokens.get(name)
        return None if tok is None else self._backend.token_to_id(tok.content)

    def _special_text(self, name: str) -> str | None:
        tok = self._special_tokens.get(name)
        return None if tok is None else tok.content

    bos_token = property(lambda self: self._special_text("bos_token"))
    eos_token = property(lambda self: self._special_text("eos_token"))
    pad_token = property(lambda self: self._special_text("pad_token"))
    unk_token = property(lambda self: self._special_text("unk_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens as text (not the extra ones): what a chat template sees by name
        (`bos_token`, `eos_token`, ...), as transformers 5's `special_tokens_map`."""
        return {name: tok.content for name, tok in self._special_tokens.items()}

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, without repeats."""
        seen: list[str] = []
        for tok in [*self._special_tokens.values(), *self._extra_special_tokens]:
            if tok.content not in seen:
                seen.append(tok.content)
        return seen

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._backend.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    def _set_bos_eos_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """transformers' `update_post_processor`: BOS and/or EOS around the text (and around each text of a
        pair), for the flags that are set and whose token exists."""
        bos, eos = self.bos_token, self.eos_token
        add_bos = add_bos and bos is not None
        add_eos = add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        special = []
        if add_bos:
            special.append((bos, self.bos_token_id))
        if add_eos:
            special.append((eos, self.eos_token_id))
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )

    # -- text ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the BOS/EOS the checkpoint's post-processor adds.
        Special tokens written in the text encode to their ids. Text that is not valid Unicode (a lone
        surrogate, which JSON's "\\ud800" escape can carry) raises InvalidRequest."""
        if not isinstance(text, str):
            raise InvalidRequest("text", "a string", type(text).__name__)
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # what the Rust side raises for a str it cannot take as UTF-8
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequest("text", "valid Unicode (no lone surrogates)", text[e.start]) from None
            raise

    def _cleanup_applies(self) -> bool:
        """transformers 5 skips `clean_up_tokenization_spaces` for a BPE model (it would corrupt BPE text)
        unless the config insists; it applies it to every other model."""
        if not self.clean_up_tokenization_spaces:
            return False
        return type(self._backend.model).__name__ != "BPE" or self._cleanup_for_bpe

    def decode_raw(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The backend's decode, before any clean-up of spaces (what a stream decodes window by window).
        An id the tokenizer does not know (a model's embedding often has more rows than the tokenizer has
        tokens) carries no text, as in transformers."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens are left out unless `skip_special_tokens` is false. Invalid UTF-8
        (a sampled byte sequence need not be valid) comes back as U+FFFD."""
        text = self.decode_raw(ids, skip_special_tokens)
        return clean_up_tokenization(text) if self._cleanup_applies() else text

    # -- chat ----------------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template text `apply_chat_template` renders (a name picks one of the named templates)."""
        return select_chat_template(self.chat_template, chat_template, has_tools=tools is not None)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        tokenize: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The prompt text of a conversation, rendered with the checkpoint's chat template as
        transformers' `apply_chat_template(..., tokenize=False)` renders it. `tools` are JSON schemas.
        With `tokenize`, its token ids, encoded without adding special tokens (the template writes its
        own BOS), as transformers does."""
        source = self.get_chat_template(chat_template, tools)
        text = render_chat_template(
            source,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            special_tokens=self.special_tokens_map,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _load_chat_templates(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The checkpoint's chat template(s), as transformers finds them: template files
    (`chat_template.jinja` as "default", `additional_chat_templates/NAME.jinja` by name) replace the
    config's `chat_template` (a string, or a list of `{"name", "template"}`); a single "default" is a plain
    string, several make a dict of named templates."""
    files: dict[str, str] = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    extra_dir = folder / ADDITIONAL_CHAT_TEMPLATES_DIR
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            files[f.stem] = f.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    template: Any = config.get("chat_template")
    if isinstance(template, list):
        named = {}
        for item in template:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                raise InvalidRequest("tokenizer_config.json: chat_template", "{name, template} objects", item)
            named[item["name"]] = item["template"]
        return named
    if template is not None and not isinstance(template, str):
        raise InvalidRequest("tokenizer_config.json: chat_template", "a string or a list", template)
    return template
