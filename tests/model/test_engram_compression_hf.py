"""Engram compression (DESIGN section 2) on a Hugging Face tokenizer: a byte-level BPE trained here on a
small corpus with accents, case variants, whitespace tokens and special tokens, wrapped in transformers'
PreTrainedTokenizerFast, as a checkpoint's tokenizer.json would load."""

from unicodedata import ucd_3_2_0

import pytest
import tokenizers
import transformers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

from raystate.model import compressed_vocab_from_tokenizer, engram_normalize

SPECIALS = ["<s>", "</s>", "<pad>", "<|User|>"]
WORDS = ["café", "Café", "CAFÉ", "cafe", "naïve", "Naïve", "NAÏVE", "naive", "The", "the", "THE", "ﬁ", "fi"]
SPACES = [" ", "  ", "\t", "\n", "\n\n", "\r\n"]
PROSE = [
    "The naïve critic wrote a résumé of every café on the Rue de la Paix, and the CAFÉ owners read it twice.",
    "Crème brûlée, jalapeño, façade, coöperate, déjà vu: Zoë and Chloé tasted each entrée.",
    "Straße and STRASSE, ΣΟΦΙΑ and σοφία, 東京 and Ｔｏｋｙｏ, ① and ⅻ: compatibility forms fold under NFKC.",
    "Tokenizers learn merges from counts; frequent words become one token, rare ones stay split in bytes.",
]
# Each word alone (a token without a leading space) and in a sentence (with one), often enough for the
# trainer to merge every word into one token; every whitespace run alone too; and some prose.
CORPUS = (WORDS + SPACES + [" ".join(WORDS)] + PROSE) * 8


@pytest.fixture(scope="module")
def tokenizer():
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    assert len(hf) > 256 + len(SPECIALS) + 200  # a few hundred merges on top of the bytes and specials
    return hf


@pytest.fixture(scope="module")
def compressed(tokenizer):
    return compressed_vocab_from_tokenizer(tokenizer, tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def decoded(tokenizer):
    return [tokenizer.decode([i], skip_special_tokens=False) for i in range(len(tokenizer))]


def ids_of(decoded, texts):
    """The id whose text is each of `texts`: the corpus makes every one of them a single token."""
    by_text = {}
    for i, text in enumerate(decoded):
        by_text.setdefault(text, i)
    missing = [t for t in texts if t not in by_text]
    assert not missing, f"not single tokens: {missing!r}"
    return [by_text[t] for t in texts]


def reference_normalizer():
    """The normalizer sequence of DeepSeek's Engram reference, built from `tokenizers` itself."""
    sentinel = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )


def test_lookup_is_dense_and_numbered_by_first_appearance(tokenizer, compressed):
    lookup, num_compressed, pad_id = compressed
    assert lookup.dtype.name == "int64" and lookup.shape == (len(tokenizer),)
    assert sorted(set(lookup.tolist())) == list(range(num_compressed))
    assert all(lookup[i] <= lookup[:i].max(initial=-1) + 1 for i in range(len(lookup)))
    assert num_compressed < len(tokenizer)
    assert pad_id == lookup[tokenizer.pad_token_id]


def test_equals_the_reference_built_with_tokenizers_normalizers(tokenizer, compressed, decoded):
    norm = reference_normalizer()
    numbers = {}
    for i, text in enumerate(decoded):
        key = tokenizer.convert_ids_to_tokens(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        numbers.setdefault(key, len(numbers))
        assert compressed[0][i] == numbers[key], (i, text)
    assert compressed[1] == len(numbers)


def test_engram_normalize_equals_the_tokenizers_normalizer(decoded):
    """Every character of Unicode 3.2 in two busy ranges, and tricky strings. (`tokenizers` 0.23 normalizes
    with Unicode 10-era tables and lowercases with Rust's, Python 3.11 has Unicode 14: the two differ on
    442 code points, all assigned in Unicode 11 or later.)"""
    norm = reference_normalizer()
    old = [chr(c) for c in (*range(0x3000), *range(0xF900, 0x10000)) if ucd_3_2_0.category(chr(c)) != "Cn"]
    samples = decoded + old + [
        " a  b ", "\t", "x\ue000", "\ue000", "ΑΣ", "ǅ", "İ", "Å", "e\u0301\u0301", "\u00a0", "\x1c x \x1f",
        "\u2028", "\u200b", "\ufeff", "①", "㎏", "ｶﾞ", "\u0345", "Ⅻ", "ß",
    ]  # fmt: skip
    assert [engram_normalize(s) for s in samples] == [norm.normalize_str(s) for s in samples]


def test_accent_and_case_variants_share_a_key(compressed, decoded):
    lookup = compressed[0]
    for group in (
        ["café", "Café", "CAFÉ", "cafe", " café", " Café", " CAFÉ", " cafe"],
        ["naïve", "Naïve", "NAÏVE", "naive", " naïve", " NAÏVE"],
        ["The", "the", "THE", " The", " the"],
        ["ﬁ", "fi", " ﬁ", " fi"],  # NFKC ligature
    ):
        ids = ids_of(decoded, group)
        assert len({int(lookup[i]) for i in ids}) == 1, group
    assert len({int(lookup[i]) for i in ids_of(decoded, ["café", "naïve", "the", "fi"])}) == 4


def test_whitespace_tokens_keep_one_space(compressed, decoded):
    lookup = compressed[0]
    ids = ids_of(decoded, SPACES)
    assert len({int(lookup[i]) for i in ids}) == 1  # collapsed to one space, which Strip leaves alone
    space = int(lookup[ids[0]])
    assert all(int(lookup[i]) != space for i, text in enumerate(decoded) if text.strip(" \t\r\n"))


def test_specials_keep_their_text(tokenizer, compressed, decoded):
    lookup, _, pad_id = compressed
    ids = tokenizer.convert_tokens_to_ids(SPECIALS)
    assert [decoded[i] for i in ids] == SPECIALS  # decoded with skip_special_tokens=False
    assert len({int(lookup[i]) for i in ids}) == len(SPECIALS)
    assert pad_id == lookup[tokenizer.convert_tokens_to_ids("<pad>")]
    assert engram_normalize("<|User|>") == "<|user|>"  # normalized like any text: lowercased


def test_partial_utf8_tokens_are_keyed_by_their_raw_string(tokenizer, compressed, decoded):
    lookup = compressed[0]
    partial = [i for i, text in enumerate(decoded) if "\ufffd" in text]
    assert len(partial) >= 64  # at least the lone bytes 0x80..0xff of the byte-level alphabet
    raw = tokenizer.convert_ids_to_tokens(partial)
    assert len(set(raw)) == len(partial)
    # Raw byte-level strings such as "Ã" never equal a normalized key here, so every one is apart.
    assert len({int(lookup[i]) for i in partial}) == len(partial)
    others = {int(lookup[i]) for i in range(len(decoded)) if i not in set(partial)}
    assert others.isdisjoint(int(lookup[i]) for i in partial)
