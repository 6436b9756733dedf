"""Hit-rate bounds for a recorded trace: what any router could have got from the same requests.

Both bounds replay the trace's prompts in send order (ties keep trace order),
hashing each prompt's full KV blocks with `router.hashing` (the blocks vLLM
caches), and count a request's hit as its longest cached leading run of
blocks, at most `(prompt_tokens - 1) // block_size` blocks because vLLM always
recomputes the last prompt token. Generated tokens are not counted as
cacheable: on the live cluster the next prompt carries the workload's tool call,
not the model's text. Timing is ignored: a request may hit blocks that an
earlier, still-running request is computing, so both are bounds, not forecasts.

(a) `infinite`: one cache shared by all replicas that never evicts: the ceiling.
(b) `placed`: one LRU cache per replica of `capacity_blocks` blocks, and a
    greedy placement: each request goes to the replica whose cache holds its
    longest prefix, ties to the replica holding the fewest blocks, then the
    lowest index. No load limit. Greedy is not optimal in general (placement
    under capacity limits is a hard packing problem), so (b) is "the best
    placement we compute", and a router can beat it when capacity binds.
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


def infinite_cache_hits(chains: Sequence[Sequence[BlockHash]], num_tokens: Sequence[int], block_size_tokens: int) -> list[int]:
    """Cached tokens of each request with one never-evicting cache shared by all replicas."""
    seen: set[BlockHash] = set()
    hits = []
    for chain, tokens in zip(chains, num_tokens):
        count = 0
        for block_hash in chain:
            if block_hash not in seen:
                break
            count += 1
        hits.append(min(count, _usable_blocks(tokens, block_size_tokens)) * block_size_tokens)
        seen.update(chain)
    return hits


def greedy_placement_hits(
    chains: Sequence[Sequence[BlockHash]],
    num_tokens: Sequence[int],
    block_size_tokens: int,
    num_replicas: int,
    capacity_blocks: int,
) -> tuple[list[int], list[int]]:
    """Cached tokens per request and the replica index each went to, under the greedy placement of (b)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    caches = [LruBlockCache(capacity_blocks) for _ in range(num_replicas)]
    hits, placement = [], []
    for chain, tokens in zip(chains, num_tokens):
        best = min(range(num_replicas), key=lambda i: (-caches[i].longest_prefix(chain), len(caches[i]), i))
        count = caches[best].longest_prefix(chain)
        hits.append(min(count, _usable_blocks(tokens, block_size_tokens)) * block_size_tokens)
        placement.append(best)
        caches[best].use(chain)
    return hits, placement


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
    chains = request_block_hashes(ok, block_size_tokens, model_id)
    sizes = [len(r.token_ids) for r in ok]
    prompt = sum(sizes)
    infinite = infinite_cache_hits(chains, sizes, block_size_tokens)
    placed, placement = greedy_placement_hits(chains, sizes, block_size_tokens, num_replicas, capacity_blocks)
    return OracleBounds(
        num_requests=len(ok),
        prompt_tokens=prompt,
        infinite_hit_rate=sum(infinite) / prompt if prompt else None,
        placed_hit_rate=sum(placed) / prompt if prompt else None,
        num_replicas=num_replicas,
        capacity_blocks=capacity_blocks,
        placed_requests_by_replica=[placement.count(i) for i in range(num_replicas)],
    )
