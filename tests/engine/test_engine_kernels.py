"""The engine on the real Triton kernels (interpreted on the CPU) gives the reference kernels' output."""

from __future__ import annotations

import pytest
import torch
from engine_harness import shared_prefix_prompts

from raystate import SamplingParams
from raystate.kernels import use_triton


@pytest.mark.triton_kernels
def test_engine_on_triton_kernels_matches_reference(make_llm, monkeypatch):
    prompts = shared_prefix_prompts(seed=3, num=3, prefix_len=70)[0::2]  # one family: a shared prefix
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    runs = []
    for mode in ("auto", "reference"):
        monkeypatch.setenv("RAYSTATE_KERNELS", mode)
        monkeypatch.setattr(
            "raystate.kernels._common._reference_forced", mode == "reference"
        )  # read once per process
        llm, log = make_llm(block_size=16, max_num_batched_tokens=64)
        outs = [llm.generate(prompt_token_ids=p, sampling_params=params, use_tqdm=False)[0] for p in prompts]
        runs.append((outs, log))
    monkeypatch.setenv("RAYSTATE_KERNELS", "auto")
    monkeypatch.setattr("raystate.kernels._common._reference_forced", False)
    if not use_triton(torch.empty(0)):
        pytest.skip("Triton runs neither on CUDA nor through the interpreter here")
    (tri_outs, tri_log), (ref_outs, ref_log) = runs
    # The second prompt hit the first one's prefix, so bounded replay ran on the Triton kernels too.
    assert tri_outs[1].replay_start > 0
    for a, b in zip(tri_outs, ref_outs, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.num_cached_tokens, a.replay_start) == (b.num_cached_tokens, b.replay_start)
        rows = sorted(ref_log.rows[b.request_id])
        torch.testing.assert_close(
            tri_log.stacked(a.request_id, rows[0], rows[-1] + 1),
            ref_log.stacked(b.request_id, rows[0], rows[-1] + 1),
            rtol=1e-5,
            atol=1e-5,
        )
