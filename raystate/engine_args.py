"""The engine's user-facing knobs (`EngineArgs`) and the one builder that turns them into an `EngineConfig`.

Every front end takes the same knobs: `LLM(model, **kwargs)`, the Serve app's `AppArgs` (its engine
fields are generated from `EngineArgs`) and `raystate serve`'s flags (also generated). So a knob added
here reaches all three with one default, and every config is validated by the same code: the frozen
configs of `raystate.config`, whose errors name the field and the limit.

Model resolution, the step from a `--model` word to a model shape, its weights and its tokenizer, is
`resolve_model`, and only there. Standard library only (no torch, pydantic or Ray), like `raystate.config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from raystate.config import NAMED_MODELS, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from raystate.errors import InvalidRequest
from raystate.field_types import check_field_types, check_names
from raystate.tokenizer import ByteTokenizer

# Where the engine runs: "ray", a deployment of a scheduler actor and worker actors; "inprocess", the
# scheduler and one worker in the calling process (LLM) or in the Serve replica (the Serve app).
Backend = Literal["ray", "inprocess"]
BACKENDS: tuple[str, ...] = typing.get_args(Backend)

MODEL_CONFIG_FILE = "config.json"  # what makes a directory a save_pretrained model (raystate.model.weights)
# Set to 1 to serve a checkpoint past its max_position_embeddings (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN).
ALLOW_LONG_MAX_MODEL_LEN_ENV = "RAYSTATE_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class ResolvedModel:
    """What a model word stands for: the model's shape, where its weights are, which tokenizer it uses."""

    config: ModelConfig
    path: str | None = None  # a checkpoint folder; None: weights drawn from `config.seed`
    # "byte": ByteTokenizer (the reference models); otherwise the folder holding tokenizer.json (the
    # checkpoint's own, or the one given as `tokenizer`)
    tokenizer: str = "byte"
    dtype: str | None = None  # the checkpoint's own dtype (what dtype="auto" takes on CUDA); None: unknown
    # Where requests' default sampling fields come from: "auto" (the checkpoint folder's
    # generation_config.json), "vllm" (none: OpenAI's defaults) or a folder holding one.
    generation_config: str = "auto"
    # "org/name@commit" where `path` / `tokenizer` is a hub snapshot: how another node finds its own copy.
    hub: str | None = None
    tokenizer_hub: str | None = None

    @property
    def is_hf(self) -> bool:
        return self.config.architecture != "raystate_hybrid"


def resolve_model(
    model: str,
    max_model_len: int | None = None,
    *,
    revision: str | None = None,
    tokenizer: str | None = None,
    tokenizer_revision: str | None = None,
    generation_config: str = "auto",
) -> ResolvedModel:
    """A model word -> its ModelConfig, weights path and tokenizer choice: a named config ("tiny",
    "bench"), a folder holding a config.json (a Hugging Face checkpoint, or one of our own saves), or a
    Hugging Face hub id (downloaded once into the hub cache, where the network allows, at `revision`).

    The one place a `--model` / `model=` is interpreted. `max_model_len` replaces the model's own limit.
    `tokenizer` (a folder or hub id, at `tokenizer_revision`) replaces a checkpoint's own tokenizer and
    chat template. `generation_config` (vLLM's words: "auto", the checkpoint's; "vllm", none; or a
    folder holding a generation_config.json) picks where default sampling fields and EOS ids come from.
    A revision only means something for a hub id: given for anything else it is refused, as are a
    tokenizer and a generation config for a model that reads bytes.
    """
    if model in NAMED_MODELS:
        resolved = ResolvedModel(ModelConfig.named(model))
    elif os.path.isfile(os.path.join(model, MODEL_CONFIG_FILE)):
        resolved = _resolve_folder(model)
    elif os.path.exists(model):
        raise InvalidRequest(
            "model",
            f"a named model ({', '.join(sorted(NAMED_MODELS))}) or a folder holding {MODEL_CONFIG_FILE}",
            model,
        )
    else:
        from raystate.hf.hub import looks_like_hub_id, resolve_checkpoint_folder

        if not looks_like_hub_id(model):
            raise InvalidRequest(
                "model",
                f"a named model ({', '.join(sorted(NAMED_MODELS))}), a checkpoint folder or a hub id",
                model,
            )
        folder = resolve_checkpoint_folder(model, revision=revision)
        resolved = _resolve_folder(str(folder), name=model)
        resolved = dataclasses.replace(resolved, hub=f"{model}@{folder.name}")  # snapshots/<commit>
        revision = None  # used
    if revision is not None:
        raise InvalidRequest("revision", f"unset: model {model!r} is not a hub id", revision)
    if tokenizer is not None:
        if resolved.tokenizer == "byte":
            raise InvalidRequest(
                "tokenizer",
                f"unset: model {model!r} reads bytes (only a Hugging Face checkpoint takes one)",
                tokenizer,
            )
        from raystate.hf.hub import looks_like_hub_id, resolve_tokenizer_folder

        if tokenizer_revision is not None and (os.path.exists(tokenizer) or not looks_like_hub_id(tokenizer)):
            raise InvalidRequest(
                "tokenizer_revision", f"unset: tokenizer {tokenizer!r} is not a hub id", tokenizer_revision
            )
        folder = resolve_tokenizer_folder(tokenizer, revision=tokenizer_revision)
        hub = None if os.path.exists(tokenizer) else f"{tokenizer}@{folder.name}"
        resolved = dataclasses.replace(resolved, tokenizer=str(folder), tokenizer_hub=hub)
    elif tokenizer_revision is not None:
        raise InvalidRequest("tokenizer_revision", "unset: no tokenizer is given", tokenizer_revision)
    if generation_config != "auto":
        resolved = _with_generation_config(resolved, model, generation_config)
    if max_model_len is not None:
        resolved = dataclasses.replace(
            resolved, config=dataclasses.replace(resolved.config, max_model_len=max_model_len)
        )
    return resolved


def _with_generation_config(resolved: ResolvedModel, model: str, generation_config: str) -> ResolvedModel:
    """`resolved` with its sampling defaults from `generation_config` ("vllm": none; a folder: its
    generation_config.json, whose EOS ids then replace the checkpoint file's)."""
    if resolved.tokenizer == "byte":
        raise InvalidRequest(
            "generation_config", f"auto: model {model!r} has no generation_config.json", generation_config
        )
    if generation_config == "vllm":  # EOS ids stay the checkpoint's, as in vLLM
        return dataclasses.replace(resolved, generation_config="vllm")
    from raystate.hf.generation_config import GENERATION_CONFIG_FILE

    folder = os.path.abspath(os.path.expanduser(generation_config))
    if not os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE)):
        raise InvalidRequest(
            "generation_config",
            f"auto, vllm or a folder holding {GENERATION_CONFIG_FILE} ({folder} has none)",
            generation_config,
        )
    # config.json read again, for its own EOS ids without the checkpoint file's
    again = _resolve_folder(resolved.path, name=resolved.config.name, generation_folder=folder)
    return dataclasses.replace(resolved, config=again.config, generation_config=folder)


def resolve_engine_model(args: EngineArgs) -> ResolvedModel:
    """`resolve_model` of the model, revision and tokenizer knobs of `args`."""
    return resolve_model(
        args.model,
        revision=args.revision,
        tokenizer=args.tokenizer,
        tokenizer_revision=args.tokenizer_revision,
        generation_config=args.generation_config,
    )


def _resolve_folder(
    folder: str, name: str | None = None, generation_folder: str | None = None
) -> ResolvedModel:
    with open(os.path.join(folder, MODEL_CONFIG_FILE)) as f:
        cfg = json.load(f)
    from raystate.hf.model_config import config_dtype, is_hf_config, model_config_from_hf

    if not is_hf_config(cfg):  # one of our own saves (raystate.model.save_pretrained)
        return ResolvedModel(ModelConfig.from_dict(cfg), path=folder)
    from raystate.hf.generation_config import load_generation_defaults

    config = model_config_from_hf(cfg, name=name or os.path.basename(os.path.normpath(folder)))
    # Every id that ends a sequence: config.json's, then generation_config.json's (Llama 3 and Gemma 3
    # list several there); that file is the checkpoint's unless another folder's is given.
    eos = [i for i in config.eos_token_ids if i >= 0]
    eos += [i for i in load_generation_defaults(generation_folder or folder).eos_token_ids if i not in eos]
    if eos:
        config = dataclasses.replace(config, eos_token_id=eos[0], extra_eos_token_ids=tuple(eos[1:]))
    return ResolvedModel(config, path=folder, tokenizer=folder, dtype=config_dtype(cfg))


def load_tokenizer(model: ResolvedModel):
    """The tokenizer `resolve_model` chose for the model: ByteTokenizer or the checkpoint's
    (`raystate.hf.HFTokenizer`)."""
    if model.tokenizer == "byte":
        return ByteTokenizer()
    from raystate.hf import HFTokenizer

    return HFTokenizer.from_pretrained(model.tokenizer)


def _knob(default: Any, help: str) -> Any:
    """An EngineArgs field; `help` documents it for every front end (CLI help, the Serve args' schema)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineArgs:
    """The knobs a user sets, flat, with the defaults every front end shares. Only each value's type is
    checked here (`LLM(max_num_seqs="8")` is an error naming the field, not a TypeError from a range check
    deep inside); the configs `build_engine_config` builds check every range (errors name the field and
    the limit)."""

    model: str = _knob(
        "tiny",
        "a named model (tiny, bench), a Hugging Face checkpoint folder or hub id, or a saved raystate model",
    )
    revision: str | None = _knob(
        None, "the branch, tag or commit of a model given as a hub id (default: the hub's main)"
    )
    tokenizer: str | None = _knob(
        None,
        "a Hugging Face tokenizer (a folder holding tokenizer.json, or a hub id) used, with its chat "
        "template, instead of the checkpoint's (default: the checkpoint's)",
    )
    tokenizer_revision: str | None = _knob(
        None, "the branch, tag or commit of a tokenizer given as a hub id (default: the hub's main)"
    )
    generation_config: str = _knob(
        "auto",
        "where requests' default sampling fields come from: auto (the checkpoint's generation_config.json), "
        "vllm (none of it: OpenAI's defaults; its EOS ids still end requests) or a folder holding a "
        "generation_config.json (its defaults and EOS ids)",
    )
    max_model_len: int | None = _knob(
        None, "longest request (prompt + output) in tokens (default: the model's)"
    )
    device: str = _knob("cpu", "cpu or cuda[:N]")
    dtype: str = _knob("auto", "auto (float32 on the CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    seed: int = _knob(0, "seed of the random draws of requests that send no seed of their own")
    cuda_graphs: bool = _knob(True, "capture decode-only steps in CUDA graphs (ignored on the CPU)")
    async_scheduling: bool = _knob(True, "plan and send the next decode step while the current one runs")
    block_size: int = _knob(16, "tokens per KV cache block (a power of two <= 128)")
    num_blocks: int | None = _knob(None, "KV blocks per cache group and shard (instead of kv_cache_bytes)")
    kv_cache_bytes: int | None = _knob(
        None,
        "KV cache bytes per shard, split across the attention groups; default: on CUDA, sized from "
        "gpu_memory_utilization; on the CPU, from max_num_seqs and the model's max length",
    )
    gpu_memory_utilization: float | None = _knob(
        None,
        "with no KV size set on CUDA: the share of the device's memory that weights, buffers and the KV "
        "cache fill (default 0.9); the KV cache takes what the others leave of it",
    )
    enable_prefix_caching: bool = _knob(True, "reuse the KV of cached prompt prefixes")
    swa_bounded_replay: bool = _knob(
        True, "keep sliding-window KV out of the prefix cache and replay the window after a hit"
    )
    share_replay: bool = _knob(
        True, "requests admitted in one step with the same replayed hit rebuild its window once"
    )
    max_num_seqs: int = _knob(64, "most requests running at once per shard")
    max_num_batched_tokens: int = _knob(2048, "most tokens in one step per shard")
    long_prefill_token_threshold: int = _knob(
        0, "when > 0, the most tokens one prefill chunk takes (so long prompts don't starve decodes)"
    )

    def __post_init__(self) -> None:
        check_field_types(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keyword arguments, an unknown name refused with the list of knobs (rather than
        dataclasses' TypeError)."""
        check_names(cls, kwargs, "an engine knob")
        return cls(**kwargs)


@dataclass(frozen=True)
class Knob:
    """One EngineArgs field as a front end declares it."""

    name: str
    annotation: Any  # the field's type, e.g. `int | None`
    value_type: type  # the type of a value that is set: bool, int, float or str
    default: Any
    help: str


def knobs() -> tuple[Knob, ...]:
    """The EngineArgs fields in declaration order, with their types resolved (for generated flags and
    Serve args)."""
    hints = typing.get_type_hints(EngineArgs)
    out = []
    for f in dataclasses.fields(EngineArgs):
        set_types = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
        value_type = set_types[0] if set_types else hints[f.name]
        out.append(Knob(f.name, hints[f.name], value_type, f.default, f.metadata["help"]))
    return tuple(out)


def build_engine_config(args: EngineArgs, model: ResolvedModel | None = None) -> EngineConfig:
    """The validated EngineConfig of `args`.

    `model`: the model, already resolved (the caller also needs its tokenizer) or made by hand (tests and
    benchmarks with their own shapes); None resolves `args.model`. `args.max_model_len`, when set,
    replaces the model's own limit.
    """
    if model is None:
        model = resolve_engine_model(args)
    model_config = model.config
    if args.max_model_len is not None:
        longest = model_config.max_model_len
        if (
            model.is_hf
            and isinstance(args.max_model_len, int)
            and args.max_model_len > longest
            and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV) != "1"
        ):
            # positions past what the model was trained (and its rope scaled) for give wrong outputs
            raise InvalidRequest(
                "max_model_len",
                f"<= {longest}, the checkpoint's max_position_embeddings (set "
                f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to go past it)",
                args.max_model_len,
            )
        model_config = dataclasses.replace(model_config, max_model_len=args.max_model_len)
    dtype = args.dtype
    if dtype == "auto" and model.dtype in ("bfloat16", "float16") and args.device != "cpu":
        dtype = model.dtype  # a checkpoint runs in its own half dtype on CUDA (float32 ones in bf16)
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_bytes=args.kv_cache_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            swa_bounded_replay=args.swa_bounded_replay,
            share_replay=args.share_replay,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ),
        device=args.device,
        dtype=dtype,
        seed=args.seed,
        cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling,
        model_path=model.path,
        tokenizer_path=model.tokenizer if model.tokenizer not in ("byte", model.path) else None,
        generation_config=model.generation_config,
        model_hub=model.hub,
        tokenizer_hub=model.tokenizer_hub if model.tokenizer != model.path else None,
    )


def with_local_checkpoint(config: EngineConfig) -> EngineConfig:
    """`config` with its checkpoint and tokenizer folders on this node: a hub snapshot that the node
    which resolved the model has and this one lacks (a worker or replica on another node of the cluster)
    is found in, or downloaded into, this node's hub cache at the same commit. Folders the user gave are
    taken as they are (they must be on every node, as vLLM requires)."""
    changes = {}
    for field_name, hub_name in (("model_path", "model_hub"), ("tokenizer_path", "tokenizer_hub")):
        path, hub = getattr(config, field_name), getattr(config, hub_name)
        if path is None or hub is None or os.path.isdir(path):
            continue
        from raystate.hf.hub import resolve_checkpoint_folder, resolve_tokenizer_folder

        resolve = resolve_checkpoint_folder if field_name == "model_path" else resolve_tokenizer_folder
        repo, commit = hub.rsplit("@", 1)
        changes[field_name] = str(resolve(repo, revision=commit))
    return dataclasses.replace(config, **changes) if changes else config
