"""`FingerprintSet`: a grow-only set of block hashes at about 8 bytes a block.

Why: the infinite-cache bound must remember every block a run ever made. At
10,000 coding sessions that is over a hundred million blocks, and a Python set
of 16-byte `bytes` costs about 90 bytes a block (object, slot, spare slots):
over 10 GB for a bound. Here each block is kept as the first 8 bytes of its
hash (a 64-bit fingerprint) in one sorted `numpy.uint64` array, plus a
Python set of the latest fingerprints, merged into the array whenever
it reaches a sixteenth of it (`insert_sorted`: one pass and one allocation),
so merges cost O(n) amortized per block.

Exactness: a block hash is uniform over 128 bits (MurmurHash3), so two
distinct blocks share a fingerprint with probability 2**-64; with n blocks
held, a lookup of an absent block wrongly answers yes with probability about
n / 2**64 (5e-12 at 10**8 blocks). Nothing is ever removed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from router.hashing import DIGEST_SIZE_BYTES, BlockHash

MIN_BUFFER_BLOCKS = 1 << 18


def fingerprint(block_hash: BlockHash) -> int:
    """A hash's 64-bit fingerprint: its first 8 bytes, little-endian."""
    return int.from_bytes(block_hash[:8], "little")


def fingerprints(block_hashes: Sequence[BlockHash]) -> np.ndarray:
    """The 64-bit fingerprint (first 8 bytes, little-endian) of each hash, as a uint64 array."""
    joined = b"".join(block_hashes)
    if len(joined) != len(block_hashes) * DIGEST_SIZE_BYTES:
        raise ValueError(f"block hashes must be {DIGEST_SIZE_BYTES} bytes each")
    return np.frombuffer(joined, dtype="<u8")[:: DIGEST_SIZE_BYTES // 8]


class FingerprintSet:
    """Grow-only set of `BlockHash`es, held as 64-bit fingerprints (module docstring)."""

    def __init__(self, min_buffer_blocks: int = MIN_BUFFER_BLOCKS) -> None:
        if min_buffer_blocks < 1:
            raise ValueError(f"min_buffer_blocks must be >= 1, got {min_buffer_blocks}")
        self._min_buffer_blocks = min_buffer_blocks
        self._sorted = np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        if self._recent:
            self._merge()  # counts each block once, however often it was added
        return len(self._sorted)

    def __contains__(self, block_hash: BlockHash) -> bool:
        value = fingerprint(block_hash)
        return value in self._recent or position_of(self._sorted, value) is not None

    def update(self, block_hashes: Sequence[BlockHash]) -> None:
        """Adds `block_hashes` (each `DIGEST_SIZE_BYTES` long); those already held are no-ops."""
        if not block_hashes:
            return
        # Fingerprints already in the sorted array are dropped at the next merge, not here:
        # a lookup per block into a large array would cost more than the whole update.
        self._recent.update(fingerprints(block_hashes).tolist())
        if len(self._recent) >= max(self._min_buffer_blocks, len(self._sorted) >> 4):
            self._merge()

    def _merge(self) -> None:
        recent = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
        recent.sort()
        (self._sorted,) = insert_sorted(self._sorted, recent)
        self._recent = set()


def position_of(held: np.ndarray, value: int) -> int | None:
    """Where the sorted `held` holds `value`, or None."""
    position = int(held.searchsorted(np.uint64(value)))
    return position if position < len(held) and int(held[position]) == value else None


def locate(held: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(where each of `values` is or would go in the sorted `held`, whether it is there)."""
    positions = held.searchsorted(values)
    found = positions < len(held)
    found[found] = held[positions[found]] == values[found]
    return positions, found


def insert_sorted(
    held: np.ndarray, new: np.ndarray, *rows: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, ...]:
    """(`held` with the sorted `new` keys merged in, skipping those already held, in one allocation, *rows).

    Each of `rows` is (an array parallel to `held`, rows parallel to `new`),
    merged the same way, in the result after the keys.
    Memory: the result plus a byte per element, not the two or three copies
    a concatenate-and-sort needs (the arrays run to gigabytes).
    """
    positions, found = locate(held, new)
    is_new = ~found
    if not is_new.all():
        new, positions = new[is_new], positions[is_new]
        rows = tuple((array, added[is_new]) for array, added in rows)
    return (np.insert(held, positions, new), *(np.insert(array, positions, added, axis=0) for array, added in rows))


__all__ = ["FingerprintSet", "MIN_BUFFER_BLOCKS", "fingerprint", "fingerprints", "insert_sorted", "locate", "position_of"]
