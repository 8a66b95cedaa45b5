"""Frozen configuration for the model, the KV cache, the scheduler and the engine.

Plain dataclasses, validated once in `__post_init__` (errors name the field and the limit), no I/O and no
torch, so the scheduler can import them. Derived values are properties, never written back; the KV cache's
groups and pool sizes come from `raystate.kv_layout`. Users build an `EngineConfig` from their knobs through
`raystate.engine_args.build_engine_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from raystate.errors import InvalidRequest
from raystate.kv_layout import (
    KVCacheGroupSpec,
    group_num_blocks,
    kv_cache_group_specs,
    kv_element_bytes,
    kv_summary,
)

LayerType = Literal["sliding", "full"]

# Byte-level vocabulary of the reference model: 256 bytes, then the specials.
NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_VOCAB_SIZE = 259

# The share of a CUDA device's memory an engine takes when nothing else sizes its KV cache (vLLM's
# default too): weights, buffers and the KV cache fill up to it; the rest holds activations and graphs.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def _check(ok: bool, field_name: str, limit: str, got: object) -> None:
    if not ok:
        raise InvalidRequest(field_name, limit, got)


RopeType = Literal["default", "linear", "llama3", "yarn"]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type: its base and, for long-context variants, how the frequencies are
    rescaled (the `rope_type`s of Hugging Face configs that we implement; `raystate.model.rope` computes
    them as transformers does, bit for bit in fp32)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0  # linear, llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range outward
    attention_factor: float = 1.0  # yarn: cos and sin are both scaled by it

    def __post_init__(self) -> None:
        _check(
            self.rope_type in ("default", "linear", "llama3", "yarn"),
            "rope_type",
            "one of default, linear, llama3, yarn",
            self.rope_type,
        )
        _check(self.theta > 0, "rope_theta", "> 0", self.theta)
        _check(self.factor > 0, "rope factor", "> 0", self.factor)
        if self.rope_type in ("llama3", "yarn"):
            _check(
                self.original_max_position_embeddings > 0,
                "original_max_position_embeddings",
                f"> 0 for rope_type {self.rope_type}",
                self.original_max_position_embeddings,
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a model: our reference hybrid (`architecture` "raystate_hybrid", `raystate.model.TinyHybrid`)
    or a Hugging Face dense decoder family (`raystate.model.DecoderLM`; `raystate.hf.model_config` builds it
    from config.json). The fields after `seed` only matter to the Hugging Face families; their defaults are
    the reference model's (no biases, pre-norm, SwiGLU, one rope for every layer)."""

    name: str = "tiny"
    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    # One entry per layer: "sliding" (window attention, not prefix-cacheable) or "full".
    layer_types: tuple[str, ...] = ("sliding", "full", "sliding", "full")
    sliding_window: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_model_len: int = 2048
    # Engram n-gram memory (DESIGN section 2).
    engram_layer_ids: tuple[int, ...] = (1, 2)
    engram_max_ngram: int = 4
    engram_heads: int = 2
    engram_vocab_size: int = 1000
    engram_head_dim: int = 16
    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    pad_token_id: int = PAD_ID
    seed: int = 0
    # Which forward: "raystate_hybrid", or the Hugging Face family whose numerics the fields below describe
    # ("llama", "qwen2", "qwen3", "mistral", "ministral", "gemma3_text", "olmo3").
    architecture: str = "raystate_hybrid"
    attention_bias: bool = False  # q, k, v projections have a bias
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # RMSNorm of q and k before the rotation: "none"; "head", over each head (Qwen3, Gemma 3); "projection",
    # over the whole q or k projection (OLMo 3).
    qk_norm: str = "none"
    # Where the norms sit: "pre" (input and post-attention norms, Llama); "sandwich" (four per layer: before
    # and after attention and the MLP, Gemma 3); "post" (after attention and after the MLP only, OLMo 3).
    norm_layout: str = "pre"
    norm_weight_offset: float = 0.0  # Gemma: x * (1 + w)
    embed_scale: float = 1.0  # Gemma: sqrt(hidden), rounded to the weights' dtype as the original does
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    hidden_act: str = "silu"  # the MLP gate: "silu" or "gelu_tanh"
    tie_word_embeddings: bool = False
    # Per layer type; None: the default rope with `rope_theta` (the reference model).
    rope_full: RopeConfig | None = None
    rope_sliding: RopeConfig | None = None
    # More ids that end a sequence, besides eos_token_id (a generation_config.json may list several).
    extra_eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(self.hidden_size > 0, "hidden_size", "> 0", self.hidden_size)
        _check(
            self.num_heads % max(self.num_kv_heads, 1) == 0 and self.num_kv_heads > 0,
            "num_kv_heads",
            f"a divisor of num_heads={self.num_heads}",
            self.num_kv_heads,
        )
        _check(len(self.layer_types) > 0, "layer_types", "non-empty", self.layer_types)
        for t in self.layer_types:
            _check(t in ("sliding", "full"), "layer_types", "'sliding' or 'full' per layer", t)
        _check(self.sliding_window >= 1, "sliding_window", ">= 1", self.sliding_window)
        _check(self.engram_max_ngram >= 2, "engram_max_ngram", ">= 2", self.engram_max_ngram)
        for lid in self.engram_layer_ids:
            _check(
                0 <= lid < len(self.layer_types), "engram_layer_ids", f"in [0, {len(self.layer_types)})", lid
            )
        _check(self.max_model_len >= 2, "max_model_len", ">= 2", self.max_model_len)
        _check(
            self.qk_norm in ("none", "head", "projection"),
            "qk_norm",
            "none, head or projection",
            self.qk_norm,
        )
        _check(
            self.norm_layout in ("pre", "sandwich", "post"),
            "norm_layout",
            "pre, sandwich or post",
            self.norm_layout,
        )
        _check(self.hidden_act in ("silu", "gelu_tanh"), "hidden_act", "silu or gelu_tanh", self.hidden_act)
        if self.architecture != "raystate_hybrid":
            _check(
                not self.engram_layer_ids,
                "engram_layer_ids",
                "empty for a Hugging Face family",
                self.engram_layer_ids,
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def token_lookback_depth(self) -> int:
        """D = N - 1: ids before a chunk start that the engram hash needs; 0 without engram layers (no
        lookback buffer is gathered)."""
        return self.engram_max_ngram - 1 if self.engram_layer_ids else 0

    @property
    def probe_token_id(self) -> int:
        """A valid id for health probes' one-token prompts: BOS, else EOS (Qwen sets no BOS), else 0."""
        for token in (self.bos_token_id, self.eos_token_id):
            if 0 <= token < self.vocab_size:
                return token
        return 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence: eos_token_id first, then the extra ones."""
        return (self.eos_token_id, *(i for i in self.extra_eos_token_ids if i != self.eos_token_id))

    def rope_for(self, layer_type: str) -> RopeConfig:
        """The rotary embedding of a layer type ("sliding" or "full")."""
        rope = self.rope_sliding if layer_type == "sliding" else self.rope_full
        return rope if rope is not None else RopeConfig(theta=self.rope_theta)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}
        for key in ("rope_full", "rope_sliding"):
            if isinstance(kw.get(key), dict):
                kw[key] = RopeConfig(**kw[key])
        return cls(**kw)

    @classmethod
    def named(cls, name: str) -> ModelConfig:
        if name not in NAMED_MODELS:
            raise InvalidRequest("model", f"one of {sorted(NAMED_MODELS)} or a model directory", name)
        return NAMED_MODELS[name]


NAMED_MODELS: dict[str, ModelConfig] = {
    # CPU-fast, about 1 MB of weights.
    "tiny": ModelConfig(),
    # ~1.1B parameters for GPU benchmarks: 3 of every 4 layers sliding-window (W = 128).
    "bench": ModelConfig(
        name="bench",
        hidden_size=2048,
        intermediate_size=5632,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        layer_types=tuple("full" if i % 4 == 3 else "sliding" for i in range(24)),
        sliding_window=128,
        max_model_len=16384,
        engram_layer_ids=(1, 12),
        engram_heads=4,
        engram_vocab_size=20000,
        engram_head_dim=64,
    ),
}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # per group and shard, the same for every group
    # Per shard: the KV cache's bytes, split across the groups by `raystate.kv_layout.plan_group_blocks`
    # (window groups get their working set, the prefix-cacheable groups the rest). Neither set: sized from
    # max_num_seqs and max_model_len, the same for every group.
    kv_cache_bytes: int | None = None
    # On CUDA with neither size set, each worker sizes its cache at start: this share of the device's
    # memory is the worker's, its weights and buffers take their part and the KV cache the rest
    # (`raystate.worker.kv_cache.auto_kv_budget`); above the share: activations, CUDA graphs, the CUDA
    # context. None: DEFAULT_GPU_MEMORY_UTILIZATION (times the GPU fraction of shards that share one).
    # Not used on the CPU.
    gpu_memory_utilization: float | None = None
    # Blocks per group, in `kv_groups` order: what the start-up sizing resolved (the smallest count of
    # every shard, `EngineConfig.with_group_blocks`); set by the engine, not by users.
    group_blocks: tuple[int, ...] | None = None
    enable_prefix_caching: bool = True
    swa_bounded_replay: bool = True
    # Requests admitted in one step with the same replayed hit rebuild its window once: the first
    # replays it, the others borrow its window blocks and start at the hit (KVManager.admit_chunk).
    share_replay: bool = True

    def __post_init__(self) -> None:
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            "a power of two <= 128",
            self.block_size,
        )
        if self.num_blocks is not None:
            _check(self.num_blocks >= 2, "num_blocks", ">= 2 (one is the null block)", self.num_blocks)
        if self.kv_cache_bytes is not None:
            _check(
                self.num_blocks is None, "kv_cache_bytes", "unset when num_blocks is set", self.kv_cache_bytes
            )
            _check(self.kv_cache_bytes > 0, "kv_cache_bytes", "> 0", self.kv_cache_bytes)
        if self.gpu_memory_utilization is not None:
            u = self.gpu_memory_utilization
            _check(0.0 < u <= 1.0, "gpu_memory_utilization", "in (0, 1]", u)
            _check(
                self.num_blocks is None and self.kv_cache_bytes is None,
                "gpu_memory_utilization",
                "unset when num_blocks or kv_cache_bytes sizes the cache",
                u,
            )
        if self.group_blocks is not None:
            _check(
                self.num_blocks is None and self.kv_cache_bytes is None,
                "group_blocks",
                "unset when num_blocks or kv_cache_bytes sizes the cache",
                self.group_blocks,
            )
            _check(
                len(self.group_blocks) > 0 and min(self.group_blocks) >= 2,
                "group_blocks",
                "each >= 2 (one is the null block)",
                self.group_blocks,
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prefill chunk takes at most this many tokens when > 0 (so long prompts don't starve decodes).
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(
            self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens
        )
        _check(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            ">= 0",
            self.long_prefill_token_threshold,
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    dtype: str = "auto"  # "auto": float32 on the CPU, bfloat16 on CUDA; or float32 / bfloat16 / float16
    seed: int = 0
    cuda_graphs: bool = True  # capture decode-only steps on CUDA (ignored on the CPU)
    # Plan and send the next decode step while the current one runs (the in-process engine overlaps the
    # scheduler's work with the device's; see Scheduler.schedule(lookahead=True)).
    async_scheduling: bool = True
    model_path: str | None = None  # a save_pretrained directory; None: seeded weights of `model`
    # A tokenizer folder given apart from the checkpoint (`tokenizer`); None: the checkpoint's own.
    tokenizer_path: str | None = None
    # Where requests' default sampling fields come from: "auto" (model_path's generation_config.json),
    # "vllm" (none), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # "org/name@commit" where model_path / tokenizer_path is a hub snapshot, so that a node without
    # that folder fetches its own copy (raystate.engine_args.with_local_checkpoint).
    model_hub: str | None = None
    tokenizer_hub: str | None = None

    def __post_init__(self) -> None:
        _check(
            self.cache.gpu_memory_utilization is None or self.device != "cpu",
            "gpu_memory_utilization",
            "unset on the CPU (size the CPU's cache with num_blocks or kv_cache_bytes)",
            self.cache.gpu_memory_utilization,
        )
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            "one of auto, float32, bfloat16, float16",
            self.dtype,
        )
        _check(
            self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            "'cpu' or 'cuda[:N]'",
            self.device,
        )

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def kv_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return kv_cache_group_specs(self.model, self.cache.block_size, self.cache.swa_bounded_replay)

    @property
    def kv_element_bytes(self) -> int:
        """Bytes of one KV element: 2 for bf16/fp16 (what "auto" gives on CUDA), 4 for fp32."""
        return kv_element_bytes(self.dtype, self.device)

    @property
    def kv_sized_at_start(self) -> bool:
        """True while the KV cache's size is still to be measured: on CUDA, with no num_blocks,
        kv_cache_bytes or resolved group_blocks (each worker sizes it from gpu_memory_utilization; the
        engine then runs `with_group_blocks` of the smallest)."""
        c = self.cache
        return (
            self.device != "cpu"
            and c.num_blocks is None
            and c.kv_cache_bytes is None
            and c.group_blocks is None
        )

    @property
    def gpu_memory_utilization(self) -> float:
        u = self.cache.gpu_memory_utilization
        return DEFAULT_GPU_MEMORY_UTILIZATION if u is None else u

    def with_group_blocks(self, counts: tuple[int, ...]) -> EngineConfig:
        """This config with the KV cache's blocks per group fixed (what start-up sizing measured)."""
        cache = dataclasses.replace(self.cache, gpu_memory_utilization=None, group_blocks=tuple(counts))
        _check(
            len(cache.group_blocks) == len(self.kv_groups),
            "group_blocks",
            f"one count per KV cache group ({len(self.kv_groups)})",
            cache.group_blocks,
        )
        return dataclasses.replace(self, cache=cache)

    @property
    def group_num_blocks(self) -> tuple[int, ...]:
        """Blocks per shard of each KV cache group, in `kv_groups` order (block 0 of each is null)."""
        if self.kv_sized_at_start:
            raise RuntimeError(
                "the KV cache of a CUDA engine with no num_blocks / kv_cache_bytes is sized by its workers "
                "at start: use the config the engine returns (LLM.config, client.config)"
            )
        return self.static_group_blocks()

    def static_group_blocks(self) -> tuple[int, ...]:
        """The blocks per group that the config's own sizes give (no device measured): with none set, the
        small default, room for min(max_num_seqs, 16) requests of max_model_len tokens (a dry run's)."""
        return group_num_blocks(
            self.kv_groups, self.cache, self.scheduler, self.max_model_len, self.kv_element_bytes
        )

    def kv_summary(self) -> str:
        """The KV cache in words (groups, blocks, bytes, what a cached prefix keeps), for the CLI and logs."""
        if self.kv_sized_at_start:
            return (
                f"KV cache: sized by each worker at start, {self.gpu_memory_utilization:g} of the device's "
                "memory less what the weights and buffers hold (gpu_memory_utilization)"
            )
        return kv_summary(self.kv_groups, self.group_num_blocks, self.kv_element_bytes)

    @property
    def num_blocks(self) -> int:
        """Blocks per shard of the largest group (the prefix-cacheable one when pools differ)."""
        return max(self.group_num_blocks)
