"""response_format over a real Serve app on the Ray backend, through the official `openai` client: the
structured-output fields cross the wire to the scheduler actor and the worker, whose grammar forces the
tiny random model's output into the schema (tests/structured covers the rest in process)."""

from __future__ import annotations

import json

import jsonschema
import openai
from serve_harness import App

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _client(app: App) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.v1, api_key=app.api_key or "unused", max_retries=0, timeout=60)


def test_response_format_on_both_routes(open_app):
    client = _client(open_app)
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "S1"}], max_tokens=48, temperature=0,
        response_format=fmt,
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    comp = client.completions.create(
        model="tiny", prompt="S2", max_tokens=48, temperature=0.9, seed=2, extra_body={"response_format": fmt}
    )
    assert comp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)
    obj = client.completions.create(
        model="tiny", prompt="S3", max_tokens=48, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert obj.choices[0].text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
