"""One pass of a Hugging Face family through the engine on the interpreted Triton kernels (the other tests
of this folder run their PyTorch references): Gemma 3, whose GELU-tanh gate, (1 + w) norms, per-head q/k
norms and two ropes are the most that differs from our reference model, still equals transformers. (Each
kernel is also checked against its reference in tests/kernels.)"""

from __future__ import annotations

import pytest
from hf_families import hf_greedy, prompt_ids

from raystate import LLM, SamplingParams
from raystate.kernels import use_triton

pytestmark = pytest.mark.triton_kernels  # conftest.py leaves the kernels alone here


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3"])
def test_triton_kernels_greedy_equals_transformers(family, family_checkpoints):
    import torch

    assert use_triton(torch.zeros(1)), "TRITON_INTERPRET must be set for this test (tests/conftest.py does)"
    folder = family_checkpoints[family]
    prompts = [prompt_ids(folder, 40, seed=5)]  # more than two windows of 16
    want = hf_greedy(folder, prompts, 3)
    llm = LLM(
        str(folder),
        backend="inprocess",
        device="cpu",
        dtype="float32",
        max_model_len=256,
        block_size=16,
        max_num_batched_tokens=64,
    )
    outs = llm.generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.token_ids for o in outs] == want
