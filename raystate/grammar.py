"""The grammars of structured output (`SamplingParams.json_schema` / `json_object` / `regex` / `choice` /
`grammar`), through llguidance.

Torch-free, so the serving layer can check a schema before a request reaches the engine (a 400 naming
`response_format`); the worker (`raystate.worker.structured`) compiles the same grammar text against the
model's vocabulary. llguidance is imported on first use only.
"""

from __future__ import annotations

import json

# JSON output without insignificant whitespace (`{"a":1}`): a weak model cannot stall in a run of spaces,
# and a schema may still ask for whitespace through its "x-guidance" options.
JSON_OPTIONS = {"whitespace_flexible": False}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def first_line(text: str | None) -> str:
    """The first line of a library message, bounded (llguidance's errors carry a parser dump after it)."""
    text = (text or "").strip()
    return text.splitlines()[0][:300] if text else "unknown error"


def grammar_of(json_schema: str | None) -> str:
    """llguidance's grammar text for a JSON Schema (JSON text), or for any JSON object (None)."""
    import llguidance

    schema = json_schema if json_schema is not None else JSON_OBJECT_SCHEMA
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def choice_grammar(choice: list[str]) -> str:
    """A Lark grammar whose whole output is one of the strings (JSON-quoted literals: any text, escaped)."""
    return "start: " + " | ".join(json.dumps(c) for c in choice)


def grammar_for(params) -> str:
    """llguidance's grammar text for the structured-output field a SamplingParams sets."""
    import llguidance

    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark(choice_grammar(params.choice))
    if params.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(params.grammar)
    return grammar_of(params.json_schema)


def check_grammar(params) -> str | None:
    """Why llguidance refuses the grammar of a SamplingParams' structured-output field, or None when it
    compiles. Needs no tokenizer."""
    return _refusal(lambda: grammar_for(params))


def check_schema(json_schema: str) -> str | None:
    """Why llguidance refuses a JSON Schema (JSON text), or None when it compiles. Needs no tokenizer."""

    def grammar() -> str:
        json.loads(json_schema)
        return grammar_of(json_schema)

    return _refusal(grammar)


def _refusal(make_grammar) -> str | None:
    """The first line of why the grammar `make_grammar()` builds is refused (building or validating it),
    or None."""
    import llguidance

    try:
        grammar = make_grammar()
    except (ValueError, RecursionError) as e:
        return first_line(str(e))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return first_line(messages[0] if messages else None) if is_error else None
