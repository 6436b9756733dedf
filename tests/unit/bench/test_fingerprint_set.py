"""bench.fingerprint_set against a Python set, across the merges of its sorted array."""

import random

import pytest

from bench.fingerprint_set import FingerprintSet
from router.hashing import hash_request_blocks, root_hash


def _hashes(rng: random.Random, count: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(count)]


def test_membership_matches_a_python_set_across_merges():
    rng = random.Random(7)
    blocks, reference = FingerprintSet(min_buffer_blocks=8), set()
    pool = _hashes(rng, 400)
    for _ in range(60):
        batch = rng.sample(pool, rng.randint(0, 12))  # re-adds held blocks too
        blocks.update(batch)
        reference.update(batch)
        probes = rng.sample(pool, 20)
        assert [p in blocks for p in probes] == [p in reference for p in probes]
    assert len(blocks) == len(reference)
    assert not any(h in blocks for h in _hashes(rng, 200))


def test_a_block_added_twice_counts_once():
    blocks = FingerprintSet(min_buffer_blocks=2)
    chain = hash_request_blocks(list(range(64)), 16, root_hash("m", None))
    blocks.update(chain[:3])
    blocks.update(chain[:3])  # the first three are merged by now; these sit beside them until the next merge
    blocks.update(chain[3:])
    assert len(blocks) == 4
    assert all(h in blocks for h in chain)


def test_hashes_of_another_size_are_rejected():
    with pytest.raises(ValueError, match="16 bytes"):
        FingerprintSet().update([b"short"])
    with pytest.raises(ValueError, match="min_buffer_blocks"):
        FingerprintSet(min_buffer_blocks=0)
