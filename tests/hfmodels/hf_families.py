"""Tiny random Hugging Face checkpoints of several model families, and transformers' greedy output on them.

Each checkpoint is a folder as a hub download looks: `config.json`, float32 safetensors weights (sharded for
"qwen3"), a tokenizer with its chat template (the makers of tests/hf/hf_checkpoint.py) and a
`generation_config.json`. The models are small (hidden 64, 4-6 layers) with sliding-window layers mixed with
full-attention ones, grouped-query attention and the family's RoPE variant, so that a paged implementation
can be compared token for token against transformers.

Transformers' default initialisation (std 0.02) gives outputs that hardly depend on the input, so the
weights are redrawn (`_redraw`): linear weights with std `LINEAR_GAIN / sqrt(fan_in)`, embeddings with std
1, norm weights `1 + N(0, 0.1)` (Gemma's `1 + w` norms: `w ~ N(0, 0.1)`), biases `N(0, 0.1)`. Tied
embeddings are drawn smaller, else the current token's own embedding dominates the logits and greedy repeats
one token: std 0.25 for qwen3, 0.02 for gemma3 (which multiplies them by sqrt(hidden) = 8; its final norm
weight is drawn around 7, a scale 1 + w ~ 8, so its logits have std ~1). With these, greedy continuations of
a prompt several windows long change when the window is enlarged and are diverse (the tests check it); the
greedy top-1/top-2 logit margins are mostly 0.1-1, rarely below 0.01.

The "spm" tokenizer is rebuilt here (`_spm_tokenizer`) because hf_checkpoint's trains a different vocabulary
in each process (its `limit_alphabet` breaks frequency ties at random).

Families: "qwen3", "qwen2", "mistral" (all layers sliding), "ministral" (per-layer `layer_types`), "llama"
(full attention, llama3 RoPE), "gemma3" (5 sliding : 1 full, per-layer-type RoPE), "gemma3_legacy" (the
same weights with config.json in the older Gemma 3 format) and "olmo3" (3 sliding : 1 full, YaRN).
"""

from __future__ import annotations

import collections
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

_HF_TESTS = str(Path(__file__).resolve().parent.parent / "hf")
if _HF_TESTS not in sys.path:
    sys.path.insert(0, _HF_TESTS)

import hf_checkpoint  # noqa: E402

FAMILIES: tuple[str, ...] = (
    "qwen3",
    "qwen2",
    "mistral",
    "ministral",
    "llama",
    "gemma3",
    "gemma3_legacy",
    "olmo3",
)

SEED = 1234
LINEAR_GAIN = 1.25  # linear weights ~ N(0, (LINEAR_GAIN / sqrt(fan_in))^2)
EMBED_STD = 1.0
NORM_STD = 0.1
BIAS_STD = 0.1

S, F = "sliding_attention", "full_attention"

# Per family: tokenizer maker, config class, model class, config fields, generation_config.json fields.
# Token ids (bos/eos/pad) are filled in from the tokenizer; "eos" names the tokens of the generation config.
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=4096,
    dtype="float32",
)

_SPECS: dict[str, dict] = {
    "qwen3": dict(
        tokenizer="chatml",
        config=transformers.Qwen3Config,
        model=transformers.Qwen3ForCausalLM,
        fields=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # 4 * 32 = 128 != hidden 64
            layer_types=[S, F, S, S, F],
            use_sliding_window=True,
            sliding_window=24,
            max_window_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=True,  # as the small Qwen3 checkpoints (0.6B-4B)
        ),
        eos=["<|im_end|>", "<|endoftext|>"],
        generation=dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=20),
        shard="200KB",
        embed_std=0.25,  # tied: at std 1 the current token's embedding dominates and greedy repeats it
    ),
    "qwen2": dict(
        tokenizer="chatml",
        config=transformers.Qwen2Config,
        model=transformers.Qwen2ForCausalLM,
        fields=dict(
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            # no layer_types: 5.24 derives them, sliding iff layer index >= max_window_layers -> f, f, s, s, s
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        eos=["<|im_end|>"],
        generation=dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    ),
    "mistral": dict(
        tokenizer="llama3",
        config=transformers.MistralConfig,
        model=transformers.MistralForCausalLM,
        fields=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=32,  # every layer
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
        eos=["<|eot_id|>"],
        generation=dict(),
    ),
    "ministral": dict(
        tokenizer="llama3",
        config=transformers.MinistralConfig,
        model=transformers.MinistralForCausalLM,
        fields=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            layer_types=[S, F, S, F],
            sliding_window=24,
            rope_parameters={"rope_type": "default", "rope_theta": 100_000_000.0},
        ),
        eos=["<|eot_id|>", "<|end_of_text|>"],
        generation=dict(do_sample=True, temperature=0.7),
    ),
    "llama": dict(
        tokenizer="llama3",
        config=transformers.LlamaConfig,
        model=transformers.LlamaForCausalLM,
        fields=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        eos=["<|end_of_text|>", "<|eot_id|>"],
        generation=dict(do_sample=True, temperature=0.6, top_p=0.9),
    ),
    "gemma3": dict(
        tokenizer="spm",
        config=transformers.Gemma3TextConfig,
        model=transformers.Gemma3ForCausalLM,
        fields=dict(
            num_hidden_layers=6,  # default pattern 6: layers 0-4 sliding, 5 full
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=16,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters={
                S: {"rope_type": "default", "rope_theta": 10_000.0},
                F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            },
        ),
        eos=["<eos>", "<end_of_turn>"],
        generation=dict(do_sample=True, top_k=64, top_p=0.95),
        embed_std=0.02,  # times embed_scale sqrt(64) = 8; larger makes greedy repeat one token
        final_norm_mean=7.0,  # final norm scale 1 + w ~ 8: tied logits of std ~1 (not ~0.15)
    ),
    "olmo3": dict(
        tokenizer="chatml",
        config=transformers.Olmo3Config,
        model=transformers.Olmo3ForCausalLM,
        fields=dict(
            num_hidden_layers=4,  # default pattern: (i + 1) % 4 != 0 sliding -> s, s, s, f
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=32,
            rope_parameters={
                S: {"rope_type": "default", "rope_theta": 500_000.0},
                F: {
                    "rope_type": "yarn",
                    "rope_theta": 500_000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        ),
        eos=["<|endoftext|>", "<|im_end|>"],
        generation=dict(do_sample=True, temperature=0.6, top_p=0.95),
    ),
}


def _spm_tokenizer() -> Tokenizer:
    """hf_checkpoint's "spm" tokenizer, made deterministic: its trainer keeps 70 characters of the corpus
    (`limit_alphabet`) and breaks ties between equally frequent ones differently in every process, so the
    vocabulary changes from run to run. Here the 70 are chosen beforehand (by frequency, then character)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in hf_checkpoint.CORPUS:
        counts.update("▁" + line.replace(" ", "▁"))
    alphabet = sorted(counts, key=lambda c: (-counts[c], c))[:70]
    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=2,
        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(hf_checkpoint.CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for b in range(256):
        if f"<0x{b:02X}>" not in vocab:
            vocab[f"<0x{b:02X}>"] = next_id
            next_id += 1
    return Tokenizer.from_str(json.dumps(data))


def _make_spm(folder: Path) -> Path:
    """As hf_checkpoint's "spm" checkpoint (Gemma-style: <bos> added, template in tokenizer_config.json)."""
    hf_checkpoint._save(
        _spm_tokenizer(),
        folder,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        extra_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        chat_template=hf_checkpoint.GEMMA_TEMPLATE,
    )
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = hf_checkpoint.GEMMA_TEMPLATE
    cfg.update(add_bos_token=True, add_eos_token=False)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return folder


_TOKENIZERS = {
    "chatml": hf_checkpoint.MAKERS["chatml"],
    "llama3": hf_checkpoint.MAKERS["llama3"],
    "spm": _make_spm,
}


def _ids(tok, names: list[str]) -> list[int]:
    ids = [tok.convert_tokens_to_ids(n) for n in names]
    assert all(isinstance(i, int) and i != tok.unk_token_id for i in ids), (names, ids)
    return ids


@torch.no_grad()
def _redraw(
    model: torch.nn.Module, zero_centered_norms: bool, embed_std: float, final_norm_mean: float, seed: int
) -> None:
    """Redraw every parameter (deterministically, in name order) at scales where the output depends on the
    input and on the attention window."""
    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)

    done: set[int] = set()
    modules = sorted(model.named_modules(), key=lambda kv: kv[0])
    # Embeddings first: a tied lm_head shares their weight, which must be drawn as an embedding.
    modules.sort(key=lambda kv: not isinstance(kv[1], torch.nn.Embedding))
    for name, module in modules:
        for pname, p in sorted(module.named_parameters(recurse=False), key=lambda kv: kv[0]):
            if id(p) in done:  # tied lm_head
                continue
            done.add(id(p))
            if isinstance(module, torch.nn.Linear):
                if pname == "weight":
                    normal(p, LINEAR_GAIN / math.sqrt(p.shape[1]))
                else:
                    normal(p, BIAS_STD)
            elif isinstance(module, torch.nn.Embedding):
                normal(p, embed_std)
            elif "norm" in type(module).__name__.lower():
                mean = 0.0 if zero_centered_norms else 1.0
                normal(p, NORM_STD, mean=final_norm_mean if name == "model.norm" else mean)
            else:
                raise AssertionError(f"unexpected parameter {type(module).__name__}.{pname}")


def _write_generation_config(folder: Path, tok, spec: dict) -> None:
    eos = _ids(tok, spec["eos"])
    cfg = {"eos_token_id": eos[0] if len(eos) == 1 else eos, **spec["generation"]}
    if tok.bos_token_id is not None:
        cfg["bos_token_id"] = tok.bos_token_id
    if tok.pad_token_id is not None:
        cfg["pad_token_id"] = tok.pad_token_id
    cfg["transformers_version"] = "5.0.0"
    (folder / "generation_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _make(family: str, folder: Path) -> Path:
    spec = _SPECS[family]
    folder.mkdir(parents=True, exist_ok=True)
    _TOKENIZERS[spec["tokenizer"]](folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    eos = _ids(tok, spec["eos"])
    config = spec["config"](
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=tok.pad_token_id,
        **_COMMON,
        **spec["fields"],
    )
    torch.manual_seed(SEED)
    model = spec["model"](config).to(torch.float32).eval()
    _redraw(
        model,
        zero_centered_norms=family.startswith("gemma"),
        embed_std=spec.get("embed_std", EMBED_STD),
        final_norm_mean=spec.get("final_norm_mean", 0.0 if family.startswith("gemma") else 1.0),
        seed=SEED + sum(map(ord, family)),
    )
    kwargs = {"max_shard_size": spec["shard"]} if "shard" in spec else {}
    model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    _write_generation_config(folder, tok, spec)  # after save_pretrained, which writes its own
    return folder


# The older Gemma 3 config.json format (transformers 4.5x): top-level rope fields, `sliding_window_pattern`,
# `torch_dtype`, no `layer_types` / `rope_parameters`.
_GEMMA3_LEGACY_DROP = ("layer_types", "rope_parameters", "dtype")
_GEMMA3_LEGACY_ADD = {
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window_pattern": 6,
    "torch_dtype": "float32",
    "transformers_version": "4.50.0.dev0",
}


def _make_gemma3_legacy(folder: Path, gemma3: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in sorted(gemma3.iterdir()):
        shutil.copyfile(f, folder / f.name)
    cfg = json.loads((gemma3 / "config.json").read_text())
    for key in _GEMMA3_LEGACY_DROP:
        cfg.pop(key, None)
    cfg.update(_GEMMA3_LEGACY_ADD)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return folder


def make_family_checkpoint(family: str, folder: Path) -> Path:
    """Write the tiny checkpoint of `family` into `folder` (created) and return it; the same bytes every
    time."""
    folder = Path(folder)
    if family == "gemma3_legacy":
        source = folder.parent / f".{folder.name}_gemma3"
        _make("gemma3", source)
        _make_gemma3_legacy(folder, source)
        shutil.rmtree(source)
        return folder
    if family not in _SPECS:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    return _make(family, folder)


def make_all(root: Path, families: tuple[str, ...] = FAMILIES) -> dict[str, Path]:
    """All checkpoints under `root`, the legacy Gemma 3 one copied from "gemma3" when both are asked."""
    root = Path(root)
    out: dict[str, Path] = {}
    for family in families:
        if family == "gemma3_legacy" and "gemma3" in out:
            out[family] = _make_gemma3_legacy(root / family, out["gemma3"])
        else:
            out[family] = make_family_checkpoint(family, root / family)
    return out


def load_model(folder: Path, **config_overrides) -> transformers.PreTrainedModel:
    """transformers' model of a checkpoint in float32, eval mode; `config_overrides` go to the config."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **config_overrides
    )
    return model.eval()


@torch.no_grad()
def greedy(
    model: transformers.PreTrainedModel, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """`generate` with do_sample=False and EOS off (exactly `max_new_tokens` new tokens), one prompt at a
    time."""
    cfg = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    # generate merges the checkpoint's generation_config.json into `cfg` for every field left at its
    # default (EOS, repetition_penalty, ...): start from a blank one, so plain greedy is what runs.
    model.generation_config = transformers.GenerationConfig(eos_token_id=None, pad_token_id=0)
    out: list[list[int]] = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        new = seq[0, len(prompt) :].tolist()
        assert len(new) == max_new_tokens, (len(new), max_new_tokens)
        out.append(new)
    return out


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation (new tokens only, exactly `max_new_tokens` each) of every prompt."""
    return greedy(load_model(folder), prompts, max_new_tokens)


@torch.no_grad()
def hf_logits(
    folder: Path, ids: list[int], model: transformers.PreTrainedModel | None = None
) -> torch.Tensor:
    """fp32 [len(ids), vocab] logits of one full forward over `ids`."""
    model = model if model is not None else load_model(folder)
    return model(torch.tensor([ids], dtype=torch.long)).logits[0].float()


def prompt_ids(folder: Path, length: int, seed: int) -> list[int]:
    """`length` token ids: random ids in [0, vocab) without the special tokens, deterministic in `seed`
    (and the tokenizer); a checkpoint whose tokenizer adds a BOS gets it first."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    special = set(tok.all_special_ids) | {tok.convert_tokens_to_ids(t) for t in tok.get_added_vocab()}
    allowed = torch.tensor(sorted(set(range(len(tok))) - special), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    ids = allowed[torch.randint(len(allowed), (length,), generator=gen)].tolist()
    bos = tok.bos_token_id
    if length and bos is not None and tok("a")["input_ids"][:1] == [bos]:
        ids[0] = bos
    return ids
