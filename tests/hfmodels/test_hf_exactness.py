"""Our paged forward of each Hugging Face family equals transformers' greedy `generate` (float32) token for
token, on prompts several sliding windows long: with prefix caching off; with prefix hits and bounded
replay off (hits are exact then); with chunked prefill under a small token budget; through preemption.
With bounded replay on, a hit's output equals the truncated-replay reference (DESIGN section 4) instead.

The engine runs the kernels' PyTorch references here (conftest.py: the interpreter is too slow for whole
models); test_hf_kernels.py runs one family on the interpreted Triton kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_families import FAMILIES, hf_greedy, prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from engine_harness import LogitLog  # noqa: E402  (tests/engine's logit recorder)

from raystate import LLM, SamplingParams
from raystate.model.reference import dense_forward, replay_reference

MAX_TOKENS = 12
BLOCK = 8


def _prompts(folder, seed: int) -> list[list[int]]:
    """Three prompts, the last two sharing their first 96 ids with the first (prefix-hit material)."""
    first = prompt_ids(folder, 130, seed)
    return [
        first,
        first[:96] + prompt_ids(folder, 21, seed + 1),
        first[:100] + prompt_ids(folder, 9, seed + 2),
    ]


@pytest.fixture(scope="module")
def expected(family_checkpoints):
    """family -> (prompts, transformers' greedy continuations), computed once per family."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(family: str):
        if family not in cache:
            folder = family_checkpoints[family]
            prompts = _prompts(folder, seed=len(family))
            cache[family] = prompts, hf_greedy(folder, prompts, MAX_TOKENS)
        return cache[family]

    return get


def _llm(folder, **kw) -> LLM:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("max_num_seqs", 4)
    return LLM(str(folder), backend="inprocess", device="cpu", dtype="float32", max_model_len=512, **kw)


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_prefix_caching_off(family, family_checkpoints, expected):
    prompts, want = expected(family)
    llm = _llm(family_checkpoints[family], enable_prefix_caching=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert all(o.num_cached_tokens == 0 for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_without_replay_and_chunked_prefill_equal_transformers(
    family, family_checkpoints, expected
):
    """Cache everything (bounded replay off): later prompts hit the first's blocks, in small chunks."""
    prompts, want = expected(family)
    llm = _llm(family_checkpoints[family], swa_bounded_replay=False, max_num_batched_tokens=24)
    outs = [llm.generate(prompt_token_ids=p, sampling_params=PARAMS, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert outs[1].num_cached_tokens >= 88 and outs[2].num_cached_tokens >= 96
    llm.engine.scheduler.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo3", "llama"])
def test_preemption_equals_transformers(family, family_checkpoints, expected):
    prompts, want = expected(family)
    # 40 blocks of 8 tokens (no sharing): three ~130-token requests do not fit at once.
    llm = _llm(
        family_checkpoints[family], enable_prefix_caching=False, num_blocks=40, max_num_batched_tokens=64
    )
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    llm.engine.scheduler.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "gemma3_legacy")])
def test_bounded_replay_equals_truncated_replay_reference(family, family_checkpoints):
    """A hit of H tokens recomputes from H - W with the window floor there; the full groups' cached KV is
    read as is. Logits equal `replay_reference` of the same model (our dense oracle, which equals
    transformers on a cold run: test_dense_oracle_equals_transformers)."""
    folder = family_checkpoints[family]
    rng = np.random.default_rng(len(family))
    cold = prompt_ids(folder, 120, seed=int(rng.integers(1000)))
    hit = cold[:104] + prompt_ids(folder, 10, seed=int(rng.integers(1000)))
    llm = _llm(folder, max_num_batched_tokens=48)
    model = llm.engine.worker.model
    window = model.config.sliding_window
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompt_token_ids=cold, sampling_params=params, use_tqdm=False)[0]
    log = LogitLog()
    llm.engine.worker.logit_recorder = log
    second = llm.generate(prompt_token_ids=hit, sampling_params=params, use_tqdm=False)[0]
    h = second.num_cached_tokens
    if "full" in model.config.layer_types:
        assert h == 104 and second.replay_start == h - window
    else:  # every layer slides (Mistral): nothing is prefix-cacheable, so nothing hits
        assert h == 0 and second.replay_start == 0
    rs = second.replay_start
    seq = hit + second.token_ids[:-1]
    _, cold_kv = dense_forward(model, cold + first.token_ids, return_kv=True)
    want = replay_reference(model, seq, h, rs, cold_kv)
    got = log.stacked(second.request_id, rs, len(seq))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert second.token_ids == want[len(hit) - 1 - rs :].argmax(-1).tolist()
    llm.engine.scheduler.check_integrity()


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo3"])
def test_dense_oracle_equals_transformers(family, family_checkpoints):
    """The dense oracle the replay test trusts computes transformers' logits on a cold run."""
    from hf_families import hf_logits

    from raystate.model import load_model

    folder = family_checkpoints[family]
    ids = prompt_ids(folder, 100, seed=3)
    ours = dense_forward(load_model(str(folder), "cpu", torch.float32), ids)
    torch.testing.assert_close(ours, hf_logits(folder, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", ["llama", "gemma3", "olmo3"]
)  # the three norm layouts: pre, sandwich, post
def test_split_k_projections_equal_transformers(family, family_checkpoints, expected, monkeypatch):
    """The o and down projections as split-K partial sums (what a GPU decode step runs for narrow
    projections, raystate.kernels.split_k), forced here on the CPU for every step at 2 slices: the norms
    that read them sum them, and the tokens are transformers' in each norm layout."""
    from raystate.kernels import split_k
    from raystate.model import layers

    calls = []

    def two_slices(x, weight):
        calls.append(weight.shape)
        return 2

    monkeypatch.setattr(layers, "splits_for", two_slices)
    prompts, want = expected(family)
    llm = _llm(family_checkpoints[family], enable_prefix_caching=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    config = llm.engine.worker.model.config
    o_shape = (config.hidden_size, config.num_heads * config.head_dim)
    down_shape = (config.hidden_size, config.intermediate_size)
    assert {tuple(c) for c in calls} == {o_shape, down_shape}
    assert split_k.splits_for(torch.zeros(4, 8), torch.zeros(8, 8)) == 1  # the real choice, on the CPU


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "qwen3"])  # a tied head; an untied one with q/k norms
def test_column_major_weights_equal_transformers(family, family_checkpoints, expected, monkeypatch):
    """Every projection's weight re-stored column-major (what loading does for a bf16 model on a GPU,
    raystate.model.weight_layout), forced here on the CPU, with the narrow projections split over K as a
    GPU decode step runs them: the tokens are transformers', and a tied head is still the embedding."""
    from raystate.model import layers, weight_layout
    from raystate.model.weight_layout import is_column_major

    monkeypatch.setattr(weight_layout, "wants_column_major", lambda w: w.is_contiguous() and min(w.shape) > 1)
    monkeypatch.setattr(layers, "splits_for", lambda x, weight: 2)
    prompts, want = expected(family)
    llm = _llm(family_checkpoints[family], enable_prefix_caching=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    model = llm.engine.worker.model
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_column_major(w) for w in linears)
    assert (model.lm_head.weight is model.embed.weight) == model.config.tie_word_embeddings
