"""Hugging Face families at real shapes on one GPU: random checkpoints with the shapes of a Gemma-3-4B-class
and a Qwen3-8B-class model, written as transformers writes them; then, per shape, in one run:

1. exactness: transformers' greedy tokens (float32, `generate`) equal ours (float32, in-process engine, CUDA
   graphs) for a few prompts longer than the sliding window;
2. weight loading: our loader (safetensors, memory-mapped, straight to the GPU in bf16) in GB/s, side by
   side with a plain read of the same files (both from the page cache, which writing the checkpoint
   warmed; the ratio is the loader's overhead over reading the bytes).

The decode step and prefix reuse at these shapes run through bench_decode.py and bench_prefix.py with
`--model <folder>` (bench/gpu_run.sh hf).

    python3 bench/bench_hf_models.py --shape gemma3-4b --root /tmp/hf_ckpt [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {
    # Gemma 3 4B's text shape: 34 layers, 5 sliding (W 1024) : 1 full, head_dim 256, GQA 8:4.
    "gemma3-4b": dict(
        cls="Gemma3TextConfig",
        arch="Gemma3ForCausalLM",
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=262208,
        sliding_window=1024,
        query_pre_attn_scalar=256,
        max_position_embeddings=131072,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    # Qwen3 8B: 36 layers, all full attention (as released), head_dim 128, GQA 32:8, q/k norms.
    "qwen3-8b": dict(
        cls="Qwen3Config",
        arch="Qwen3ForCausalLM",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}


def make_checkpoint(shape: str, folder: Path) -> Path:
    """A random bf16 checkpoint of `shape` in `folder` (config through transformers, weights drawn on the
    GPU at scales where outputs depend on the input, sharded safetensors as save_pretrained writes them),
    plus a small trained tokenizer (tests/hf's chatml maker)."""
    import transformers

    if (folder / "config.json").exists():
        return folder
    spec = dict(SHAPES[shape])
    cfg = getattr(transformers, spec.pop("cls"))(
        **{k: v for k, v in spec.items() if k != "arch"}, dtype="bfloat16"
    )
    cfg.architectures = [spec["arch"]]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = torch.empty(p.shape, dtype=torch.float32, device="cuda")
        if p.dim() == 2:
            std = 1.0 if "embed" in name else 1.25 / p.shape[1] ** 0.5
            if "embed" in name and "gemma" in shape:
                std = 0.02
            t.normal_(0.0, std, generator=gen)
        elif "norm" in name:
            t.normal_(0.0 if "gemma" in shape else 1.0, 0.1, generator=gen)
            if name == "model.norm.weight" and "gemma" in shape:
                t.add_(7.0)  # the final norm's gain brings the tied logits to a std of about 1
        else:
            t.normal_(0.0, 0.1, generator=gen)
        state[name] = t.to(torch.bfloat16).cpu()
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, max_shard_size="4GB")
    for file, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, folder / file, metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * 2 for t in state.values())},
            "weight_map": split.tensor_to_filename,
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hf"))
    from hf_checkpoint import MAKERS

    MAKERS["chatml"](folder)
    # The tokenizer maker wrote its own small config pieces; the model's config.json stays ours.
    cfg.save_pretrained(folder)
    return folder


def plain_read_gbps(folder: Path) -> tuple[float, int]:
    files = sorted(folder.glob("*.safetensors"))
    total = 0
    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    dt = time.perf_counter() - t0
    return total / dt / 1e9, total


def load_gbps(folder: Path) -> tuple[float, float]:
    from raystate.engine_args import resolve_model
    from raystate.model.hf_weights import load_hf_model

    cfg = resolve_model(str(folder)).config
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model, stats = load_hf_model(folder, cfg, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return stats.bytes_read / dt / 1e9, dt


def exactness(folder: Path, prompt_lens: list[int], new_tokens: int) -> dict:
    import transformers

    from raystate import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in prompt_lens]
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    hf.generation_config = transformers.GenerationConfig(eos_token_id=None, pad_token_id=0)
    want, margins = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            want.append(out.sequences[0, len(p) :].tolist())
            top2 = torch.stack([lg[0].float().topk(2).values for lg in out.logits])
            margins.append(float((top2[:, 0] - top2[:, 1]).min()))
    hf_s = time.perf_counter() - t0
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    llm = LLM(
        str(folder),
        backend="inprocess",
        device="cuda",
        dtype="float32",
        max_model_len=max(prompt_lens) + 64,
        max_num_seqs=4,
        num_blocks=4 * ((max(prompt_lens) + 64) // 16 + 2),
        max_num_batched_tokens=2048,
    )
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    ours_s = time.perf_counter() - t0
    got = [o.token_ids for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(got, want, strict=True)
    ]
    return {
        "equal": got == want,
        "first_diff": first_diff,
        "min_top2_margin": margins,
        "prompt_lens": prompt_lens,
        "new_tokens": new_tokens,
        "hf_s": hf_s,
        "ours_s": ours_s,
        "ours": got,
        "hf": want,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--root", default="/tmp/hf_ckpt")
    ap.add_argument("--prompt-lens", default="1500,2100,1100")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    folder = Path(args.root) / args.shape
    t0 = time.perf_counter()
    make_checkpoint(args.shape, folder)
    print(f"[{args.shape}] checkpoint at {folder} ({time.perf_counter() - t0:.1f} s)", flush=True)
    result: dict = {"shape": args.shape, "device": torch.cuda.get_device_name(0)}
    read_gbps, nbytes = plain_read_gbps(folder)
    load, load_s = load_gbps(folder)
    read_gbps2, _ = plain_read_gbps(folder)
    result["weights"] = {
        "bytes": nbytes,
        "plain_read_gbps": [read_gbps, read_gbps2],
        "load_gbps": load,
        "load_s": load_s,
        "ratio": load / max(read_gbps, read_gbps2),
    }
    print(
        f"[{args.shape}] weights {nbytes / 1e9:.2f} GB: plain read {read_gbps:.2f} / {read_gbps2:.2f} GB/s, "
        f"our load to GPU in bf16 {load:.2f} GB/s ({load_s:.2f} s), "
        f"{result['weights']['ratio']:.2f}x the read",
        flush=True,
    )
    if not args.skip_exactness:
        ex = exactness(folder, [int(x) for x in args.prompt_lens.split(",")], args.new_tokens)
        result["exactness"] = ex
        print(
            f"[{args.shape}] greedy fp32 ours == transformers: {ex['equal']} "
            f"(first differing step per prompt {ex['first_diff']}, "
            f"smallest top-2 logit margin {[round(m, 4) for m in ex['min_top2_margin']]}; "
            f"transformers {ex['hf_s']:.1f} s, ours {ex['ours_s']:.1f} s)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
