"""Structured output (SamplingParams.json_schema / json_object / regex / choice / grammar) on the tiny byte
model with random weights: the grammar alone must make every output valid JSON that the schema accepts
(or text the regex, the choices or the Lark grammar allow), greedy or sampled, through the eager step and
the decode-graph step, with async scheduling on or off; the other rows of a batch are untouched; a bad
schema fails its request alone."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from raystate import LLM, SamplingParams
from raystate.config import EOS_ID
from raystate.messages import NewRequest, ids_to_bytes

# Small schemas (bounded strings and numbers) so that outputs end within a few dozen byte tokens.
SCHEMAS = {
    "required_fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"enum": [0, 1]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b"]},
                "maxItems": 2,
            },
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 64


def _llm(**kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 8)
    return LLM(model="tiny", device="cpu", backend="inprocess", **kw)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(4, 20))).tolist() for _ in range(n)]


def _check(out, schema: dict) -> object:
    assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    assert out.token_ids[-1] == EOS_ID
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def llm():
    return _llm()


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_output_parses_and_validates(llm, sampling):
    names = sorted(SCHEMAS)
    prompts = _prompts(1, 2 * len(names))
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            json_schema=json.dumps(SCHEMAS[names[i % len(names)]]),
            **({"temperature": 1.0, "seed": 100 + i} if sampling == "seeded" else {}),
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for i, out in enumerate(outs):
        _check(out, SCHEMAS[names[i % len(names)]])


def test_json_object_mode_gives_a_json_object(llm):
    prompts = _prompts(2, 4)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, json_object=True),
        SamplingParams(max_tokens=MAX_TOKENS, json_object=True, temperature=0.7, seed=5),
        SamplingParams(max_tokens=MAX_TOKENS, json_object=True, temperature=1.0, seed=6, top_k=20),
        SamplingParams(max_tokens=MAX_TOKENS, json_object=True, repetition_penalty=1.3),
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # a free-form object may run to max_tokens: what it has is still a JSON prefix
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_plain_rows_are_bit_identical_next_to_structured_ones(llm):
    prompts = _prompts(3, 4)
    plain = [
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True),
    ]
    alone = llm.generate(prompt_token_ids=prompts[:2], sampling_params=plain, use_tqdm=False)
    structured = [
        SamplingParams(max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMAS["enum"])),
        SamplingParams(max_tokens=MAX_TOKENS, json_object=True, temperature=1.0, seed=3),
    ]
    mixed = llm.generate(prompt_token_ids=prompts, sampling_params=plain + structured, use_tqdm=False)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    _check(mixed[2], SCHEMAS["enum"])


def _run(graph_path: bool, async_scheduling: bool, prompts, params):
    llm = _llm(async_scheduling=async_scheduling)
    worker = llm.engine.worker
    if graph_path:
        worker.graphs = worker.new_decode_graphs()  # never captured: `replay` runs the step eagerly
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm.generate(prompt_token_ids=[[7]], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    assert not worker.structured.matchers  # finished requests drop their matchers (next message)
    return [(o.token_ids, o.finish_reason) for o in outs], worker


def test_graph_path_and_async_scheduling_agree_with_the_eager_step():
    prompts = _prompts(4, 4)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMAS["nested"])),
        SamplingParams(
            max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMAS["array"]), temperature=1.0, seed=1
        ),
        SamplingParams(max_tokens=12, ignore_eos=True),  # plain
        SamplingParams(max_tokens=MAX_TOKENS, json_object=True, frequency_penalty=1.0),
    ]
    eager, _ = _run(False, False, prompts, params)
    for graph_path, async_scheduling in ((False, True), (True, False), (True, True)):
        got, worker = _run(graph_path, async_scheduling, prompts, params)
        assert got == eager, (graph_path, async_scheduling)
        if graph_path:
            assert worker.graphs.num_eager_steps > 0
    names = ["nested", "array"]
    for (ids, reason), name in zip(eager[:2], names, strict=True):
        assert reason == "stop"
        jsonschema.validate(json.loads(bytes(t for t in ids if t < 256)), SCHEMAS[name])


def test_a_bad_schema_fails_its_request_alone(llm):
    prompts = _prompts(5, 2)
    bad = json.dumps({"type": "integer", "minimum": 5, "maximum": 1})  # unsatisfiable
    params = [SamplingParams(max_tokens=8, json_schema=bad), SamplingParams(max_tokens=8, ignore_eos=True)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert outs[0].finish_reason == "error" and "json_schema" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8


def test_min_tokens_past_the_end_of_the_json_fails_with_a_reason(llm):
    # {"color":"red","size":1} is at most 26 bytes: min_tokens 40 holds EOS back where the grammar allows
    # nothing else, so no token is allowed: the request fails alone and says why.
    params = SamplingParams(max_tokens=48, min_tokens=40, json_schema=json.dumps(SCHEMAS["enum"]))
    (out,) = llm.generate(prompt_token_ids=_prompts(6, 1), sampling_params=params, use_tqdm=False)
    assert out.finish_reason == "error" and "structured output" in out.error


def test_a_readmitted_request_replays_its_output_into_a_new_matcher(llm):
    worker = llm.engine.worker
    schema = json.dumps(SCHEMAS["enum"])
    prompt = [1, 2, 3]
    done = list(b'{"color":"re')

    def new(output: list[int]) -> NewRequest:
        ids = prompt + output
        return NewRequest(
            "r", ids_to_bytes(ids), len(prompt), len(ids) - 1, 0, [[]], 0,
            SamplingParams(max_tokens=32, json_schema=schema),
        )  # fmt: skip

    matcher, why = worker.structured.new_matcher(new(done))
    assert why is None
    assert matcher.consume_tokens(list(b'd","size":2}')) and matcher.is_accepting()
    matcher, why = worker.structured.new_matcher(new(list(b'{"colour"')))
    assert matcher is None and "breaks the grammar" in why


def test_validation_names_the_field():
    from raystate.errors import InvalidRequest

    bad = ({"json_schema": "{not json"}, {"json_schema": "[1]"}, {"json_schema": "{}", "json_object": True})
    for kw in bad:
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**kw).validate(259)
        assert e.value.field in ("json_schema", "json_object")
    SamplingParams(json_schema="{}").validate(259)
    SamplingParams(json_object=True).validate(259)


def test_regex_choice_and_grammar_outputs_match(llm):
    """The whole output matches the regex, is one of the choices (any text: quotes, backslashes,
    non-ASCII), or is a sentence of the Lark grammar, greedy and sampled."""
    import re

    choices = ["yes", 'no "really" \\ é日本', "maybe"]
    lark = 'start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,3}/'
    params = []
    for seed in (None, 1, 2):
        sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
        params += [
            SamplingParams(max_tokens=24, regex=r"[0-9]{3}-[a-z]{2,4}", **sampled),
            SamplingParams(max_tokens=24, choice=choices, **sampled),
            SamplingParams(max_tokens=24, grammar=lark, **sampled),
        ]
    outs = llm.generate(prompt_token_ids=_prompts(7, len(params)), sampling_params=params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (i, out.finish_reason, out.error)
        text = bytes(t for t in out.token_ids if t < 256).decode()
        kind = i % 3
        if kind == 0:
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        elif kind == 1:
            assert text in choices, text
        else:
            assert re.fullmatch(r"x=[0-9]{1,3}(,[0-9]{1,3})*", text), text


def test_a_bad_regex_or_grammar_fails_its_request_alone(llm):
    params = [
        SamplingParams(max_tokens=8, regex="(unclosed"),
        SamplingParams(max_tokens=8, grammar="start: nosuchrule"),
        SamplingParams(max_tokens=8, ignore_eos=True),
    ]
    outs = llm.generate(prompt_token_ids=_prompts(8, 3), sampling_params=params, use_tqdm=False)
    assert outs[0].finish_reason == "error" and "regex" in outs[0].error
    assert outs[1].finish_reason == "error" and "grammar" in outs[1].error
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 8


def test_one_structured_output_at_a_time_and_bounded():
    from raystate.errors import InvalidRequest
    from raystate.messages import MAX_CHOICE_STRINGS, MAX_GRAMMAR_CHARS

    bad = [
        ({"regex": "a", "choice": ["b"]}, "choice"),
        ({"json_object": True, "grammar": 'start: "a"'}, "grammar"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 1]}, "choice"),
        ({"choice": ["a"] * (MAX_CHOICE_STRINGS + 1)}, "choice"),
        ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "regex"),
        ({"grammar": 3}, "grammar"),
    ]
    for kw, field in bad:
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**kw).validate(259)
        assert e.value.field == field, kw
    assert SamplingParams(choice=["a", ""]).structured_fields == ["choice"]
