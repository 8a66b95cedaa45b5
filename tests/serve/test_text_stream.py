"""TextStream: incremental text of byte tokens equals ByteTokenizer.decode; stop strings never leak."""

from __future__ import annotations

import random

import pytest

from raystate.serve.detokenize import TextStream
from raystate.serve.protocol import CompletionRequest, field_path, first_error
from raystate.tokenizer import ByteTokenizer


def _stream(ids: list[int], stop=None, chunk: int = 1) -> tuple[list[str], TextStream]:
    ts = TextStream(stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(ts.push(ids[i : i + chunk], final=i + chunk >= len(ids)))
    return deltas, ts


@pytest.mark.parametrize("seed", range(20))
def test_incremental_text_equals_whole_decode(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(259) for _ in range(rng.randrange(1, 80))]  # invalid UTF-8 and specials included
    deltas, ts = _stream(ids, chunk=rng.choice([1, 2, 3]))
    assert "".join(deltas) == ts.text == ByteTokenizer().decode(ids)


def test_multibyte_character_waits_for_its_last_byte():
    ids = list("é€".encode())  # 2 + 3 bytes
    deltas, _ = _stream(ids)
    assert deltas == ["", "é", "", "", "€"]


def test_stop_string_is_cut_and_never_sent():
    text = "hello world, goodbye"
    deltas, ts = _stream(list(text.encode()), stop=["world"])
    assert "".join(deltas) == "hello " == ts.text
    assert ts.stopped
    assert all("w" not in d for d in deltas)


def test_a_possible_stop_prefix_is_held_then_released():
    ts = TextStream(["abc"])
    assert ts.push(list(b"xa")) == "x"  # "a" could start "abc"
    assert ts.push(list(b"b")) == ""
    assert ts.push(list(b"d")) == "abd"  # not a stop after all
    assert ts.push(list(b"ab"), final=True) == "ab"  # the end releases everything


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_include_stop_keeps_the_stop_string(chunk):
    """vLLM's include_stop_str_in_output: the text ends after the stop string found (of several starting
    there, the shortest, which completed first), however the tokens arrive; nothing after it is sent."""
    ts = TextStream(["wor", "world"], include_stop=True)
    ids = list(b"hello world, goodbye")
    deltas = [ts.push(ids[i : i + chunk], final=i + chunk >= len(ids)) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == "hello wor" == ts.text and ts.stopped
    deltas, ts = _stream(list(b"one two three"), stop=["three", "two"])
    keep = TextStream(["three", "two"], include_stop=True)
    assert keep.push(list(b"one two three"), final=True) == "one two" and ts.text == "one "


def test_earliest_of_several_stop_strings_wins():
    deltas, ts = _stream(list(b"one two three"), stop=["three", "two"])
    assert ts.text == "one " and ts.stopped


def test_validation_errors_name_the_field():
    with pytest.raises(Exception) as e:
        CompletionRequest.model_validate({"prompt": "x", "stop": [1]})
    assert first_error(e.value)[0] == "stop"
    with pytest.raises(Exception) as e:
        CompletionRequest.model_validate({"prompt": "x", "stream_options": {"include_usage": "maybe"}})
    assert first_error(e.value)[0] == "stream_options.include_usage"
    assert field_path(("messages", 3, "content")) == "messages[3].content"
