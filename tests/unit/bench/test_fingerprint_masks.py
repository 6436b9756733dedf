"""bench.fingerprint_masks against a dict of masks, across the merges of its sorted arrays."""

import random

import pytest

from bench.fingerprint_masks import FingerprintMasks


@pytest.mark.parametrize("num_bits", [1, 64, 130])
def test_masks_match_a_dict_across_merges(num_bits):
    rng = random.Random(num_bits)
    masks, reference = FingerprintMasks(num_bits, min_buffer_blocks=8), {}
    pool = [rng.randbytes(16) for _ in range(300)]
    for _ in range(80):
        bit = rng.randrange(num_bits)
        batch = rng.sample(pool, rng.randint(0, 15))  # blocks already held get more bits
        masks.set_bit(batch, bit)
        for block in batch:
            reference[block] = reference.get(block, 0) | 1 << bit
        probes = rng.sample(pool, 25)
        assert [masks.get(p) for p in probes] == [reference.get(p, 0) for p in probes]
    assert len(masks) == len(reference)
    assert all(masks.get(rng.randbytes(16), -1) == -1 for _ in range(100))


def test_bits_outside_the_map_are_refused():
    masks = FingerprintMasks(3)
    with pytest.raises(ValueError, match="outside 0..2"):
        masks.set_bit([bytes(16)], 3)
    with pytest.raises(ValueError):
        FingerprintMasks(0)
