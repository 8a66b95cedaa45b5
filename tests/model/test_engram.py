"""Engram hash constants follow DESIGN section 2; the model's hash equals the scalar oracle, any chunking."""

import random

import numpy as np
import pytest
import torch

from raystate.config import BOS_ID, EOS_ID, PAD_ID, ModelConfig
from raystate.kernels import engram_hash_ref, engram_hash_scalar
from raystate.model import compressed_vocab, engram_hash_constants
from raystate.model.engram import Engram

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


def test_compressed_vocab_folds_ascii_case_and_is_dense():
    compress, pad_id = compressed_vocab(259, PAD_ID)
    assert compress.dtype == np.int64 and compress.shape == (259,)
    assert sorted(set(compress.tolist())) == list(range(259 - 26))  # dense: V' = 233
    for upper in range(ord("A"), ord("Z") + 1):
        assert compress[upper] == compress[upper + 32]
    others = [t for t in range(259) if not ord("A") <= t <= ord("Z")]
    assert len({int(compress[t]) for t in others}) == len(others)
    assert pad_id == compress[PAD_ID]
    assert len({int(compress[t]) for t in (BOS_ID, EOS_ID, PAD_ID)}) == 3


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
