"""response_format, and vLLM's `structured_outputs` and `guided_*` fields, on /v1/completions and
/v1/chat/completions through the official `openai` client, on the real FastAPI app over `RaystateServer`
over `InProcessClient` (httpx's ASGI transport, as in tests/serve/test_protocol_details.py): json_schema
outputs validate, json_object outputs parse, regex / choice / grammar outputs match, and a bad one is a
400 naming it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from asgi_app import reference_app

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def app():
    with reference_app(MODEL) as a:
        yield a


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema(app, temperature):
    r = app.run(
        app.openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Where?"}],
            max_tokens=64,
            temperature=temperature,
            seed=7,
            response_format=RESPONSE_FORMAT,
        )
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completion_json_schema(app):
    r = app.run(
        app.openai.completions.create(
            model=MODEL,
            prompt="Where?",
            max_tokens=64,
            temperature=0,
            extra_body={"response_format": RESPONSE_FORMAT},
        )
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_streamed_chat_json_schema(app):
    async def stream() -> str:
        chunks = await app.openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Stream it"}],
            max_tokens=64,
            temperature=0,
            response_format=RESPONSE_FORMAT,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    jsonschema.validate(json.loads(app.run(stream())), SCHEMA)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_object(app, path):
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "response_format": {"type": "json_object"}}
    body |= {"prompt": "obj"} if "chat" not in path else {"messages": [{"role": "user", "content": "obj"}]}
    r = app.post(path, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if "chat" not in path else choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_text_format_is_plain(app):
    r = app.run(
        app.openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "plain"}],
            max_tokens=4,
            response_format={"type": "text"},
        )
    )
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}},
            },
            "response_format.json_schema.schema",
        ),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_response_format_is_a_400(app, path, response_format, param):
    body = {"model": MODEL, "max_tokens": 4, "response_format": response_format}
    body |= {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]}
    r = app.post(path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


CHOICES = ["positive", "negative", "neutral"]
VLLM_STRUCTURED = [
    ({"guided_choice": CHOICES}, "choice"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    ({"guided_regex": "[0-9]{2}:[0-9]{2}"}, "regex"),
    ({"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}}, "regex"),
    ({"guided_json": SCHEMA}, "json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json"),
    ({"guided_grammar": 'start: "ok " WORD\nWORD: /[a-z]{1,5}/'}, "grammar"),
    ({"structured_outputs": {"grammar": 'start: "ok " WORD\nWORD: /[a-z]{1,5}/'}}, "grammar"),
    ({"structured_outputs": {"json_object": True}}, "object"),
]


def _check(kind: str, text: str) -> None:
    import re

    if kind == "choice":
        assert text in CHOICES, text
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", text), text
    elif kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "grammar":
        assert re.fullmatch(r"ok [a-z]{1,5}", text), text
    else:
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize(("extra", "kind"), VLLM_STRUCTURED, ids=lambda x: str(x)[:48])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_structured_outputs(app, path, extra, kind):
    body = {"model": MODEL, "max_tokens": 64, "temperature": 1.0, "seed": 5, **extra}
    body |= {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]}
    r = app.post(path, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    _check(kind, choice["text"] if "chat" not in path else choice["message"]["content"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"guided_grammar": "start: nosuchrule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": {"type": "nosuch"}}, "guided_json"),
        (
            {"structured_outputs": {"json": {"type": "integer", "minimum": 3, "maximum": 1}}},
            "structured_outputs.json",
        ),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),  # the later of the two
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs.choice"),
    ],
    ids=lambda x: str(x)[:48],
)
def test_bad_vllm_structured_output_is_a_400(app, extra, param):
    body = {"model": MODEL, "max_tokens": 4, "prompt": "x", **extra}
    r = app.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_forced_tool_call_refuses_another_structured_output(app):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [tool],
        "tool_choice": "required",
        "guided_choice": ["a"],
    }
    r = app.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_choice"
