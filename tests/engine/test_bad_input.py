"""Bad input raises a ValueError naming the field and the limit; the engine keeps serving the rest."""

from __future__ import annotations

import pytest

from raystate import InvalidRequest, SamplingParams


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([1, 2, 259], SamplingParams(), "prompt_token_ids"),
        ([1, 2, -1], SamplingParams(), "prompt_token_ids"),
        ([1] * 200, SamplingParams(max_tokens=100), "max_tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
        ([1, 2, 3], SamplingParams(top_p=1.5), "top_p"),
        ([1, 2, 3], SamplingParams(temperature=-0.5), "temperature"),
    ],
)
def test_invalid_request_names_field_and_engine_keeps_serving(make_llm, prompt, params, field):
    llm, _ = make_llm()
    engine = llm.engine
    # Requests accepted before the bad call...
    engine.add_request("early-1", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=field) as err:
        llm.generate(prompt_token_ids=[[9, 9, 9], prompt], sampling_params=params, use_tqdm=False)
    assert isinstance(err.value, InvalidRequest) and err.value.field == field
    # ...still finish, and new work is served.
    outs = llm.generate(
        prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False
    )
    assert len(outs[0].token_ids) >= 1
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.get_request("early-1") is None


def test_missing_prompts_and_mismatched_params(make_llm):
    llm, _ = make_llm()
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_shards": 2}, "num_shards"), ({"ray_options": {"pipeline_steps": True}}, "ray_options")],
)
def test_the_inprocess_backend_refuses_what_only_ray_uses(kwargs, field):
    """One worker in this process and no actors: shards and launch options would be dropped unread."""
    from raystate import LLM

    with pytest.raises(InvalidRequest, match="backend='inprocess'") as err:
        LLM(backend="inprocess", **kwargs)
    assert err.value.field == field
