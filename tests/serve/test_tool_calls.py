"""raystate.serve.tool_calls: model text in pieces -> content and tool calls, for each tool_choice mode.

Every stream is also fed the same output split at every character boundary, one character at a time and
in chunks of several sizes: the content and calls must not depend on how the text arrived.
"""

from __future__ import annotations

import json
import re

import pytest

from raystate.serve.tool_calls import (
    TOOL_CALL_PARSERS,
    HermesToolStream,
    Llama3JsonToolStream,
    NamedToolStream,
    RequiredToolStream,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    finish_reason,
    make_stream,
    named_schema,
    new_call_id,
    parser_for_template,
    required_schema,
)

CALL_ID = re.compile(r"call_[0-9a-f]{24}")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}
FUNCTIONS = [
    {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    {"name": "get_time"},
]


def run(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    """Feeds every piece, then finishes: (all content joined, all deltas in order)."""
    content, deltas = [], []
    for piece in pieces:
        text, made = stream.feed(piece)
        content.append(text)
        deltas += made
    text, made = stream.finish()
    return "".join(content + [text]), deltas + made


def joined(deltas: list[ToolCallDelta]) -> list[dict]:
    """The deltas put back together as a client does (by index), checking each call's id comes once."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id is not None and d.name is not None, "a call's first delta carries its id and name"
            assert d.index == len(calls), "calls are numbered in order from 0"
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
        else:
            assert d.id is None and d.name is None, "only a call's first delta carries its id and name"
        calls[d.index]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def as_dicts(calls: list[ToolCall]) -> list[dict]:
    return [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls]


def splits(text: str) -> list[list[str]]:
    """The ways one output is fed: whole, split in two at every boundary, one character at a time, and
    in chunks of 2 to 7 characters."""
    ways = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    ways += [[text[i : i + size] for i in range(0, len(text), size)] for size in range(1, 8)]
    return ways


def result(make, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a fresh stream fed `pieces`; checks the streamed deltas join to
    exactly the final calls."""
    stream = make()
    content, deltas = run(stream, pieces)
    assert joined(deltas) == as_dicts(stream.calls)
    return content, [(c.name, c.arguments) for c in stream.calls]


def assert_split_invariant(make, text: str) -> tuple[str, list[tuple[str, str]]]:
    whole = result(make, [text])
    for pieces in splits(text):
        assert result(make, pieces) == whole, pieces
    return whole


# -- ids -------------------------------------------------------------------------------------------------


def test_call_ids_are_openai_shaped_and_unique():
    ids = [new_call_id() for _ in range(200)]
    assert all(CALL_ID.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("make", [lambda: NamedToolStream("f"), RequiredToolStream, HermesToolStream])
def test_a_stream_is_used_once(make):
    stream = make()
    stream.feed("")
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


# -- a named function --------------------------------------------------------------------------------------


def test_named_pieces_are_the_arguments_of_one_call():
    stream = NamedToolStream("get_weather")
    content, first = stream.feed('{"city"')
    assert content == "" and len(first) == 1
    [d] = first
    assert (d.index, d.name, d.arguments) == (0, "get_weather", '{"city"') and CALL_ID.fullmatch(d.id)
    assert stream.calls == []  # not complete before the end
    assert stream.feed(': "Paris"') == ("", [ToolCallDelta(0, None, None, ': "Paris"')])
    assert stream.feed("") == ("", [])  # nothing to send: no empty delta
    assert stream.feed("}") == ("", [ToolCallDelta(0, None, None, "}")])
    assert stream.finish() == ("", [])
    assert stream.calls == [ToolCall(d.id, "get_weather", '{"city": "Paris"}')]


def test_named_first_feed_opens_the_call_even_when_empty():
    stream = NamedToolStream("f")
    _, [d] = stream.feed("")
    assert (d.index, d.name, d.arguments) == (0, "f", "") and d.id is not None
    assert stream.feed("{}") == ("", [ToolCallDelta(0, None, None, "{}")])
    stream.finish()
    assert stream.calls == [ToolCall(d.id, "f", "{}")]


def test_named_finish_without_feed_opens_and_closes_the_call():
    stream = NamedToolStream("f")
    content, [d] = stream.finish()
    assert content == "" and (d.index, d.name, d.arguments) == (0, "f", "") and CALL_ID.fullmatch(d.id)
    assert stream.calls == [ToolCall(d.id, "f", "")]


def test_named_surrounding_whitespace_is_not_arguments_but_inner_whitespace_is():
    text = ' \n {"a": [1, 2],\n "b": "x y" } \n\n'
    content, calls = assert_split_invariant(lambda: NamedToolStream("f"), text)
    assert content == "" and calls == [("f", text.strip())]


# -- tool_choice "required" -------------------------------------------------------------------------------

TWO_CALLS = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, '
    '{"name": "get_time", "parameters": {}}]'
)


def test_required_two_calls_whole_and_split_everywhere():
    content, calls = assert_split_invariant(RequiredToolStream, TWO_CALLS)
    assert content == ""
    assert calls == [
        ("get_weather", json.dumps({"city": "Paris", "unit": "c"}, ensure_ascii=False)),
        ("get_time", "{}"),
    ]


def test_required_a_call_is_sent_as_soon_as_its_element_closes():
    stream = RequiredToolStream()
    first_end = TWO_CALLS.index("}}") + 2
    assert stream.feed(TWO_CALLS[: first_end - 1]) == ("", [])
    content, [d] = stream.feed(TWO_CALLS[first_end - 1 : first_end + 5])
    assert content == "" and (d.index, d.name) == (0, "get_weather") and CALL_ID.fullmatch(d.id)
    assert d.arguments == '{"city": "Paris", "unit": "c"}'
    assert [c.name for c in stream.calls] == ["get_weather"]
    content, [d2] = stream.feed(TWO_CALLS[first_end + 5 :])
    assert (d2.index, d2.name, d2.arguments) == (1, "get_time", "{}") and d2.id != d.id
    assert stream.finish() == ("", [])
    assert [c.id for c in stream.calls] == [d.id, d2.id]


def test_required_strings_with_brackets_quotes_escapes_and_unicode():
    tricky = {
        "text": 'a } b ] c { d [ e " f \\ g',
        "path": "C:\\dir\\",  # ends with an escaped backslash right before the closing quote
        "quote": '"}]',
        "said": 'he said "}]" and left {',  # brackets between escaped quotes are still inside the string
        "unicode": "café ☕ 日本 😀",
        "nested": {"list": [{"k": "}"}, ["]"]], "n": 1.5},
    }
    array = [{"name": "f", "parameters": tricky}, {"name": "g", "parameters": {"s": "]"}}]
    for ensure_ascii in (False, True):  # raw unicode, and \uXXXX escapes (surrogate pairs too)
        text = "[\n  " + json.dumps(array, ensure_ascii=ensure_ascii).removeprefix("[") + "\n"
        content, calls = assert_split_invariant(RequiredToolStream, text)
        assert content == ""
        parsed = [(name, json.loads(arguments)) for name, arguments in calls]
        assert parsed == [("f", tricky), ("g", {"s": "]"})]
        assert calls[0][1] == json.dumps(tricky, ensure_ascii=False)  # unicode kept as is in the arguments


def test_required_truncated_array_drops_the_incomplete_element():
    cut = TWO_CALLS[: TWO_CALLS.index('"get_time"') + 5]  # cut by max_tokens inside the second element
    content, calls = assert_split_invariant(RequiredToolStream, cut)
    assert content == "" and [name for name, _ in calls] == ["get_weather"]
    # cut inside the first element: no call at all, and nothing raised
    assert result(RequiredToolStream, [TWO_CALLS[:30]]) == ("", [])
    assert result(RequiredToolStream, [""]) == ("", [])


def test_required_text_after_the_array_is_ignored():
    content, calls = result(RequiredToolStream, [TWO_CALLS + ' [{"name": "x", "parameters": {}}]'])
    assert content == "" and [name for name, _ in calls] == ["get_weather", "get_time"]


# -- tool_choice "auto", Hermes blocks --------------------------------------------------------------------


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


WEATHER_BLOCK = block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}')
TIME_BLOCK = block('{"name": "get_time", "arguments": {}}')
WEATHER_CALL = ("get_weather", '{"city": "Paris", "unit": "c"}')


def hermes(text: str) -> tuple[str, list[tuple[str, str]]]:
    return assert_split_invariant(HermesToolStream, text)


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer, no tools.",
        "a < b and b <= c",
        "ends with a lone <",
        "ends with <tool",
        "ends with <tool_call",  # the whole tag but its ">": still not a tag
        "<tool>, <toolbox>, <tool_calls> and <tool_cal> are not tags",
        "<<<tool_c<tool_<",
        "",
    ],
)
def test_hermes_plain_text_is_content_intact(text):
    assert hermes(text) == (text, [])


def test_hermes_partial_tag_is_held_back_until_decided():
    stream = HermesToolStream()
    assert stream.feed("Hello <") == ("Hello ", [])
    assert stream.feed("tool") == ("", [])
    assert stream.feed("box> and <tool_") == ("<toolbox> and ", [])
    assert stream.finish() == ("<tool_", [])
    assert stream.calls == []


def test_hermes_one_call():
    stream = HermesToolStream()
    assert stream.feed(WEATHER_BLOCK[:-1]) == ("", [])  # not closed yet: nothing sent
    content, [d] = stream.feed(WEATHER_BLOCK[-1])
    assert content == "" and (d.index, d.name, d.arguments) == (0, *WEATHER_CALL) and CALL_ID.fullmatch(d.id)
    assert stream.finish() == ("", [])
    assert stream.calls == [ToolCall(d.id, *WEATHER_CALL)]
    assert hermes(WEATHER_BLOCK) == ("", [WEATHER_CALL])


def test_hermes_two_calls_with_newlines_between_send_no_content():
    text = WEATHER_BLOCK + "\n\n" + TIME_BLOCK + "\n"
    assert hermes(text) == ("", [WEATHER_CALL, ("get_time", "{}")])


def test_hermes_text_before_a_call_is_content():
    text = "Let me look.\n" + WEATHER_BLOCK + "\n" + TIME_BLOCK
    assert hermes(text) == ("Let me look.\n", [WEATHER_CALL, ("get_time", "{}")])


def test_hermes_text_after_a_call_is_content_whitespace_only_text_is_not():
    text = WEATHER_BLOCK + "\n\nThat is all.\n" + TIME_BLOCK + "  \n"
    assert hermes(text) == ("\n\nThat is all.\n", [WEATHER_CALL, ("get_time", "{}")])


@pytest.mark.parametrize(
    "bad",
    [
        block('{"name": "get_weather", "arguments": {"city": "Paris"'),  # invalid JSON
        block("not json at all"),
        block('["get_weather", {}]'),  # not an object
        block('{"arguments": {}}'),  # no name
        block('{"name": 7, "arguments": {}}'),
        block('{"name": "", "arguments": {}}'),
        block('{"name": "f", "arguments": [1, 2]}'),  # arguments neither an object nor a string
        "<tool_call></tool_call>",
    ],
)
def test_hermes_a_block_that_is_no_call_is_content_tags_and_all(bad):
    assert hermes("Before " + bad + " after") == ("Before " + bad + " after", [])
    # after a real call, the whitespace before it goes out with it
    assert hermes(WEATHER_BLOCK + "\n" + bad + "\n" + TIME_BLOCK) == (
        "\n" + bad + "\n",
        [WEATHER_CALL, ("get_time", "{}")],
    )


def test_hermes_tags_are_case_sensitive():
    text = '<TOOL_CALL>{"name": "f", "arguments": {}}</TOOL_CALL>'
    assert hermes(text) == (text, [])


def test_hermes_parameters_key_is_accepted():
    assert hermes(block('{"name": "get_time", "parameters": {"zone": "CET"}}')) == (
        "",
        [("get_time", '{"zone": "CET"}')],
    )


def test_hermes_arguments_as_a_string_are_taken_as_is_and_absent_are_empty():
    text = block(json.dumps({"name": "f", "arguments": '{"x":1}'})) + block('{"name": "g"}')
    assert hermes(text) == ("", [("f", '{"x":1}'), ("g", "{}")])


def test_hermes_arguments_keep_unicode_and_tolerate_raw_newlines_in_strings():
    text = block('{"name": "say", "arguments": {"text": "café\nbar", "emoji": "\\ud83d\\ude00"}}')
    assert hermes(text) == ("", [("say", '{"text": "café\\nbar", "emoji": "😀"}')])


def test_hermes_unclosed_block_at_the_end_is_a_call_if_it_parses():
    unclosed = WEATHER_BLOCK.removesuffix("</tool_call>")
    text = "Checking.\n" + unclosed
    assert hermes(text) == ("Checking.\n", [WEATHER_CALL])


def test_hermes_unclosed_block_that_does_not_parse_is_raw_content():
    text = "Let me look.\n" + WEATHER_BLOCK[:30]  # cut by max_tokens inside the JSON
    assert hermes(text) == (text, [])
    cut_in_close_tag = WEATHER_BLOCK[:-4]
    assert hermes(cut_in_close_tag) == (cut_in_close_tag, [])
    after_a_call = WEATHER_BLOCK + "\n" + TIME_BLOCK[:20]
    assert hermes(after_a_call) == ("\n" + TIME_BLOCK[:20], [WEATHER_CALL])


@pytest.mark.parametrize(
    "text",
    [
        "Let me look.\n" + WEATHER_BLOCK + "\n" + TIME_BLOCK,
        "a <tool_cal <tool_call>" + '{"name": "x", "arguments": {"s": "</tool_call"}}</tool_call>!',
        "<<tool_call>" + '{"name": "f"}' + "</tool_call></tool_call><tool_call><tool_call>{}</tool_call>",
        "x" + WEATHER_BLOCK + "y" + block("oops") + " \n " + TIME_BLOCK + "\n\n<tool",
    ],
)
def test_hermes_every_split_gives_what_the_whole_gives(text):
    content, calls = hermes(text)
    assert content or calls  # each of these outputs yields something to compare


def test_hermes_close_tag_inside_a_string_ends_the_block():
    # The first </tool_call> closes the block, as a model's own parser would read it.
    text = '<tool_call>{"name": "x", "arguments": {"s": "</tool_call>"}}</tool_call>'
    content, calls = hermes(text)
    assert calls == [] and content == text


def test_hermes_ids_are_unique_and_openai_shaped():
    stream = HermesToolStream()
    run(stream, [(WEATHER_BLOCK + "\n") * 5])
    ids = [c.id for c in stream.calls]
    assert len(ids) == 5 and len(set(ids)) == 5 and all(CALL_ID.fullmatch(i) for i in ids)


# -- schemas, parser choice, making a stream, finish reasons -------------------------------------------------


def test_required_schema_shape():
    def choice(name: str, parameters: dict) -> dict:
        return {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }

    schema = required_schema(FUNCTIONS, parallel=True)
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [choice("get_weather", WEATHER), choice("get_time", {"type": "object"})]},
    }
    single = required_schema(FUNCTIONS, parallel=False)
    assert single["maxItems"] == 1 and single["minItems"] == 1
    assert {k: v for k, v in single.items() if k != "maxItems"} == schema


def test_required_schema_validates_calls():
    jsonschema = pytest.importorskip("jsonschema")
    many, single = required_schema(FUNCTIONS, parallel=True), required_schema(FUNCTIONS, parallel=False)
    calls = json.loads(TWO_CALLS)
    jsonschema.validate(calls, many)
    jsonschema.validate(calls[:1], single)
    bad = [
        [],  # at least one call
        [{"name": "nope", "parameters": {}}],  # an unknown function
        [{"name": "get_weather", "parameters": {"unit": "c"}}],  # its own schema: city required
        [{"name": "get_time"}],  # parameters required
        [{"name": "get_time", "parameters": {}, "extra": 1}],  # no other keys
    ]
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls, single)  # parallel_tool_calls false: one call


def test_named_schema_is_the_parameters_or_any_object():
    assert named_schema(FUNCTIONS[0]) == WEATHER
    assert named_schema(FUNCTIONS[1]) == {"type": "object"}


def test_parser_for_template():
    qwen = '{%- if tools %}...<tool_call>\\n{"name": <function-name>, ...}\\n</tool_call>{%- endif %}'
    assert parser_for_template(qwen) == "hermes" and "hermes" in TOOL_CALL_PARSERS
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert parser_for_template("<TOOL_CALL> is not the tag") is None
    assert parser_for_template(None) is None


def test_make_stream_for_each_tool_choice():
    assert make_stream("none", FUNCTIONS, "hermes") is None
    assert isinstance(make_stream("auto", FUNCTIONS, "hermes"), HermesToolStream)
    assert isinstance(make_stream("required", FUNCTIONS, None), RequiredToolStream)
    named = make_stream(("function", "get_time"), FUNCTIONS, None)
    assert isinstance(named, NamedToolStream) and named.name == "get_time"


@pytest.mark.parametrize(
    ("choice", "parser"),
    [("auto", None), ("auto", "mistral"), (("function", "nope"), None), ("sometimes", None)],
)
def test_make_stream_refuses(choice, parser):
    with pytest.raises(ValueError):
        make_stream(choice, FUNCTIONS, parser)


def _with_calls(stream: ToolCallStream, text: str) -> ToolCallStream:
    run(stream, [text])
    return stream


def test_finish_reason_rules():
    required = _with_calls(RequiredToolStream(), TWO_CALLS)
    auto = _with_calls(HermesToolStream(), WEATHER_BLOCK)
    named = _with_calls(NamedToolStream("f"), "{}")
    no_calls = _with_calls(HermesToolStream(), "just text")
    assert named.calls and no_calls.calls == []
    for stream in (required, auto):
        assert finish_reason(stream, "stop") == "tool_calls"
        assert finish_reason(stream, "length") == "length"
        assert finish_reason(stream, None) is None
    assert finish_reason(named, "stop") == "stop"  # as OpenAI reports a forced function
    assert finish_reason(named, "length") == "length"
    assert finish_reason(no_calls, "stop") == "stop"
    assert finish_reason(_with_calls(RequiredToolStream(), "[{"), "stop") == "stop"  # made no call
    assert finish_reason(None, "stop") == "stop"


# -- Llama 3 JSON calls ----------------------------------------------------------------------------------


def llama3(text: str) -> tuple[str, list[tuple[str, str]]]:
    return assert_split_invariant(Llama3JsonToolStream, text)


def test_llama3_one_call_and_calls_separated_by_semicolons():
    one = '{"name": "get_weather", "parameters": {"city": "Zürich", "days": [1, 2]}}'
    assert llama3(one) == ("", [("get_weather", '{"city": "Zürich", "days": [1, 2]}')])
    two = ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "}; {"}}\n'
    assert llama3(two) == ("", [("a", "{}"), ("b", '{"x": "}; {"}')])


@pytest.mark.parametrize(
    "text",
    [
        "The weather is {fine}.",  # text first: content
        "{not json at all",  # held, then sent as it was
        '{"name": "a", "parameters": {}} and some words',  # more than calls: all content
        '{"name": "a", "parameters": [1]}',  # arguments not an object
        '{"parameters": {}}',  # no name
        "<|python",  # what could have become the tag
        "",
        "   ",
    ],
)
def test_llama3_anything_but_calls_is_content_as_written(text):
    assert llama3(text) == (text, [])


def test_llama3_text_that_is_not_a_call_streams_at_once():
    stream = Llama3JsonToolStream()
    assert stream.feed("  ") == ("", [])
    assert stream.feed("Hi") == ("  Hi", [])  # decided: content from here on, as it comes
    assert stream.feed(" {there}") == (" {there}", [])
    assert stream.finish() == ("", [])


def test_llama3_parser_is_recognised_and_made():
    template = (
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
        "value}. Do not use variables."
    )
    assert parser_for_template(template) == "llama3_json" and "llama3_json" in TOOL_CALL_PARSERS
    assert isinstance(make_stream("auto", FUNCTIONS, "llama3_json"), Llama3JsonToolStream)
    stream = make_stream("auto", FUNCTIONS, "llama3_json")
    run(stream, ['{"name": "get_weather", "parameters": {}}'])
    assert finish_reason(stream, "stop") == "tool_calls"
