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
bounds, not forecasts.

(a) `infinite`: one cache shared by all replicas that never evicts: the ceiling.
(b) `placed`: one LRU cache per replica of `capacity_blocks` blocks, and a
    greedy placement: each request goes to the replica where it costs least,
    counting the blocks to compute plus the cached blocks they would evict;
    ties to the longest match, then the fewest cached blocks, then the lowest
    index. No load limit. Greedy is not optimal in general (placement under
    capacity limits is a hard packing problem), so (b) is "the best placement
    we compute", and a router can beat it when capacity binds. Without the
    eviction term, every request sharing a popular prefix would pile onto the
    replica that cached it first and evict each other there.
    LRU order follows vLLM: a request's blocks are freed tail first, so a prefix
    always outlives its extensions (`LruBlockCache`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

from bench.trace import RequestRecord
from router.hashing import BlockHash, hash_request_blocks, root_hash


class LruBlockCache:
    """Blocks of one replica, least recently used first; a reference model, one dict operation per block.

    Invariant: the cache is prefix-closed for every chain inserted through
    `use`, because `use` touches a request's blocks from last to first (vLLM
    frees them tail first), so a parent is always more recent than its children
    and is evicted after them.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

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

    def use(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Caches and touches all `hashes`; returns the evicted blocks, oldest first."""
        blocks = self._blocks
        for block_hash in reversed(hashes):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
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
    capacity_blocks: int
    placed_requests_by_replica: list[int]

    def to_json(self) -> dict:
        return asdict(self)


def _usable_blocks(num_tokens: int, block_size_tokens: int) -> int:
    return max(num_tokens - 1, 0) // block_size_tokens


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

    The greedy placement finds every replica's longest prefix in one walk of
    the chain: `_owners` maps a block to the bitmask of replicas caching it
    (kept in step with each replica's `LruBlockCache`), so the cost per request
    does not grow with the number of replicas.
    """

    def __init__(self, block_size_tokens: int, num_replicas: int, capacity_blocks: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size_tokens = block_size_tokens
        self.num_replicas = num_replicas
        self.capacity_blocks = capacity_blocks
        self._seen: set[BlockHash] = set()
        self._caches = [LruBlockCache(capacity_blocks) for _ in range(num_replicas)]
        self._owners: dict[BlockHash, int] = {}
        self.infinite_hits: list[int] = []
        self.placed_hits: list[int] = []
        self.placement: list[int] = []
        self.prompt_tokens = 0

    def observe(self, chain: Sequence[BlockHash], num_tokens: int) -> int:
        """Counts one request's hits under both bounds, then caches its blocks in both.

        Returns:
            The replica the greedy placement chose (for `cache`).
        """
        usable = _usable_blocks(num_tokens, self.block_size_tokens)
        self.prompt_tokens += num_tokens
        seen = self._seen
        count = 0
        for block_hash in chain:
            if block_hash not in seen:
                break
            count += 1
        self.infinite_hits.append(min(count, usable) * self.block_size_tokens)
        seen.update(chain)

        best, count = self._best_replica(chain)
        self.placed_hits.append(min(count, usable) * self.block_size_tokens)
        self.placement.append(best)
        self._use(best, chain)
        return best

    def cache(self, chain: Sequence[BlockHash], replica: int) -> None:
        """Caches blocks computed without a prompt of their own (a response the next prompt carries)."""
        self._seen.update(chain)
        self._use(replica, chain)

    def _use(self, replica: int, chain: Sequence[BlockHash]) -> None:
        bit, owners = 1 << replica, self._owners
        for block_hash in chain:
            owners[block_hash] = owners.get(block_hash, 0) | bit
        for block_hash in self._caches[replica].use(chain):
            mask = owners[block_hash] & ~bit
            if mask:
                owners[block_hash] = mask
            else:
                del owners[block_hash]

    def _best_replica(self, chain: Sequence[BlockHash]) -> tuple[int, int]:
        """The placement of one request, and how many of its leading blocks that replica holds.

        Cheapest replica first, where the cost is the blocks it must compute
        plus the cached blocks it must evict to keep them; ties go to the
        longest match, then the fewest cached blocks, then the lowest index.
        Counting evictions keeps the greedy choice from piling every request
        that shares a popular prefix onto the one replica that cached it first.
        """
        owners_get = self._owners.get
        caches = self._caches
        capacity = self.capacity_blocks
        num_blocks = len(chain)
        matched: dict[int, int] = {}
        alive = (1 << self.num_replicas) - 1
        count = 0
        for block_hash in chain:
            mask = alive & owners_get(block_hash, 0)
            if mask != alive:
                dropped = alive & ~mask
                while dropped and count:
                    low = dropped & -dropped
                    matched[low.bit_length() - 1] = count
                    dropped ^= low
                alive = mask
                if not alive:
                    break
            count += 1
        while alive and count:
            low = alive & -alive
            matched[low.bit_length() - 1] = count
            alive ^= low
        emptiest = min(range(self.num_replicas), key=lambda i: (len(caches[i]), i))
        matched.setdefault(emptiest, 0)

        def cost(replica: int) -> tuple[int, int, int, int]:
            new = num_blocks - matched[replica]
            overflow = max(0, len(caches[replica]) + new - capacity)
            return new + overflow, -matched[replica], len(caches[replica]), replica

        best = min(matched, key=cost)
        return best, matched[best]

    def result(self, num_requests: int | None = None) -> OracleBounds:
        prompt = self.prompt_tokens
        return OracleBounds(
            num_requests=len(self.placement) if num_requests is None else num_requests,
            prompt_tokens=prompt,
            infinite_hit_rate=sum(self.infinite_hits) / prompt if prompt else None,
            placed_hit_rate=sum(self.placed_hits) / prompt if prompt else None,
            num_replicas=self.num_replicas,
            capacity_blocks=self.capacity_blocks,
            placed_requests_by_replica=[self.placement.count(i) for i in range(self.num_replicas)],
        )


def oracle_bounds(
    records: Sequence[RequestRecord],
    block_size_tokens: int,
    model_id: str,
    num_replicas: int,
    capacity_blocks: int,
) -> OracleBounds:
    """Both bounds for the successful requests of one trace (see module docstring).

    Args:
        records: the trace; each successful record must carry `token_ids`.
        block_size_tokens: the engines' KV block size.
        model_id: roots the block hash chains.
        num_replicas: replicas of the run.
        capacity_blocks: KV blocks per replica.

    Returns:
        The bounds' hit rates (cached / prompt tokens).
    """
    ok = sorted((r for r in records if r.error is None), key=lambda r: r.send_s)
    bounds = StreamingBounds(block_size_tokens, num_replicas, capacity_blocks)
    for record, chain in zip(ok, request_block_hashes(ok, block_size_tokens, model_id)):
        bounds.observe(chain, len(record.token_ids))
    return bounds.result()
