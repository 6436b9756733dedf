"""Hit-rate bounds for a recorded trace: what any router could have got from the same requests.

Both bounds replay the trace's prompts in send order (ties keep trace order),
hashing each prompt's full KV blocks with `router.hashing` (the blocks vLLM
caches), and count a request's hit as its longest cached leading run of
blocks, at most `(prompt_tokens - 1) // block_size` blocks because vLLM always
recomputes the last prompt token. Generated tokens are not counted as
cacheable: on the live cluster the next prompt carries the workload's tool call,
not the model's text (the simulator, which does cache generated tokens, feeds
them in through `StreamingBounds.cache`). Timing is ignored: a request may hit
blocks that an earlier, still-running request is computing, so both are
bounds, not forecasts. One order they do not cover: requests sent
milliseconds apart can reach the engines in the other order, and a later
one served first (a prompt wholly inside an earlier one's) gives the
earlier one hits the replay cannot; the report marks a hit rate above a
bound so.

(a) `infinite`: one cache shared by all replicas that never evicts: the ceiling.
(b) `placed`: one LRU cache per replica of `capacity_blocks` blocks, and a
    greedy placement: each request goes to the replica where it costs least,
    counting the blocks to compute plus the cached blocks they would evict;
    ties to the longest match, then the fewest cached blocks, then the
    replica whose least recently used block is oldest, then the lowest index.
    No load limit. Greedy is not optimal in general (placement under capacity
    limits is a hard packing problem), so (b) is "the best placement we
    compute", and a router can beat it when capacity binds. Without the
    eviction term, every request sharing a popular prefix would pile onto the
    replica that cached it first and evict each other there; without the age
    tie-break, once every cache is full (evictions then cost the same
    everywhere), every new session would go to the lowest index.
    LRU order follows vLLM: a request's blocks are freed tail first, so a prefix
    always outlives its extensions (`LruBlockCache`, the reference model;
    `StreamingBounds` runs `bench.sim_cache.BlockCache`, which evicts the same
    blocks in the same order).
    Where the trace says where each request was served, that placement is
    replayed through the same caches as well, and (b) is the better of the two:
    the greedy charges evicting a stale block (a finished session's) as much
    as computing one, so when capacity binds it moves a session off a full
    replica holding half its history to an emptier one and recomputes it all,
    and fell below what a router reached (coding, 8 replicas of 3,000 blocks:
    greedy 0.79, warmpath 0.82). A placement the run made is one computed, so
    the bound is at least its replay: `greedy_hit_rate` and
    `own_placement_hit_rate` say which it was.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from bench.fingerprint_set import FingerprintSet
from bench.sim_cache import BlockCache
from bench.trace import RequestRecord, live_replica_slots
from router.hashing import BlockHash, hash_request_blocks, reusable_blocks, root_hash
from router.index import add_owner_bit, drop_owner_bit, leading_runs


class LruBlockCache:
    """Blocks of one replica, least recently used first; a reference model, one dict operation per block.

    Invariant: the cache is prefix-closed for every chain inserted through
    `use`, because `use` touches a request's blocks from last to first (vLLM
    frees them tail first), so a parent is always more recent than its children
    and is evicted after them. Each block keeps the stamp of the use that last
    touched it.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockHash, int] = OrderedDict()
        self._clock = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading `hashes` held."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            count += 1
        return count

    def lru_stamp(self) -> int | None:
        """Stamp of the least recently used block; None if empty."""
        return next(iter(self._blocks.values()), None)

    def use(self, hashes: Sequence[BlockHash], stamp: int | None = None) -> list[BlockHash]:
        """Caches and touches all `hashes` at `stamp` (default: the next tick); returns the evicted blocks, oldest first."""
        self._clock = self._clock + 1 if stamp is None else stamp
        blocks = self._blocks
        for block_hash in reversed(hashes):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            blocks[block_hash] = self._clock
        evicted = []
        while len(blocks) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted


@dataclass(frozen=True)
class OracleBounds:
    """Hit rates of the two bounds for one trace, and how the greedy placement spread requests."""

    num_requests: int
    prompt_tokens: int
    infinite_hit_rate: float | None
    placed_hit_rate: float | None
    num_replicas: int
    capacity_blocks: int | None  # None: unknown (a GPU engine sizes its cache at start-up), so no placed bound
    placed_requests_by_replica: list[int]  # the greedy placement's
    greedy_hit_rate: float | None = None
    # The run's own placement replayed through the same caches, in send order (None: the trace did not say).
    own_placement_hit_rate: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def request_block_hashes(records: Sequence[RequestRecord], block_size_tokens: int, model_id: str) -> list[list[BlockHash]]:
    """Full-block hashes of each record's prompt (records must carry `token_ids`)."""
    root = root_hash(model_id, None)
    out = []
    for record in records:
        if record.token_ids is None:
            raise ValueError(f"record {record.session_id}/{record.step_index} has no token ids")
        out.append(hash_request_blocks(record.token_ids, block_size_tokens, root))
    return out


class StreamingBounds:
    """Both bounds, fed one request at a time in send order, so a long simulation need not keep its trace.

    Same answers as replaying `LruBlockCache`s and a set, at a cost per
    request that grows with neither the prompt's length nor the number of
    replicas (a long coding session re-sends thousands of blocks per turn):
    - every cache involved is prefix-closed (a block is cached only with its
      whole prefix: the infinite cache never drops a block, and each replica's
      `BlockCache` evicts leaves only), so "is block i cached" is monotone along
      a chain and its longest cached run is a binary search;
    - `_owners` maps a block to the bitmask of replicas caching it, kept in step
      with the replicas' caches from their new and evicted blocks only. Along a
      chain the masks only lose bits, so every replica's longest prefix comes
      from bisecting between positions whose masks differ
      (`router.index.leading_runs`, the router's own lookup): a few lookups
      per replica that holds part of the chain, instead of one per block.
    The infinite cache keeps every block the run made, so it is a
    `FingerprintSet` (about 8 bytes a block instead of about 90: a
    10,000-session coding run makes over a hundred million).
    """

    def __init__(self, block_size_tokens: int, num_replicas: int, capacity_blocks: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size_tokens = block_size_tokens
        self.num_replicas = num_replicas
        self.capacity_blocks = capacity_blocks
        self._seen = FingerprintSet()  # every block the infinite cache holds: ~8 bytes each
        self._caches = [BlockCache(capacity_blocks) for _ in range(num_replicas)]
        self._owners: dict[BlockHash, int] = {}
        self._bits = [1 << replica for replica in range(num_replicas)]  # one object per replica, shared by masks
        self._clock = 0  # one clock for every replica's cache, so their LRU stamps compare
        # Per replica (cached blocks, LRU stamp, index): the placement's tie-break, kept current by `_use`.
        self._fill_then_age = [(0, 0, replica) for replica in range(num_replicas)]
        self.infinite_hits: list[int] = []
        self.placed_hits: list[int] = []
        self.placement: list[int] = []
        self.prompt_tokens = 0
        # The run's own placement (`observe(..., served_on=)`): one cache per replica it named, on their own clock.
        self._own_caches: dict[int, BlockCache] = {}
        self._own_clock = 0
        self.own_hits: list[int] = []

    def observe(self, chain: Sequence[BlockHash], num_tokens: int, served_on: int | None = None) -> int:
        """Counts one request's hits under both bounds, then caches its blocks in both.

        Args:
            served_on: the replica (index) the run served it on, replayed beside the greedy placement;
                None where the trace does not say (then no request of the run is counted there).

        Returns:
            The replica the greedy placement chose (for `cache`).
        """
        usable = reusable_blocks(num_tokens, self.block_size_tokens)
        self.prompt_tokens += num_tokens
        self.infinite_hits.append(_use_infinite(self._seen, chain, usable) * self.block_size_tokens)

        best, count = self._best_replica(chain)
        self.placed_hits.append(min(count, usable) * self.block_size_tokens)
        self.placement.append(best)
        self._use(best, chain, count)
        if served_on is not None:
            self.own_hits.append(min(self._use_own(served_on, chain), usable) * self.block_size_tokens)
        return best

    def fill(self, chain: Sequence[BlockHash], served_on: int | None = None) -> None:
        """Caches one request's blocks under both bounds without counting it: a request that failed after
        its prefill (its stream cut off), whose blocks later requests may hit."""
        self._seen.update(chain[_leading_run(self._seen, chain):])
        best, count = self._best_replica(chain)
        self._use(best, chain, count)
        if served_on is not None:
            self._use_own(served_on, chain)

    def cache(self, chain: Sequence[BlockHash], replica: int, served_on: int | None = None) -> None:
        """Caches blocks computed without a prompt of their own (a response the next prompt carries): on the
        greedy placement's `replica`, and on `served_on` in the run's own."""
        self._seen.update(chain[_leading_run(self._seen, chain):])
        self._use(replica, chain)
        if served_on is not None:
            self._use_own(served_on, chain)

    def _use_own(self, replica: int, chain: Sequence[BlockHash]) -> int:
        """Caches `chain` on `replica` of the run's own placement; returns the leading blocks it held."""
        cache = self._own_caches.get(replica)
        if cache is None:
            cache = self._own_caches[replica] = BlockCache(self.capacity_blocks)
        held = cache.longest_prefix(chain)
        self._own_clock += 1
        cache.use(chain, held, self._own_clock)
        return held

    def _use(self, replica: int, chain: Sequence[BlockHash], num_cached: int | None = None) -> None:
        bit = self._bits[replica]
        self._clock += 1
        cache = self._caches[replica]
        first_new, evicted = cache.use(chain, num_cached, self._clock)
        add_owner_bit(self._owners, chain[first_new:], bit)
        self._fill_then_age[replica] = (len(cache), cache.lru_stamp() or 0, replica)
        drop_owner_bit(self._owners, evicted, bit)

    def _matched_blocks(self, chain: Sequence[BlockHash]) -> dict[int, int]:
        """Replica -> leading blocks of `chain` it caches, for the replicas caching at least one."""
        matched: dict[int, int] = {}
        for mask, num_blocks in leading_runs(self._owners.get, chain):
            while mask:
                low = mask & -mask
                matched[low.bit_length() - 1] = num_blocks
                mask ^= low
        return matched

    def _best_replica(self, chain: Sequence[BlockHash]) -> tuple[int, int]:
        """The placement of one request, and how many of its leading blocks that replica holds.

        Cheapest replica first, where the cost is the blocks it must compute
        plus the cached blocks it must evict to keep them; ties go to the
        longest match, then the fewest cached blocks, then the replica whose
        least recently used block is the oldest, then the lowest index.
        Counting evictions keeps the greedy choice from piling every request
        that shares a popular prefix onto the one replica that cached it first;
        the age tie-break does the same once every cache is full, when the
        evictions cost the same everywhere: the blocks evicted are then the
        oldest of all replicas', as in one LRU cache of their joint capacity.
        Of the replicas caching none of the chain, only the emptiest (then
        oldest) can win.
        """
        caches = self._caches
        capacity = self.capacity_blocks
        num_blocks = len(chain)
        matched = self._matched_blocks(chain)
        fill_then_age = self._fill_then_age
        emptiest = min(fill_then_age)[2]
        matched.setdefault(emptiest, 0)

        def cost(replica: int) -> tuple[int, ...]:
            new = num_blocks - matched[replica]
            overflow = max(0, len(caches[replica]) + new - capacity)
            return new + overflow, -matched[replica], *fill_then_age[replica]

        best = min(matched, key=cost)
        return best, matched[best]

    def result(self, num_requests: int | None = None) -> OracleBounds:
        prompt = self.prompt_tokens
        by_replica = Counter(self.placement)
        greedy = sum(self.placed_hits) / prompt if prompt else None
        # Only a placement the trace gave for every request it counts is a placement of the whole trace.
        is_own_whole = bool(self.own_hits) and len(self.own_hits) == len(self.placed_hits)
        own = sum(self.own_hits) / prompt if prompt and is_own_whole else None
        return OracleBounds(
            num_requests=len(self.placement) if num_requests is None else num_requests,
            prompt_tokens=prompt,
            infinite_hit_rate=sum(self.infinite_hits) / prompt if prompt else None,
            placed_hit_rate=greedy if own is None else max(greedy, own),
            num_replicas=self.num_replicas,
            capacity_blocks=self.capacity_blocks,
            placed_requests_by_replica=[by_replica[i] for i in range(self.num_replicas)],
            greedy_hit_rate=greedy,
            own_placement_hit_rate=own,
        )


def _use_infinite(seen: FingerprintSet, chain: Sequence[BlockHash], usable_blocks: int) -> int:
    """One request against the infinite shared cache: the blocks it hits (at most `usable_blocks`), then caches the rest."""
    count = _leading_run(seen, chain)
    seen.update(chain[count:])
    return min(count, usable_blocks)


def _leading_run(blocks: FingerprintSet, chain: Sequence[BlockHash]) -> int:
    """Leading `chain` blocks in `blocks`, which must be prefix-closed (binary search)."""
    low, high = 0, len(chain)  # chain[:low] all in blocks; chain[high:] none
    while low < high:
        middle = (low + high) // 2
        if chain[middle] in blocks:
            low = middle + 1
        else:
            high = middle
    return low


def oracle_bounds(
    records: Sequence[RequestRecord],
    block_size_tokens: int,
    model_id: str,
    num_replicas: int,
    capacity_blocks: int | None,
) -> OracleBounds:
    """Both bounds for the successful requests of one trace (see module docstring).

    A failed request that carries its token ids caches its blocks without being counted:
    it may have failed after its prefill, and the engine then holds its blocks for later
    requests to hit (the measured hit rate counts those hits). Where it failed before
    its prefill, that only raises the bounds.

    Args:
        records: the trace; each successful record must carry `token_ids`.
        block_size_tokens: the engines' KV block size.
        model_id: roots the block hash chains.
        num_replicas: replicas of the run.
        capacity_blocks: KV blocks per replica; None (unknown) gives the infinite bound alone.

    Returns:
        The bounds' hit rates (cached / prompt tokens).
    """
    replayed = sorted((r for r in records if r.error is None or r.token_ids is not None), key=lambda r: r.send_s)
    chains = request_block_hashes(replayed, block_size_tokens, model_id)
    ok = [record for record in replayed if record.error is None]
    if capacity_blocks is None:
        seen = FingerprintSet()
        hits = 0
        for record, chain in zip(replayed, chains):
            if record.error is None:
                hits += _use_infinite(seen, chain, reusable_blocks(len(record.token_ids), block_size_tokens))
            else:
                seen.update(chain)
        prompt = sum(len(record.token_ids) for record in ok)
        return OracleBounds(len(ok), prompt, hits * block_size_tokens / prompt if prompt else None, None,
                            num_replicas, None, [])
    bounds = StreamingBounds(block_size_tokens, num_replicas, capacity_blocks)
    # The run's own placement, where every counted request names its replica (a replica replaced during
    # the run served under a new id: one more cache).
    slots = live_replica_slots(replayed) if all(record.replica_id for record in ok) else {}
    for record, chain in zip(replayed, chains):
        served_on = slots.get(record.replica_id)
        if record.error is None:
            bounds.observe(chain, len(record.token_ids), served_on)
        else:
            bounds.fill(chain, served_on)
    return bounds.result()
