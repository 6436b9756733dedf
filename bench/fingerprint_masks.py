"""`FingerprintMasks`: a grow-only map from block hash to a bitmask of replicas, at 8 bytes a block per 64 replicas plus 8.

Why: the modelled `PrefixCacheAffinityRouter` never forgets a prompt it was
sent (Ray's defaults), so at 10,000 coding sessions it remembers over a
hundred million blocks. A dict of 16-byte `bytes` to Python ints costs over a
hundred bytes a block and ran out of memory. Here, as in
`bench.fingerprint_set`, a block is its hash's first 8 bytes (a 64-bit
fingerprint): a sorted `numpy.uint64` array of fingerprints with parallel
arrays of mask words (one uint64 array per 64 replicas), plus a dict of the
fingerprints added since the last merge, merged into the arrays whenever it
reaches a sixteenth of them. Setting a bit on blocks already merged is a
vectorised search and an in-place OR.

Exactness: as `bench.fingerprint_set` (a false match has probability about
n / 2**64 per lookup at n blocks).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bench.fingerprint_set import MIN_BUFFER_BLOCKS, fingerprint, fingerprints, insert_sorted, locate, position_of
from router.hashing import BlockHash

_WORD_BITS = 64
_WORD_MASK = (1 << _WORD_BITS) - 1


class FingerprintMasks:
    """Grow-only map `BlockHash` -> bitmask of up to `num_bits` bits (module docstring)."""

    def __init__(self, num_bits: int, min_buffer_blocks: int = MIN_BUFFER_BLOCKS) -> None:
        if num_bits < 1 or min_buffer_blocks < 1:
            raise ValueError(f"num_bits={num_bits}, min_buffer_blocks={min_buffer_blocks}: both must be >= 1")
        self._num_words = -(-num_bits // _WORD_BITS)
        self._num_bits = num_bits
        self._min_buffer_blocks = min_buffer_blocks
        self._keys = np.empty(0, dtype=np.uint64)
        self._words = [np.empty(0, dtype=np.uint64) for _ in range(self._num_words)]
        self._recent: dict[int, int] = {}  # fingerprints not in `_keys` yet -> mask

    def __len__(self) -> int:
        return len(self._keys) + len(self._recent)

    def get(self, block_hash: BlockHash, default: int = 0) -> int:
        """The block's mask; `default` for a block never added."""
        value = fingerprint(block_hash)
        mask = self._recent.get(value)
        if mask is not None:
            return mask
        position = position_of(self._keys, value)
        if position is None:
            return default
        mask = 0
        for word_index, words in enumerate(self._words):
            mask |= int(words[position]) << (_WORD_BITS * word_index)
        return mask

    def set_bit(self, block_hashes: Sequence[BlockHash], bit: int) -> None:
        """Sets bit `bit` in the mask of every block in `block_hashes`, adding the blocks not held."""
        if not 0 <= bit < self._num_bits:
            raise ValueError(f"bit {bit} is outside 0..{self._num_bits - 1}")
        if not block_hashes:
            return
        added = fingerprints(block_hashes)
        positions, found = locate(self._keys, added)
        word_index, word_bit = divmod(bit, _WORD_BITS)
        self._words[word_index][positions[found]] |= np.uint64(1 << word_bit)
        recent, value = self._recent, 1 << bit
        for new in added[~found].tolist():
            recent[new] = recent.get(new, 0) | value
        if len(recent) >= max(self._min_buffer_blocks, len(self._keys) >> 4):
            self._merge()

    def _merge(self) -> None:
        recent = self._recent
        count = len(recent)
        new_keys = np.fromiter(recent.keys(), dtype=np.uint64, count=count)
        order = new_keys.argsort()
        new_words = []
        for word_index in range(self._num_words):
            shift = _WORD_BITS * word_index
            words = np.fromiter(((mask >> shift) & _WORD_MASK for mask in recent.values()), dtype=np.uint64, count=count)
            new_words.append(words[order])
        self._keys, *self._words = insert_sorted(self._keys, new_keys[order], *zip(self._words, new_words))
        self._recent = {}


__all__ = ["FingerprintMasks"]
