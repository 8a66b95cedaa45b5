"""A `--model` (or `--tokenizer`) word to a local folder: a folder as is, or a Hugging Face hub id downloaded.

Serving hosts are often offline, so the hub path's errors must say what was looked for and where: the
word is not a folder, the cache (HF_HUB_CACHE, from HF_HOME) holds no copy, and the hub was unreachable.
`huggingface_hub` resolves the cache and offline mode (HF_HUB_OFFLINE) itself; it is imported only when a
hub id is actually resolved, since importing it costs time the folder path does not need. Torch-free, like
the rest of raystate.hf.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from raystate.errors import InvalidRequest

CONFIG_FILE = "config.json"
# What serving needs from a repo: config, generation defaults, tokenizer and chat template, weights.
# Everything else (pytorch_model.bin, onnx/, original/, README images) is left on the hub.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",  # named templates, which the tokenizer loads beside the default
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.model",
]
# What a tokenizer of its own (`--tokenizer`) needs: the tokenizer, its special tokens and chat templates.
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
]

# One hub id segment: letters, digits, '_', '-', '.', starting and ending with a letter, digit or '_'.
_SEGMENT = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?:{_SEGMENT}/)?{_SEGMENT}")
_MAX_HUB_ID = 96


class ModelNotAvailable(InvalidRequest):
    """A hub id with no usable local copy (offline, hub unreachable, or a partial copy). The message says
    where the cache is and what to do, because the person reading it is on a machine that cannot fix it
    by retrying."""

    def __init__(
        self,
        model: str,
        cache_dir: str,
        hub_state: str,
        partial_copy: str | None = None,
        field: str = "model",
    ) -> None:
        super().__init__(field, "a local folder or a hub id with a copy in the cache", model)
        self.cache_dir = cache_dir
        if partial_copy is None:
            cached = f"no copy of it is in the Hugging Face cache at {cache_dir}"
        else:
            cached = f"its copy in the Hugging Face cache at {cache_dir} is incomplete ({partial_copy})"
        self.args = (
            f"{field} {model!r} is not a local folder, {cached}, and {hub_state}. Download it on a machine "
            f"with network access (e.g. `hf download {model}`) and point --{field} at the downloaded folder, "
            "or set HF_HUB_CACHE (or HF_HOME) to a cache that holds it.",
        )


def _has_path_syntax(model: str) -> bool:
    """Written as a path: absolute, relative to '.'/'..', home-relative or Windows-separated."""
    return (
        model in (".", "..")
        or model.startswith(("/", "./", "../", "~"))
        or "\\" in model
        or os.path.isabs(model)
    )


def looks_like_hub_id(model: str) -> bool:
    """ "org/name" or "name" in the hub's alphabet, and not something meant as a path (path syntax, or a
    path that exists here)."""
    if not model or len(model) > _MAX_HUB_ID or _has_path_syntax(model) or os.path.exists(model):
        return False
    if "--" in model or ".." in model or model.endswith(".git"):
        return False
    return _HUB_ID.fullmatch(model) is not None


def _local_folder(path: Path, word: str, field: str, kind: str, required: str) -> Path:
    """An existing path that must be a folder holding `required`."""
    if not path.is_dir():
        raise InvalidRequest(field, f"a {kind} folder ({path} is a file)", word)
    if not (path / required).is_file():
        raise InvalidRequest(field, f"a {kind} folder holding {required} ({path} has none)", word)
    return path


def resolve_checkpoint_folder(model: str, *, revision: str | None = None) -> Path:
    """The local folder of `model`: an existing folder holding config.json, or the cached snapshot of a
    hub id (downloading what serving needs, ALLOW_PATTERNS, unless it is cached or the hub is offline).

    Errors are InvalidRequest naming the field at fault: a folder without config.json, a word that is
    neither a folder nor a hub id, a repo or revision the hub does not have (or gates), and, offline with
    no cached copy, `ModelNotAvailable` with the cache location.
    """
    return _resolve(model, "model", "checkpoint", CONFIG_FILE, ALLOW_PATTERNS, revision, "revision")


def resolve_tokenizer_folder(tokenizer: str, *, revision: str | None = None) -> Path:
    """The local folder of a tokenizer given apart from the checkpoint (`--tokenizer`): an existing folder
    holding tokenizer.json, or the cached snapshot of a hub id (only its tokenizer files, TOKENIZER_PATTERNS,
    downloaded). Errors as `resolve_checkpoint_folder`'s, naming `tokenizer` and `tokenizer_revision`."""
    return _resolve(
        tokenizer,
        "tokenizer",
        "tokenizer",
        TOKENIZER_FILE,
        TOKENIZER_PATTERNS,
        revision,
        "tokenizer_revision",
    )


def _resolve(
    word: str,
    field: str,
    kind: str,
    required: str,
    patterns: list[str],
    revision: str | None,
    revision_field: str,
) -> Path:
    """`word` as a local folder holding `required`, or a hub id's snapshot of `patterns` at `revision`;
    errors name `field` (`revision_field` for a revision the hub does not have)."""
    if not word:  # Path("") is the working directory: never what an empty --model meant
        raise InvalidRequest(field, f"a {kind} folder or a Hugging Face hub id (not empty)", word)
    path = Path(word).expanduser()
    if path.exists():
        return _local_folder(path, word, field, kind, required)
    if _has_path_syntax(word):
        raise InvalidRequest(field, f"an existing {kind} folder (no such folder)", word)
    if not looks_like_hub_id(word):
        raise InvalidRequest(
            field, f"an existing {kind} folder or a Hugging Face hub id ('name' or 'org/name')", word
        )

    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import errors as hub_errors

    cache_dir = constants.HF_HUB_CACHE
    offline = constants.HF_HUB_OFFLINE
    try:
        folder = huggingface_hub.snapshot_download(word, revision=revision, allow_patterns=patterns)
    except hub_errors.GatedRepoError as e:
        raise InvalidRequest(
            field, "a hub repo your token may read (it is gated: accept its terms and set HF_TOKEN)", word
        ) from e
    except hub_errors.RepositoryNotFoundError as e:
        raise InvalidRequest(
            field, "an existing hub repo (not found, or private and HF_TOKEN cannot read it)", word
        ) from e
    except hub_errors.RevisionNotFoundError as e:
        raise InvalidRequest(revision_field, f"a branch, tag or commit of {word} on the hub", revision) from e
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, ConnectionError) as e:
        if offline:
            hub_state = "the hub could not be reached (offline: HF_HUB_OFFLINE is set)"
        else:
            hub_state = f"the hub could not be reached ({type(e.__cause__ or e).__name__})"
        if revision is not None:
            hub_state += f" (revision {revision!r})"
        partial = getattr(e, "snapshot_path", None)  # IncompleteSnapshotError: a partial download
        raise ModelNotAvailable(word, cache_dir, hub_state, partial, field=field) from e
    except hub_errors.HFValidationError as e:
        raise InvalidRequest(field, "a valid Hugging Face hub id", word) from e

    folder = Path(folder)
    if not (folder / required).is_file():
        raise InvalidRequest(field, f"a hub repo with a {required} (none in {folder})", word)
    return folder
