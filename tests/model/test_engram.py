"""Engram hash constants follow DESIGN section 2; the model's hash equals the scalar oracle, any chunking."""

import random

import numpy as np
import pytest
import torch

from raystate.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from raystate.kernels import engram_hash_ref, engram_hash_scalar
from raystate.model import compressed_vocab_from_tokenizer, engram_hash_constants, engram_normalize
from raystate.model.engram import Engram
from raystate.tokenizer import ByteTokenizer

CONFIGS = [
    ModelConfig.named("tiny"),
    ModelConfig.named("bench"),
    ModelConfig(engram_layer_ids=(3, 0, 2), engram_max_ngram=3, engram_heads=3, engram_vocab_size=97),
]


def sieve(limit: int) -> list[int]:
    flags = np.ones(limit + 1, dtype=bool)
    flags[:2] = False
    for p in range(2, int(limit**0.5) + 1):
        if flags[p]:
            flags[p * p :: p] = False
    return np.nonzero(flags)[0].tolist()


def byte_keys() -> list[object]:
    """The reference's key of each byte-tokenizer id, written out by hand for this vocabulary."""
    keys: list[object] = []
    for b in range(256):
        if b >= 0x80:
            keys.append(f"<0x{b:02X}>")  # alone it is not UTF-8: decodes to U+FFFD, keyed by its raw string
        elif chr(b) in " \t\n\r":
            keys.append(" ")  # a whitespace run collapses to one space, and a lone space is kept
        else:
            keys.append(chr(b).lower())  # \v and \f strip to "" and keep their raw text
    return keys + ["<|bos|>", "<|eos|>", "<|pad|>"]


def test_byte_tokenizer_compression_follows_the_reference_rules():
    tok = ByteTokenizer()
    assert len(tok) == 259 and tok.decode([0x80], skip_special_tokens=False) == "\ufffd"
    assert tok.convert_ids_to_tokens([0x80, ord("A"), PAD_ID]) == ["<0x80>", "<0x41>", "<|pad|>"]
    lookup, num_compressed, pad_id = compressed_vocab_from_tokenizer(tok, PAD_ID)
    assert lookup.dtype == np.int64 and lookup.shape == (259,)
    numbers: dict[object, int] = {}
    assert lookup.tolist() == [numbers.setdefault(k, len(numbers)) for k in byte_keys()]
    assert num_compressed == len(numbers) == 230  # 259 - 26 letters - 3 of tab, LF, CR, space
    assert sorted(set(lookup.tolist())) == list(range(230))  # dense, numbered by first appearance
    assert all(lookup[i] <= lookup[:i].max(initial=-1) + 1 for i in range(259))
    for upper in range(ord("A"), ord("Z") + 1):
        assert lookup[upper] == lookup[upper + 32]
    assert len({int(lookup[b]) for b in b" \t\n\r"}) == 1 and lookup[ord(" ")] == 9  # first at tab
    assert len({int(lookup[b]) for b in (0x0B, 0x0C, 0x1C, 0x00, ord(" "))}) == 5
    high = [int(lookup[b]) for b in range(0x80, 0x100)]
    assert high == list(range(99, 227))  # each lone byte >= 0x80 apart from every other key
    assert pad_id == lookup[PAD_ID] == 229
    assert [int(lookup[t]) for t in (BOS_ID, EOS_ID, PAD_ID)] == [227, 228, 229]


def test_reference_models_use_the_byte_tokenizer_compression():
    lookup, num_compressed, pad_id = compressed_vocab_from_tokenizer(ByteTokenizer(), PAD_ID)
    for config in CONFIGS:
        for c in engram_hash_constants(config).values():
            assert c.compress.tolist() == lookup.tolist()
            assert (c.num_compressed, c.pad_id) == (num_compressed, pad_id)
    with pytest.raises(ValueError, match="vocab_size"):
        engram_hash_constants(ModelConfig(vocab_size=300))


@pytest.mark.parametrize(
    "text, key",
    [
        ("Café", "cafe"),
        (" CAFÉ", "cafe"),  # accents stripped after NFD, lowercased, stripped
        ("cafe\u0301", "cafe"),  # a combining mark already decomposed
        ("ﬁ", "fi"),  # NFKC ligature
        ("\u00a0x\u3000", "x"),  # NFKC turns NBSP and the ideographic space into spaces
        ("a \t\r\n b", "a b"),
        (" ", " "),
        ("\t", " "),
        ("\n\n", " "),
        ("  ", " "),  # a lone space after the collapse is kept
        ("\x0b", ""),  # not collapsed, but White_Space: stripped; the caller keeps the raw text
        ("\x1c", "\x1c"),  # not White_Space: kept, where str.strip() would drop it
        ("ΑΣ", "ασ"),  # lowercased one character at a time: no final sigma
        ("İ", "i"),  # NFD splits off the dot above, a mark
        ("x\ue000", "x "),  # the sentinel itself ends as a space
        ("", ""),
    ],
)
def test_engram_normalize(text, key):
    assert engram_normalize(text) == key


class FakeTokenizer:
    """Decodes and raw token strings given as lists: exercises the rules one id at a time."""

    def __init__(self, decoded: list[str], raw: list[str]) -> None:
        self.decoded, self.raw = decoded, raw

    def __len__(self) -> int:
        return len(self.decoded)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        assert not skip_special_tokens and len(ids) == 1
        return self.decoded[ids[0]]

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.raw[token_id]


def test_replacement_character_keys_share_the_key_space():
    tok = FakeTokenizer(
        decoded=["\ufffd", "X", "\ufffd", "\x0b", "\x0c", "", "\x0b ", "a\ufffd"],
        raw=["x", "X", "\u0120\u00e3", "\u010b", "\u010c", "", "\u010b\u0120", "a\u00e3"],
    )
    lookup, num_compressed, pad_id = compressed_vocab_from_tokenizer(tok, 7)
    # raw "x" and normalized "X" share a key; "\v", "\f" and "" keep their raw text; "\v " strips to ""
    # and keeps its text too; any U+FFFD in the text sends it to the raw string.
    assert lookup.tolist() == [0, 0, 1, 2, 3, 4, 5, 6]
    assert (num_compressed, pad_id) == (7, 6)
    with pytest.raises(ValueError, match="pad_token_id"):
        compressed_vocab_from_tokenizer(tok, 8)


@pytest.mark.parametrize("config", CONFIGS, ids=["tiny", "bench", "odd"])
def test_hash_constants_follow_spec(config):
    constants = engram_hash_constants(config)
    n, heads = config.engram_max_ngram, config.engram_heads
    layer_ids = sorted(config.engram_layer_ids)
    assert sorted(constants) == layer_ids
    num_compressed = constants[layer_ids[0]].num_compressed
    bound = max(1, (2**63 - 1) // num_compressed // 2)
    all_primes = []
    for layer_id in layer_ids:
        c = constants[layer_id]
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=n, dtype=np.int64)
        assert c.multipliers.dtype == np.int64 and c.multipliers.tolist() == (2 * draws + 1).tolist()
        assert all(m % 2 == 1 and 0 < m < 2 * bound for m in c.multipliers.tolist())
        assert c.primes.shape == (n - 1, heads)
        flat = c.primes.reshape(-1).tolist()  # order (2..N), then head
        assert c.offsets.tolist() == np.concatenate([[0], np.cumsum(flat)[:-1]]).tolist()
        assert c.table_rows == sum(flat)
        # Largest reachable id stays in the table, and int64 products cannot overflow.
        assert (num_compressed - 1) * max(c.multipliers.tolist()) < 2**63
        all_primes += flat
    primes_from = [p for p in sieve(config.engram_vocab_size + 10_000) if p >= config.engram_vocab_size]
    assert all_primes == primes_from[: len(all_primes)]  # consecutive, distinct, from the first >= V


def test_engram_table_has_a_row_per_bucket():
    config = CONFIGS[2]
    constants = engram_hash_constants(config)
    for layer_id in config.engram_layer_ids:
        engram = Engram(config, layer_id)
        assert engram.table.shape == (constants[layer_id].table_rows, config.engram_head_dim)
        assert all(
            b.dtype == torch.int64
            for b in (engram.compress, engram.multipliers, engram.primes, engram.offsets)
        )
        assert "compress" not in engram.state_dict()  # derived from the config, never saved


def scalar_oracle(engram, ids, lookback):
    return engram_hash_scalar(
        ids,
        lookback,
        engram.compress.tolist(),
        engram.multipliers.tolist(),
        engram.primes.tolist(),
        engram.offsets.tolist(),
        engram.pad_id,
    )


@pytest.mark.parametrize("layer_id", [1, 2])
def test_model_hash_equals_scalar_oracle_on_any_chunking(tiny_model, layer_id):
    """Several requests' chunks in one batch: each mid-sequence chunk gets its true lookback (newest first,
    -1 below position 0); every token's buckets equal the scalar oracle over the whole sequence."""
    engram = tiny_model.layers[layer_id].engram
    depth = tiny_model.token_lookback_depth
    rng = random.Random(layer_id)
    seqs = [[BOS_ID] + [rng.choice(list(b"abAB z.")) for _ in range(length)] for length in (12, 1, 7, 20)]
    chunk_ids, lookback_rows, want, qsl = [], [], [], [0]
    for seq in seqs:
        start = rng.randint(0, len(seq) - 1)
        end = rng.randint(start + 1, len(seq))
        lookback = [seq[start - 1 - k] if start - 1 - k >= 0 else -1 for k in range(depth)]
        chunk_ids += seq[start:end]
        lookback_rows.append(lookback)
        qsl.append(len(chunk_ids))
        want += scalar_oracle(engram, seq[:end], [-1] * depth)[start:end]  # one chunk from position 0
    args = (
        torch.tensor(chunk_ids, dtype=torch.int32),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lookback_rows + [[-1] * depth], dtype=torch.int32),
    )  # a spare row past B
    got = engram.hash(*args)  # the launcher: Triton's interpreter under TRITON_INTERPRET=1
    assert got.dtype == torch.int64
    assert got.tolist() == want
    ref = engram_hash_ref(
        *args, engram.compress, engram.multipliers, engram.primes, engram.offsets, engram.pad_id
    )
    assert ref.tolist() == want
    assert int(got.max()) < engram.table.shape[0] and int(got.min()) >= 0


def test_hash_blocks_orders_reaching_below_position_zero(tiny_model):
    """At position 1 (BOS, x) orders 3 and 4 reach below 0: they hash pad ids, unlike a true 3-gram."""
    engram = tiny_model.layers[1].engram
    heads = tiny_model.config.engram_heads
    at_start = scalar_oracle(engram, [BOS_ID, ord("a")], [])[1]
    mid = scalar_oracle(engram, [ord("z"), BOS_ID, ord("a")], [])[2]
    assert at_start[:heads] == mid[:heads]  # the 2-gram (BOS, a) is the same
    assert at_start[heads:] != mid[heads:]
