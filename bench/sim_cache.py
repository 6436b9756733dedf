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


class _Run:
    """Consecutive blocks of one chain, stored together; blocks leave from its end only.

    `hashes[i]` sits at chain position `depth + i`. Its in-run child is
    `hashes[i + 1]`; other cached children start runs of their own, counted in
    `branches[i]`. So only the last block can be a leaf, and only when no run
    branches off it.

    Recency, as `bench.oracle.LruBlockCache` orders blocks: a block was last
    used at the latest stamp in its subtree. `stamp` is that for the last
    block. `marks` hold the stamps of chains that ended below the last block,
    as (index, stamp), index ascending and stamp descending: as the end comes
    down to index i, the last block's stamp becomes the largest of `stamp` and
    the marks at i or beyond.
    """

    __slots__ = ("hashes", "depth", "parent", "parent_index", "branches", "marks", "stamp")

    def __init__(self, hashes: list[BlockHash], depth: int, parent: _Run | None, parent_index: int,
                 stamp: int) -> None:
        self.hashes = hashes
        self.depth = depth
        self.parent = parent
        self.parent_index = parent_index
        self.branches: dict[int, int] = {}
        self.marks: list[tuple[int, int]] = []
        self.stamp = stamp

    def mark(self, index: int, stamp: int) -> None:
        """Records that the block at `index` (not the last) was used at `stamp`."""
        marks = self.marks
        k = 0
        while k < len(marks) and marks[k][0] < index:
            k += 1
        if k < len(marks) and marks[k][1] >= stamp:
            return  # a block at or beyond index was used later: this stamp can never decide
        j = k
        while j and marks[j - 1][1] <= stamp:
            j -= 1  # used earlier, nearer the start: this stamp decides before they could
        marks[j:k + 1 if k < len(marks) and marks[k][0] == index else k] = [(index, stamp)]

    def fold_marks(self) -> None:
        """Takes the marks at or beyond the last block into `stamp`."""
        last, marks = len(self.hashes) - 1, self.marks
        while marks and marks[-1][0] >= last:
            stamp = marks.pop()[1]
            if stamp > self.stamp:
                self.stamp = stamp

    @property
    def is_leaf(self) -> bool:
        return bool(self.hashes) and len(self.hashes) - 1 not in self.branches


class BlockCache:
    """One replica's prefix cache: full blocks, LRU, a request's blocks freed tail first.

    Same hits and evictions as `bench.oracle.LruBlockCache` (the reference
    model), at O(log n) per lookup and, per use, a few operations per run of
    blocks plus one dict operation per new or evicted block, instead of work
    per prompt block. Blocks form a tree (each block's parent is the block
    before it) kept as runs (`_Run`): the new blocks of one `use` extend the
    run whose last block they follow, or start a run branching off it. Only
    leaves are evicted, a run's blocks from its end, and eviction continues
    down a run while its end stays the least recently used leaf, so a long
    stale history goes in a few slices.

    Invariants: every cached block's parent is cached (prefix-closed), so
    "is block i cached" is monotone along a chain; `len(self) <= capacity_blocks`
    after every `use`; every leaf run has a heap entry with its current stamp.
    """

    __slots__ = ("capacity_blocks", "_runs", "_heap", "_clock", "_seq", "_num_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._runs: dict[BlockHash, _Run] = {}  # block -> the run holding it
        self._heap: list[tuple[int, int, _Run]] = []  # (stamp, seq, run); stale entries are skipped
        self._clock = 0
        self._seq = itertools.count()
        self._num_blocks = 0

    def __len__(self) -> int:
        return self._num_blocks

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading `hashes` cached (binary search: the cache is prefix-closed)."""
        runs = self._runs
        n = len(hashes)
        if n == 0 or hashes[0] not in runs:
            return 0
        if hashes[n - 1] in runs:
            return n
        low, high = 1, n - 1  # hashes[low - 1] cached, hashes[high] not
        while low < high:
            mid = (low + high) // 2
            if hashes[mid] in runs:
                low = mid + 1
            else:
                high = mid
        return low

    def lru_stamp(self) -> int | None:
        """Stamp of the use that last touched the least recently used block (the next to go); None if empty.

        Stamps are `use`'s: compare them across caches that share a clock.
        """
        heap = self._heap
        while heap:
            stamp, _, run = heap[0]
            if stamp == run.stamp and run.is_leaf:
                return stamp
            heapq.heappop(heap)  # stale entry: `_evict` would skip it too
        return None

    def use(self, hashes: Sequence[BlockHash], num_cached: int | None = None,
            stamp: int | None = None) -> tuple[int, list[BlockHash]]:
        """Caches the chain `hashes` as most recently used and evicts down to capacity.

        Args:
            hashes: a request's block hashes, in order.
            num_cached: `longest_prefix(hashes)` if the caller has it.
            stamp: when this use happens, on a clock shared with other caches
                (`lru_stamp`); above every earlier stamp of this cache. Default:
                this cache's next tick.

        Returns:
            (index of the first newly stored block, evicted blocks in eviction order).
        """
        runs = self._runs
        known = self.longest_prefix(hashes) if num_cached is None else num_cached
        n = len(hashes)
        if n == 0:
            return 0, []
        if stamp is None:
            stamp = self._clock + 1
        elif stamp <= self._clock:
            raise ValueError(f"stamp {stamp} is not after this cache's last use ({self._clock})")
        self._clock = stamp
        run = runs[hashes[known - 1]] if known else None
        index = known - 1 - run.depth if run is not None else -1
        is_last = run is not None and index == len(run.hashes) - 1
        if known == n:
            if is_last:
                run.stamp = stamp
                run.marks.clear()  # all older, and below the last block
                if run.is_leaf:
                    self._push(run)
            else:
                run.mark(index, stamp)
        else:
            new = list(hashes[known:n])
            if is_last:
                run.hashes.extend(new)  # the old last block's stamp is older than its new descendants'
                run.stamp = stamp
                holder = run
            else:
                holder = _Run(new, known, run, index, stamp)
                if run is not None:
                    run.branches[index] = run.branches.get(index, 0) + 1
            runs.update(zip(new, itertools.repeat(holder)))
            self._num_blocks += len(new)
            self._push(holder)
        return known, self._evict()

    def _push(self, run: _Run) -> None:
        heapq.heappush(self._heap, (run.stamp, next(self._seq), run))

    def _evict(self) -> list[BlockHash]:
        runs, heap = self._runs, self._heap
        excess = self._num_blocks - self.capacity_blocks
        evicted: list[BlockHash] = []
        while excess > 0:
            stamp, _, run = heapq.heappop(heap)
            if stamp != run.stamp or not run.is_leaf:
                continue  # stale entry: re-stamped, emptied, or no longer a leaf
            while True:
                hashes = run.hashes
                # Evict down to the next block where the order may change: a mark or a branch.
                floor = run.marks[-1][0] if run.marks else -1
                if run.branches:
                    floor = max(floor, max(run.branches))
                start = max(len(hashes) - excess, floor + 1)
                gone = hashes[start:]
                del hashes[start:]
                gone.reverse()
                for block_hash in gone:
                    del runs[block_hash]
                evicted += gone
                excess -= len(gone)
                self._num_blocks -= len(gone)
                if hashes:
                    run.fold_marks()
                    leaf = run if run.is_leaf else None
                else:
                    leaf = self._detach(run)
                if leaf is None:
                    break
                if excess > 0 and (not heap or leaf.stamp <= heap[0][0]):
                    run = leaf  # still the least recently used leaf
                    continue
                self._push(leaf)
                break
        if len(heap) > 4 * self._num_blocks + 1024:
            leaves = {id(r): r for r in runs.values() if r.is_leaf}.values()
            self._heap = [(r.stamp, next(self._seq), r) for r in leaves]
            heapq.heapify(self._heap)
        return evicted

    @staticmethod
    def _detach(run: _Run) -> _Run | None:
        """Unlinks an emptied run from its parent block, handing its stamp over if that block ends its run.

        Returns the parent run if that made it a leaf.
        """
        parent = run.parent
        if parent is None:
            return None
        index = run.parent_index
        left = parent.branches[index] - 1
        if left:
            parent.branches[index] = left
        else:
            del parent.branches[index]
        if index != len(parent.hashes) - 1:
            # The parent's later blocks lead to leaves used no earlier than this run, the least
            # recently used leaf: their stamps reach the parent block before this one could matter.
            return None
        if run.stamp > parent.stamp:
            parent.stamp = run.stamp
        return parent if not left else None


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
