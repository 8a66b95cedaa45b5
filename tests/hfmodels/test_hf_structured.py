"""Structured output on Hugging Face checkpoints (in-process): the grammar is compiled against the
checkpoint's own tokenizer (its tokenizer.json through `raystate.hf.HFTokenizer`), so the tiny random
model's output is JSON that the schema accepts, and ends at the checkpoint's EOS."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hf_families import make_family_checkpoint

from raystate import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_checkpoint_outputs_follow_the_schema(tmp_path, family):
    folder = make_family_checkpoint(family, tmp_path / family)
    llm = LLM(str(folder), backend="inprocess", enable_prefix_caching=False)
    params = [
        SamplingParams(max_tokens=64, json_schema=json.dumps(SCHEMA)),
        SamplingParams(max_tokens=64, json_schema=json.dumps(SCHEMA), temperature=1.0, seed=3),
        SamplingParams(max_tokens=64, json_object=True, temperature=0.8, seed=4),
    ]
    outs = llm.generate(["Is it?", "Score it:", "Any object"], params, use_tqdm=False)
    eos = set(llm.engine.config.model.eos_token_ids)
    for out in outs[:2]:
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        assert out.token_ids[-1] in eos
        jsonschema.validate(json.loads(out.text), SCHEMA)
    last = outs[2]
    if last.finish_reason == "stop":
        assert isinstance(json.loads(last.text), dict)
    else:
        assert last.finish_reason == "length" and last.text.startswith("{")
