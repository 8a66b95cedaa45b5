"""engram_hash (DESIGN sections 1 and 2) against the literal scalar oracle and the vectorised reference."""

import numpy as np
import pytest
import torch

from raystate.kernels import engram_hash, engram_hash_ref, engram_hash_scalar, gather_lookback


def _primes_from(start: int, count: int) -> list[int]:
    found, n = [], max(start, 2)
    while len(found) < count:
        if all(n % d for d in range(2, int(n**0.5) + 1)):
            found.append(n)
        n += 1
    return found


class Params:
    """One engram layer's hash tables built the way DESIGN section 2 says (CPU tensors)."""

    def __init__(self, layer_id: int, order: int, heads: int, vocab: int, compressed: int, seed: int):
        bound = max(1, (2**63 - 1) // compressed // 2)
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, order)
        self.multipliers = torch.tensor([2 * int(x) + 1 for x in draws], dtype=torch.int64)  # [N]
        primes = _primes_from(1000 + 37 * seed, (order - 1) * heads)
        self.primes = torch.tensor(primes, dtype=torch.int64).view(order - 1, heads)  # [N - 1, H]
        self.offsets = torch.tensor([0] + primes[:-1], dtype=torch.int64).cumsum(0)  # [(N - 1) * H]
        gen = torch.Generator().manual_seed(seed)
        self.compress = torch.randint(0, compressed, (vocab,), generator=gen, dtype=torch.int64)  # [vocab]
        self.pad_id = compressed - 1
        self.vocab = vocab

    def tables(self, copy=lambda t: t) -> tuple[torch.Tensor, ...]:
        return tuple(copy(t) for t in (self.compress, self.multipliers, self.primes, self.offsets))

    def scalar(self, ids: list[int], lookback: list[int]) -> list[list[int]]:
        return engram_hash_scalar(ids, lookback, *self.tables(lambda t: t.tolist()), self.pad_id)


def _hash_on(on_device, params: Params, input_ids, qsl, lookback) -> torch.Tensor:
    tensors = (on_device(input_ids), on_device(qsl), on_device(lookback), *params.tables(on_device))
    return engram_hash(*tensors, params.pad_id).cpu()


def _hash_ref(params: Params, input_ids, qsl, lookback) -> torch.Tensor:
    return engram_hash_ref(input_ids, qsl, lookback, *params.tables(), params.pad_id)


@pytest.mark.parametrize("seed", range(8))
def test_mixed_batches_match_scalar_oracle_and_reference(on_device, seed):
    rng = np.random.default_rng(seed)
    for order in (2, 3, 4, 5):
        params = Params(
            layer_id=seed + order,
            order=order,
            heads=int(rng.integers(1, 5)),
            vocab=300,
            compressed=int(rng.integers(5, 40)),
            seed=seed,
        )
        depth = order - 1
        lengths = rng.integers(0, 9, int(rng.integers(1, 7)))
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        num_tokens = int(qsl[-1])
        padding = int(rng.integers(0, 4))
        input_ids = torch.tensor(rng.integers(0, params.vocab, num_tokens + padding), dtype=torch.int32)
        lookback = torch.tensor(rng.integers(0, params.vocab, (len(lengths) + 2, depth)), dtype=torch.int32)
        for b in range(len(lengths)):
            chunk_start = int(rng.integers(0, depth + 2))
            lookback[b, chunk_start:] = -1  # positions below 0
            if rng.random() < 0.3:  # a block in the middle: it and every longer order use pad_id
                lookback[b, int(rng.integers(0, depth))] = -1

        got = _hash_on(on_device, params, input_ids, qsl, lookback)
        assert got.shape == (num_tokens + padding, depth * params.primes.shape[1])
        assert torch.equal(got, _hash_ref(params, input_ids, qsl, lookback))
        want = []
        for b in range(len(lengths)):
            want += params.scalar(input_ids[qsl[b] : qsl[b + 1]].tolist(), lookback[b].tolist())
        want += params.scalar([-1] * padding, [])  # graph padding: blocked from distance 0
        assert got.tolist() == want


def test_lookback_narrower_than_the_order_blocks_the_rest(on_device):
    # D = 1 with N = 4: distances past the one stored id are blocks (the reference used to clamp instead).
    params = Params(layer_id=3, order=4, heads=2, vocab=50, compressed=11, seed=1)
    input_ids = torch.tensor([5, 9, 13, 2, 44], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    lookback = torch.tensor([[7], [30]], dtype=torch.int32)
    got = _hash_on(on_device, params, input_ids, qsl, lookback)
    assert torch.equal(got, _hash_ref(params, input_ids, qsl, lookback))
    assert got.tolist() == params.scalar([5, 9], [7]) + params.scalar([13, 2, 44], [30])


def test_negative_pad_id_uses_floor_modulo(on_device):
    params = Params(layer_id=2, order=3, heads=3, vocab=40, compressed=9, seed=4)
    params.pad_id = -3  # a negative mix: buckets must still be h mod p in [0, p), as in Python
    input_ids = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    lookback = torch.tensor([[-1, -1], [6, -1]], dtype=torch.int32)
    got = _hash_on(on_device, params, input_ids, qsl, lookback)
    assert got.tolist() == params.scalar([1], [-1, -1]) + params.scalar([2, 3, 4], [6, -1])
    assert torch.equal(got, _hash_ref(params, input_ids, qsl, lookback))


def test_empty_batch_and_padding_only(on_device):
    params = Params(layer_id=1, order=2, heads=2, vocab=20, compressed=7, seed=0)
    qsl = torch.zeros(1, dtype=torch.int32)
    lookback = torch.full((4, 1), -1, dtype=torch.int32)
    got = _hash_on(on_device, params, torch.zeros(0, dtype=torch.int32), qsl, lookback)
    assert got.shape == (0, 2)
    got = _hash_on(on_device, params, torch.tensor([3, 4, 5], dtype=torch.int32), qsl, lookback)
    assert got.tolist() == params.scalar([-1] * 3, [])
    assert torch.equal(got, _hash_ref(params, torch.tensor([3, 4, 5], dtype=torch.int32), qsl, lookback))


def test_out_is_filled_in_place(on_device):
    params = Params(layer_id=5, order=3, heads=2, vocab=60, compressed=13, seed=2)
    input_ids = torch.tensor([10, 11, 12, 13, 14], dtype=torch.int64)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    lookback = torch.tensor([[20, 21], [-1, -1]], dtype=torch.int32)
    out = on_device(torch.full((8, 4), -7, dtype=torch.int64))
    tensors = (on_device(input_ids), on_device(qsl), on_device(lookback), *params.tables(on_device))
    result = engram_hash(*tensors, params.pad_id, out)
    assert result is out
    assert out[:5].cpu().tolist() == params.scalar([10, 11, 12], [20, 21]) + params.scalar([13, 14], [-1, -1])
    assert (out[5:] == -7).all()  # rows past input_ids are not touched


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_out_of_range_ids_are_blocks_on_every_path(on_device, ids_dtype):
    """Ids outside [0, vocab), in the chunk or the lookback, are blocks on every path, with no read past
    `compress`: the kernel gets compress as the head of a longer buffer whose tail holds other compressed
    ids, so a load past vocab would change the hash instead of going unnoticed."""
    vocab = 300
    params = Params(layer_id=4, order=4, heads=3, vocab=vocab, compressed=17, seed=6)
    bad = [-1, vocab, vocab + 1000, 2**31 - 1]
    input_ids = torch.tensor(
        [5, -1, 7, 8, vocab, 9, 10, 11, vocab + 1000, 12, 2**31 - 1, 13, 299, 0, 14, 15], dtype=ids_dtype
    )
    qsl = torch.tensor([0, 4, 9, 13, 15], dtype=torch.int32)  # one padded token past qsl[B]
    lookback = torch.tensor(
        [[vocab, 3, 4], [20, 2**31 - 1, 21], [22, 23, 24], [-7, 25, 26]], dtype=torch.int32
    )
    assert set(bad) <= set(input_ids.tolist())

    tail = torch.randint(0, 17, (vocab + 2000,), generator=torch.Generator().manual_seed(1))
    buffer = on_device(torch.cat([params.compress, tail]))  # int64 [vocab + vocab + 2000]
    tables = (buffer[:vocab], *params.tables(on_device)[1:])
    got = engram_hash(on_device(input_ids), on_device(qsl), on_device(lookback), *tables, params.pad_id)
    expected = _hash_ref(params, input_ids, qsl, lookback)
    assert torch.equal(got.cpu(), expected)

    want = []
    for b in range(qsl.shape[0] - 1):
        want += params.scalar(input_ids[qsl[b] : qsl[b + 1]].tolist(), lookback[b].tolist())
    want += params.scalar([-1], [])  # the padded token
    assert expected.tolist() == want
    # Each out-of-range id hashes exactly as a -1 (a block) in its place would.
    as_blocks = torch.where((input_ids < 0) | (input_ids >= vocab), -1, input_ids)
    lookback_blocks = torch.where((lookback < 0) | (lookback >= vocab), -1, lookback)
    assert torch.equal(expected, _hash_ref(params, as_blocks, qsl, lookback_blocks))


@pytest.mark.parametrize("seed", range(4))
def test_any_chunking_gives_the_cold_hash(on_device, seed):
    """Requests hashed chunk by chunk in mixed batches, with ids before each chunk from gather_lookback,
    give exactly the hash of the whole sequence computed in one chunk from position 0."""
    rng = np.random.default_rng(100 + seed)
    params = Params(layer_id=7, order=4, heads=3, vocab=500, compressed=23, seed=seed)
    num_slots, max_len, depth = 5, 40, 3
    history = torch.tensor(rng.integers(0, params.vocab, (num_slots, max_len + 6)), dtype=torch.int32)
    history = history[:, :max_len]  # row stride larger than L
    lengths = rng.integers(1, max_len + 1, num_slots)
    cold = [params.scalar(history[s, : lengths[s]].tolist(), []) for s in range(num_slots)]

    # Some requests start mid-sequence, as after a prefix hit or on a shard taking over a request.
    done = [int(rng.integers(0, n)) if rng.random() < 0.4 else 0 for n in lengths]
    num_computed = on_device(torch.tensor(done, dtype=torch.int32))
    lookback = on_device(torch.empty(num_slots + 2, depth, dtype=torch.int32))
    history_dev = on_device(history)
    while any(done[s] < lengths[s] for s in range(num_slots)):
        live = [s for s in range(num_slots) if done[s] < lengths[s]]
        rows = [int(s) for s in rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]]
        chunk_lens = [int(rng.integers(1, lengths[s] - done[s] + 1)) for s in rows]
        idx_mapping = torch.tensor(rows, dtype=torch.int32)
        num_computed.copy_(torch.tensor(done, dtype=torch.int32))
        lookback.fill_(999)
        gather_lookback(lookback, on_device(idx_mapping), num_computed, history_dev, len(rows))
        ids = torch.cat([history[s, done[s] : done[s] + n] for s, n in zip(rows, chunk_lens, strict=True)])
        qsl = torch.tensor([0] + chunk_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        got = _hash_on(on_device, params, ids, qsl, lookback)
        for b, (s, n) in enumerate(zip(rows, chunk_lens, strict=True)):
            assert got[qsl[b] : qsl[b + 1]].tolist() == cold[s][done[s] : done[s] + n]
            done[s] += n


@pytest.mark.gpu
def test_no_host_sync():
    params = Params(layer_id=5, order=3, heads=2, vocab=60, compressed=13, seed=2)
    input_ids = torch.tensor([10, 11, 12, 13, 14, 0, 0], dtype=torch.int64)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    lookback = torch.tensor([[20, 21], [-1, -1]], dtype=torch.int32)
    tensors = [t.cuda() for t in (input_ids, qsl, lookback, *params.tables())]
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = engram_hash(*tensors, params.pad_id)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), _hash_ref(params, input_ids, qsl, lookback))
