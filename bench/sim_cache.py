"""A simulated replica's prefix cache and the KV events it publishes.

Apart from the event loop because both stand in for something outside it: the
cache for vLLM's prefix cache (checked on its own against the reference model,
`bench.oracle.LruBlockCache`), the events for the structs vLLM publishes, which
are the contract with `router.index.PrefixIndex.apply`.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from dataclasses import dataclass
from typing import Sequence

from router.hashing import BlockHash


# --- block cache ----------------------------------------------------------------------------------


class BlockCache:
    """One replica's prefix cache: full blocks, LRU, a request's blocks freed tail first.

    Same hits and evictions as `bench.oracle.LruBlockCache` (the reference
    model), at O(log n) per lookup and O(new + evicted) per use instead of
    O(prompt blocks): blocks form a tree (each block's parent is the block
    before it), only leaves are evicted, and using a chain stamps only its
    deepest block. A block's true last use is the latest stamp in its subtree,
    which is what it carries when it becomes a leaf (an evicted child hands its
    stamp to its parent), so leaves leave in exact LRU order.

    Invariants: every cached block's parent is cached (prefix-closed), so
    "is block i cached" is monotone along a chain; `len(self) <= capacity_blocks`
    after every `use`.
    """

    __slots__ = ("capacity_blocks", "_nodes", "_heap", "_clock")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        # block -> [parent block or None, number of cached children, stamp]
        self._nodes: dict[BlockHash, list] = {}
        self._heap: list[tuple[int, BlockHash]] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading `hashes` cached (binary search: the cache is prefix-closed)."""
        nodes = self._nodes
        n = len(hashes)
        if n == 0 or hashes[0] not in nodes:
            return 0
        if hashes[n - 1] in nodes:
            return n
        low, high = 1, n - 1  # hashes[low - 1] cached, hashes[high] not
        while low < high:
            mid = (low + high) // 2
            if hashes[mid] in nodes:
                low = mid + 1
            else:
                high = mid
        return low

    def use(self, hashes: Sequence[BlockHash], num_cached: int | None = None) -> tuple[int, list[BlockHash]]:
        """Caches the chain `hashes` as most recently used and evicts down to capacity.

        Args:
            hashes: a request's block hashes, in order.
            num_cached: `longest_prefix(hashes)` if the caller has it.

        Returns:
            (index of the first newly stored block, evicted blocks in eviction order).
        """
        nodes = self._nodes
        known = self.longest_prefix(hashes) if num_cached is None else num_cached
        n = len(hashes)
        if n == 0:
            return 0, []
        self._clock += 1
        stamp = self._clock
        if known == n:
            node = nodes[hashes[-1]]
            node[2] = stamp
            if node[1] == 0:
                heapq.heappush(self._heap, (stamp, hashes[-1]))
        else:
            parent = hashes[known - 1] if known else None
            if parent is not None:
                nodes[parent][1] += 1
            new = hashes[known:n]
            # One [parent, children, stamp] list per block, built without a Python-level loop.
            nodes.update(zip(new, map(list, zip(itertools.chain((parent,), new), itertools.repeat(1),
                                                 itertools.repeat(stamp)))))
            nodes[new[-1]][1] = 0
            heapq.heappush(self._heap, (stamp, new[-1]))
        return known, self._evict()

    def _evict(self) -> list[BlockHash]:
        nodes, heap = self._nodes, self._heap
        capacity = self.capacity_blocks
        evicted: list[BlockHash] = []
        while len(nodes) > capacity:
            stamp, block_hash = heapq.heappop(heap)
            node = nodes.get(block_hash)
            if node is None or node[1] or node[2] != stamp:
                continue  # stale entry: evicted, re-stamped, or no longer a leaf
            while True:
                del nodes[block_hash]
                evicted.append(block_hash)
                parent = node[0]
                if parent is None:
                    break
                parent_node = nodes[parent]
                parent_node[1] -= 1
                if stamp > parent_node[2]:
                    parent_node[2] = stamp
                if parent_node[1]:
                    break
                # The parent is now a leaf. While it is still the least recent leaf,
                # evict it right away instead of a round trip through the heap.
                stamp = parent_node[2]
                if len(nodes) > capacity and (not heap or (stamp, parent) < heap[0]):
                    block_hash, node = parent, parent_node
                    continue
                heapq.heappush(heap, (stamp, parent))
                break
        if len(heap) > 4 * len(nodes) + 1024:
            self._heap = [(node[2], h) for h, node in nodes.items() if node[1] == 0]
            heapq.heapify(self._heap)
        return evicted


# --- synthetic KV events (the fields PrefixIndex.apply reads from vLLM's structs) ------------------


@dataclass(slots=True)
class BlockStored:
    """vLLM `BlockStored`, as a replica publishes it for newly cached prompt blocks."""

    block_hashes: list
    parent_block_hash: bytes | None
    token_ids: array
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """vLLM `BlockRemoved`, published when the cache evicts blocks."""

    block_hashes: list
    medium: str | None = "GPU"
    group_idx: int | None = None
