"""Chained block hashes: whole blocks, chained on the parent, the same in every process."""

import array
import os
import subprocess
import sys

from raystate.messages import ids_to_bytes
from raystate.scheduler.prefix_cache import (
    ROOT_HASH,
    PrefixIndex,
    PromptHasher,
    extend_block_hashes,
    hash_block,
)

BS = 4


def chain(tokens, bs=BS):
    hashes = []
    extend_block_hashes(hashes, array.array("i", tokens), bs, len(tokens) // bs)
    return hashes


def test_matches_the_chained_definition_and_only_whole_blocks():
    tokens = list(range(50, 61))  # 11 tokens: 2 whole blocks
    hashes = chain(tokens)
    assert len(hashes) == 2
    parent = ROOT_HASH
    for j, h in enumerate(hashes):
        parent = hash_block(parent, ids_to_bytes(tokens[j * BS : (j + 1) * BS]))
        assert h == parent


def test_incremental_extension_equals_one_shot():
    tokens = array.array("i", range(40))
    hashes: list[bytes] = []
    for n in (1, 3, 3, 7, 10):
        extend_block_hashes(hashes, tokens, BS, n)
    assert hashes == chain(list(range(40)))


def test_same_block_after_different_prefixes_hashes_differently():
    a = chain([1, 2, 3, 4, 9, 9, 9, 9])
    b = chain([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]
    assert chain([1, 2, 3, 4, 9, 9, 9, 9, 7, 7, 7, 7])[:2] == a


def test_deterministic_across_processes():
    code = (
        "import array; from raystate.scheduler.prefix_cache import extend_block_hashes as e; h = [];"
        "e(h, array.array('i', range(300, 340)), 4, 10); print(','.join(x.hex() for x in h))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().split(",") == [h.hex() for h in chain(list(range(300, 340)))]


def test_index_keeps_the_first_block_and_forgets_only_its_own_entry():
    idx = PrefixIndex()
    h = chain([1, 2, 3, 4])[0]
    assert idx.insert(h, 5)
    assert not idx.insert(h, 6)
    assert idx.get(h) == 5
    idx.forget(h, 6)
    assert idx.get(h) == 5
    idx.forget(h, 5)
    assert h not in idx and len(idx) == 0


def test_prompt_hasher_equals_hashing_from_scratch():
    """Whatever the last prompt was (a shared prefix of any length, longer, shorter, a block that differs
    in its last id), the reused hashes plus the new ones equal the chain hashed from scratch."""
    import random

    rng = random.Random(5)
    hasher = PromptHasher(BS)
    base = [rng.randrange(256) for _ in range(64)]
    prompts = [base[:40] + [1, 2, 3], base[:41] + [9] * 6, base[:7], base, base[:39] + [0] + base[40:]]
    prompts += [[rng.randrange(256) for _ in range(rng.randrange(1, 70))] for _ in range(30)]
    for _ in range(40):
        cut = rng.randrange(0, 64)
        prompts.append(base[:cut] + [rng.randrange(256) for _ in range(rng.randrange(0, 20))])
    for tokens in prompts:
        hashes: list[bytes] = []
        hasher.hash_prompt(array.array("i", tokens), hashes, len(tokens) // BS)
        assert hashes == chain(tokens)
