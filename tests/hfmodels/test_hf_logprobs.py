"""Logprobs on a Hugging Face checkpoint (in-process): values equal log_softmax of a cold dense forward,
decoded tokens are the checkpoint tokenizer's (transformers is the oracle)."""

from __future__ import annotations

import torch
import transformers
from hf_families import make_family_checkpoint

from raystate import LLM, SamplingParams
from raystate.model.reference import dense_forward


def test_hf_logprobs_and_prompt_logprobs(tmp_path):
    folder = make_family_checkpoint("llama", tmp_path / "llama")
    llm = LLM(str(folder), backend="inprocess")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "Hello world, café naïve"
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert ids == tok(prompt)["input_ids"]
    lp = torch.log_softmax(dense_forward(llm.engine.worker.model, ids + out.token_ids).double(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        d = out.prompt_logprobs[i]
        assert abs(d[ids[i]].logprob - lp[i - 1, ids[i]].item()) < 1e-5
        assert d[ids[i]].decoded_token == tok.decode([ids[i]])
    for j, (t, d) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = lp[len(ids) - 1 + j]
        assert abs(d[t].logprob - row[t].item()) < 1e-5
        assert set(torch.topk(row, 3).indices.tolist()) <= set(d)
        assert all(v.decoded_token == tok.decode([k]) for k, v in d.items())
