"""Streams: never half a character, in the end `decode(all_ids)`; stop strings across token boundaries."""

from __future__ import annotations

import random

import pytest
from hf_checkpoint import TEXTS

from raystate.hf import HFTextStream, HFTokenizer, IncrementalDetokenizer
from raystate.hf.tokenizer import CLEANUP_REACH, clean_up_tokenization
from raystate.serve.detokenize import StopStrings, TextStream
from raystate.tokenizer import ByteTokenizer

STREAM_TEXTS = [*TEXTS, "".join(TEXTS), "😀" * 5 + "日本語" * 3 + "é" * 4]


@pytest.fixture(scope="module")
def tokenizers_(checkpoints):
    return {name: HFTokenizer.from_pretrained(path) for name, path in checkpoints.items()}


def _stream(tok, ids, skip=True, chunk=1, stop=None):
    ts = HFTextStream(tok, stop=stop, skip_special_tokens=skip)
    deltas = [ts.push(ids[i : i + chunk], final=i + chunk >= len(ids)) for i in range(0, len(ids), chunk)]
    if not ids:
        deltas.append(ts.push([], final=True))
    return deltas, ts


def test_characters_do_split_across_tokens(tokenizers_):
    """The fixture is meaningful: in each tokenizer some token alone decodes to half a character (for
    characters the corpus lacks, a certainty: byte-level pieces or byte-fallback tokens; training may
    break ties differently from run to run, so the test does not rely on the corpus's characters)."""
    for tok in tokenizers_.values():
        ids = tok.encode("𝔘𝔫𝔦 \U0001f9ec ꙮ", False)
        assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("name", ["chatml", "llama3", "spm"])
def test_valid_text_streams_whole_characters_and_ends_equal_to_decode(tokenizers_, name):
    tok = tokenizers_[name]
    for text in STREAM_TEXTS:
        ids = tok.encode(text)  # with BOS where the checkpoint adds one (skipped in the output)
        for chunk in (1, 2, 3):
            deltas, ts = _stream(tok, ids, chunk=chunk)
            assert all("\ufffd" not in d for d in deltas), (text, deltas)
            assert "".join(deltas) == ts.text == tok.decode(ids), text
        assert tok.decode(ids) == text or name == "spm"  # byte-level BPE round-trips exactly


@pytest.mark.parametrize("name", ["chatml", "llama3", "spm"])
@pytest.mark.parametrize("skip", [True, False])
def test_arbitrary_ids_end_equal_to_decode(tokenizers_, name, skip):
    """Sampled ids: invalid UTF-8, specials anywhere; the stream still ends equal to decode."""
    tok = tokenizers_[name]
    rng = random.Random(1)
    for _ in range(150):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 30))]
        deltas, ts = _stream(tok, ids, skip=skip, chunk=rng.choice([1, 1, 2, 5]))
        whole = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == ts.text
        # byte-fallback decodes a run of byte tokens that is not valid UTF-8 as one U+FFFD per byte, after
        # the stream may have sent the run's first whole characters (module docstring)
        if name != "spm" or "\ufffd" not in whole:
            assert ts.text == whole, ids


@pytest.mark.parametrize("name", ["chatml", "llama3", "spm"])
def test_the_text_does_not_depend_on_how_the_ids_are_grouped(tokenizers_, name):
    """How many tokens an update carries follows the server's load; the text must not (a byte-fallback
    run pushed at once once decoded to U+FFFD where token by token it gave whole characters)."""
    tok = tokenizers_[name]
    rng = random.Random(2)
    for _ in range(150):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        one_by_one, _ = _stream(tok, ids, chunk=1)
        for chunk in (2, 3, 7, len(ids)):
            deltas, _ = _stream(tok, ids, chunk=chunk)
            assert "".join(deltas) == "".join(one_by_one), (ids, chunk)


def test_specials_shown_when_asked(tokenizers_):
    tok = tokenizers_["chatml"]
    ids = tok.encode("Hi<|im_end|>", False)
    assert "".join(_stream(tok, ids, skip=False)[0]) == "Hi<|im_end|>"
    assert "".join(_stream(tok, ids, skip=True)[0]) == "Hi"


def test_a_split_character_waits_for_its_last_token(tokenizers_):
    tok = tokenizers_["chatml"]
    ids = tok.encode("a😀", False)
    det = IncrementalDetokenizer(tok)
    deltas = [det.push([i]) for i in ids]
    assert "".join(deltas) == "a😀"
    assert deltas[-1].endswith("😀") and all("😀" not in d for d in deltas[:-1])


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize("name", ["chatml", "llama3", "spm"])
def test_stop_strings_across_token_boundaries(tokenizers_, name):
    tok = tokenizers_[name]
    text = "Hello world, café 日本語 and 😀🎉 then the end."
    ids = tok.encode(text, False)
    decoded = tok.decode(ids)
    for stops in (
        ["o w"],
        ["本語 a"],
        ["😀🎉"],
        ["é 日"],
        ["end."],
        ["nowhere"],
        ["world", "Hello"],
        ["d, c", "th"],
    ):
        for chunk in (1, 2):
            deltas, ts = _stream(tok, ids, chunk=chunk, stop=stops)
            want, stopped = _reference_stop(decoded, stops)
            assert "".join(deltas) == ts.text == want, stops
            assert ts.stopped == stopped
            assert not any(s in d for s in stops for d in deltas)
            assert all("\ufffd" not in d for d in deltas)


def test_stop_string_split_inside_a_character(tokenizers_):
    """A stop string ending in a multi-byte character: the matcher sees whole characters only."""
    tok = tokenizers_["chatml"]
    ids = tok.encode("xx𝔘yy", False)  # 𝔘 is not in the corpus: four byte-level pieces
    assert len(ids) >= 4
    deltas, ts = _stream(tok, ids, stop=["x𝔘"])
    assert "".join(deltas) == "x" and ts.stopped


def test_stop_strings_match_serve_textstream_on_byte_tokens():
    """On the byte tokenizer, HFTextStream (a generic detokenizer) gives serve's TextStream's deltas'
    concatenation and stop results."""
    rng = random.Random(3)
    tok = ByteTokenizer()
    for _ in range(100):
        text = "".join(rng.choice(["a", "b", "é", "😀", " ", "ab"]) for _ in range(rng.randrange(0, 20)))
        ids = tok.encode(text, add_bos=rng.random() < 0.5)
        stops = [rng.choice(["ab", "b é", "😀a", "zz", "a"])]
        ours = HFTextStream(tok, stops)
        theirs = TextStream(stops)
        a = "".join(ours.push([i], final=k == len(ids) - 1) for k, i in enumerate(ids))
        b = "".join(theirs.push([i], final=k == len(ids) - 1) for k, i in enumerate(ids))
        assert a == b and ours.stopped == theirs.stopped


def test_stop_strings_hold_back_a_possible_prefix():
    st = StopStrings(["abc"])
    assert st.push("xa") == "x"
    assert st.push("b") == ""
    assert st.push("d") == "abd"
    assert st.push("ab", final=True) == "ab"
    assert not st.stopped
    st = StopStrings(["abc", "bcd"])
    assert st.push("zab") == "z"
    assert st.push("cd") == "" and st.stopped and st.text == "z"


def test_cleanup_reach_bounds_the_change_a_later_text_makes():
    """transformers' clean-up of spaces, applied to a growing text, never changes more than the last
    CLEANUP_REACH characters of what it gave for a prefix."""
    rng = random.Random(5)
    alphabet = [" ", ".", "'", "n", "t", "s", "m", "v", "e", "r", "x", ",", "?", "!"]
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 24)))
        whole = clean_up_tokenization(s)
        for k in range(len(s) + 1):
            part = clean_up_tokenization(s[:k])
            assert whole.startswith(part[: max(0, len(part) - CLEANUP_REACH)])


@pytest.fixture(scope="module")
def wordpiece_checkpoint(tmp_path_factory):
    """A WordPiece tokenizer with `clean_up_tokenization_spaces: true`: the one kind whose decode
    transformers cleans up."""
    import transformers
    from hf_checkpoint import CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[SEP]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder = tmp_path_factory.mktemp("wordpiece")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="[SEP]", clean_up_tokenization_spaces=True
    ).save_pretrained(str(folder))
    return folder


def test_cleaned_up_stream_ends_equal_to_decode(wordpiece_checkpoint):
    import transformers

    ours = HFTokenizer.from_pretrained(wordpiece_checkpoint)
    hf = transformers.AutoTokenizer.from_pretrained(str(wordpiece_checkpoint))
    assert ours._cleanup_applies()
    text = "I can't , you won't . Hello world ! they're here , it's fine ?"
    ids = ours.encode(text, False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert " ," not in ours.decode(ids)  # the clean-up did apply
    for chunk in (1, 2):
        deltas, ts = _stream(ours, ids, chunk=chunk)
        assert "".join(deltas) == ts.text == ours.decode(ids)
