"""Sampling defaults of a Hugging Face checkpoint, from its `generation_config.json`.

Only what the file says is taken: a field the file leaves out stays None here, so the server's own defaults
apply to it (transformers' `GenerationConfig` would fill in its class defaults, top_k 50 among them; a
server, like vLLM, takes only what the checkpoint's authors wrote). No file: every field None.

`do_sample` is kept for information: `generate` in transformers samples only when it is true, but a
checkpoint's temperature, top_p and top_k are the defaults its authors meant for sampling, and an OpenAI
request samples unless it asks for temperature 0, so the server takes them whatever `do_sample` says.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raystate.errors import InvalidRequest

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    """The checkpoint's generation defaults; None where its file says nothing."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # as written: 0 means no top-k cut (transformers' meaning)
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (the file may give one or several)
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling fields the file sets (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens), to lay under a request's own values."""
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
        return {k: v for k, v in asdict(self).items() if k in keys and v is not None}

    def stop_token_ids(self, tokenizer_eos_id: int | None = None) -> tuple[int, ...]:
        """The EOS ids of the file, then the tokenizer's EOS if the file lacks it (deduplicated, in order)."""
        ids = list(self.eos_token_ids)
        if tokenizer_eos_id is not None and tokenizer_eos_id not in ids:
            ids.append(tokenizer_eos_id)
        return tuple(ids)


def _number(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{GENERATION_CONFIG_FILE}: {name}", "a finite number", value)
    if value < lo or value > hi or (lo_open and value == lo):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise InvalidRequest(f"{GENERATION_CONFIG_FILE}: {name}", f"in {bounds}", value)
    return float(value)


def _int(name: str, value: Any, lo: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidRequest(f"{GENERATION_CONFIG_FILE}: {name}", f"an integer >= {lo}", value)
    return value


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    out: list[int] = []
    for v in items:
        tok = _int(name, v, 0)
        if tok not in out:
            out.append(tok)
    return tuple(out)


def generation_defaults_from_dict(cfg: dict[str, Any]) -> GenerationDefaults:
    """GenerationDefaults from the parsed JSON object; a field of the wrong type or out of range raises
    InvalidRequest naming it."""
    if not isinstance(cfg, dict):
        raise InvalidRequest(GENERATION_CONFIG_FILE, "a JSON object", type(cfg).__name__)
    top_k = _int("top_k", cfg.get("top_k"), -1)
    do_sample = cfg.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise InvalidRequest(f"{GENERATION_CONFIG_FILE}: do_sample", "true or false", do_sample)
    pad = cfg.get("pad_token_id")
    if isinstance(pad, list):  # a few configs write a list here; the first is the pad id
        pad = pad[0] if pad else None
    return GenerationDefaults(
        temperature=_number("temperature", cfg.get("temperature"), 0.0, math.inf),
        top_p=_number("top_p", cfg.get("top_p"), 0.0, 1.0, lo_open=True),
        top_k=None if top_k is None else max(top_k, 0),  # -1 (vLLM's "off") and 0 both mean off
        min_p=_number("min_p", cfg.get("min_p"), 0.0, 1.0),
        repetition_penalty=_number(
            "repetition_penalty", cfg.get("repetition_penalty"), 0.0, math.inf, lo_open=True
        ),
        max_new_tokens=_int("max_new_tokens", cfg.get("max_new_tokens"), 1),
        do_sample=do_sample,
        eos_token_ids=_token_ids("eos_token_id", cfg.get("eos_token_id")),
        bos_token_id=_int("bos_token_id", cfg.get("bos_token_id"), 0),
        pad_token_id=_int("pad_token_id", pad, 0),
    )


def load_generation_defaults(path: str | Path) -> GenerationDefaults:
    """The defaults of the checkpoint folder `path` (or of the generation_config.json file it names);
    empty defaults when there is no such file. Invalid JSON raises InvalidRequest naming the file."""
    path = Path(path)
    file = path / GENERATION_CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        return GenerationDefaults()
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(str(file), "valid JSON", str(e)) from None
    return generation_defaults_from_dict(cfg)
