"""bench.oracle on hand-made traces with known answers, and the trace records it reads."""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from bench.oracle import LruBlockCache, StreamingBounds, oracle_bounds
from bench.trace import RequestRecord, decode_token_ids, encode_token_ids, percentile, summarize

BS = 4
MODEL = "warmpath-tiny"


def tokens(*blocks: int, tail: int = 1) -> list[int]:
    """Full blocks of ids block*100 + i, then `tail` extra tokens (so the last full block is usable)."""
    ids = [b * 100 + i for b in blocks for i in range(BS)]
    return ids + [9000 + i for i in range(tail)]


def trace(*prompts: list[int], **fields) -> list[RequestRecord]:
    return [
        RequestRecord(f"s{i}", 0, float(i), prompt_tokens=len(p), token_ids=array("I", p), **fields)
        for i, p in enumerate(prompts)
    ]


def h(name: str) -> bytes:
    """A stand-in block hash: 16 bytes, as `StreamingBounds` keeps them."""
    return hashlib.md5(name.encode()).digest()


def bounds(records, num_replicas=1, capacity=1000):
    return oracle_bounds(records, BS, MODEL, num_replicas, capacity)


@pytest.mark.parametrize(
    ("prompts", "cached_tokens"),
    [
        ([tokens(1, 2), tokens(1, 2)], 8),  # second request: both blocks
        ([tokens(1, 2, tail=0), tokens(1, 2, tail=0)], 4),  # last token recomputed: one block only
        ([tokens(1, 2, 3), tokens(1, 5, 6)], 4),  # shares only the first block
        ([tokens(1, 2), tokens(2, 1)], 0),  # same blocks, other order: a block's hash covers its prefix
        ([tokens(1), tokens(1, 2), tokens(1, 2, 3)], 4 + 8),  # a growing conversation
    ],
)
def test_infinite_cache_counts_longest_cached_prefix(prompts, cached_tokens):
    result = bounds(trace(*prompts))
    assert result.prompt_tokens == sum(len(p) for p in prompts)
    assert result.infinite_hit_rate == pytest.approx(cached_tokens / result.prompt_tokens)
    assert result.placed_hit_rate == pytest.approx(result.infinite_hit_rate)  # one big replica = the ceiling
    alone = bounds(trace(*prompts), capacity=None)  # the replicas' capacity unknown: the infinite bound alone
    assert (alone.infinite_hit_rate, alone.prompt_tokens, alone.num_requests) == (
        result.infinite_hit_rate, result.prompt_tokens, result.num_requests)
    assert alone.placed_hit_rate is None and alone.capacity_blocks is None


def test_greedy_placement_separates_what_does_not_fit_together():
    x, y = tokens(1, 2, 3), tokens(4, 5, 6)
    records = trace(x, y, x, y)
    # Two replicas of 3 blocks: x on r0, y on r1 (the emptier), then both hit fully (3 blocks each).
    two = bounds(records, num_replicas=2, capacity=3)
    assert two.placed_requests_by_replica == [2, 2]
    assert two.placed_hit_rate == pytest.approx(24 / 52)
    assert two.infinite_hit_rate == pytest.approx(24 / 52)
    # One replica of 3 blocks: every request evicts the other chain, nothing ever hits.
    one = bounds(records, num_replicas=1, capacity=3)
    assert one.placed_hit_rate == 0.0
    assert one.infinite_hit_rate == pytest.approx(24 / 52)


def test_placement_weighs_evictions_against_a_shared_prefix():
    a, b = tokens(1, 2, 3, 4), tokens(1, 5, 6, 7)
    # Replicas of 4 blocks: b shares one block with a on r0, but keeping its other three there
    # evicts three of a's; r1 computes all four without evicting anything, so b goes there.
    result = bounds(trace(a, b, a, b), num_replicas=2, capacity=4)
    assert result.placed_requests_by_replica == [2, 2]
    assert result.placed_hit_rate == pytest.approx(2 * 16 / 68)  # both repeats hit all 4 blocks


def test_full_caches_take_new_chains_where_the_oldest_block_is():
    # Replicas of 3 blocks, all full: a new chain costs the same everywhere, so it goes where the
    # least recently used block is oldest (one LRU cache of the joint capacity would evict that one).
    x, y, z, w = tokens(1, 2, 3), tokens(4, 5, 6), tokens(7, 8, 9), tokens(10, 11, 12)
    result = bounds(trace(x, y, x, z, w), num_replicas=2, capacity=3)
    # x -> r0, y -> r1 (emptier), x hits on r0 (now the newer), z evicts y on r1, w evicts x on r0.
    assert result.placed_requests_by_replica == [3, 2]
    assert result.placed_hit_rate == pytest.approx(12 / 65)


def test_streaming_bounds_count_cached_responses():
    stream = StreamingBounds(block_size_tokens=BS, num_replicas=2, capacity_blocks=8)
    p0, p1, o2, n3 = map(h, ["p0", "p1", "o2", "n3"])
    replica = stream.observe([p0, p1], 2 * BS + 1)
    stream.cache([p0, p1, o2], replica)  # the response's block, carried by the next prompt
    assert stream.observe([p0, p1, o2, n3], 4 * BS + 1) == replica
    assert stream.infinite_hits == [0, 3 * BS] and stream.placed_hits == [0, 3 * BS]


class ReferenceBounds:
    """The bounds as the module docstring states them: a set, and every replica's LRU cache scanned block by block."""

    def __init__(self, num_replicas: int, capacity: int) -> None:
        self.seen: set[bytes] = set()
        self.caches = [LruBlockCache(capacity) for _ in range(num_replicas)]
        self.capacity = capacity
        self.infinite_hits: list[int] = []
        self.placed_hits: list[int] = []
        self.clock = 0

    def use(self, replica: int, chain: list[bytes]) -> None:
        self.clock += 1
        self.caches[replica].use(chain, self.clock)

    def observe(self, chain: list[bytes], num_tokens: int) -> int:
        usable = max(num_tokens - 1, 0) // BS
        count = next((i for i, block in enumerate(chain) if block not in self.seen), len(chain))
        self.infinite_hits.append(min(count, usable) * BS)
        self.seen.update(chain)

        def cost(i: int) -> tuple[int, int, int, int, int]:
            cache = self.caches[i]
            matched = cache.longest_prefix(chain)
            new = len(chain) - matched
            return new + max(0, len(cache) + new - self.capacity), -matched, len(cache), cache.lru_stamp() or 0, i

        best = min(range(len(self.caches)), key=cost)
        self.placed_hits.append(min(self.caches[best].longest_prefix(chain), usable) * BS)
        self.use(best, chain)
        return best

    def cache(self, chain: list[bytes], replica: int) -> None:
        self.seen.update(chain)
        self.use(replica, chain)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("num_replicas", "capacity"), [(1, 6), (3, 10), (5, 30), (70, 12)])
def test_streaming_bounds_match_the_block_by_block_reference(seed, num_replicas, capacity):
    # Sessions that extend their own chains and share prefixes with others, some with a
    # cached response: placements and hits must agree request by request.
    rng = random.Random(seed)
    fast, reference = StreamingBounds(BS, num_replicas, capacity), ReferenceBounds(num_replicas, capacity)
    chains: list[list[bytes]] = []
    for i in range(300):
        base = rng.choice(chains)[: rng.randint(0, 12)] if chains and rng.random() < 0.85 else []
        chain = base + [h(f"{i}-{j}") for j in range(rng.randint(0, 5))]
        chains.append(chain)
        num_tokens = len(chain) * BS + rng.randint(0, 1)
        replica = fast.observe(chain, num_tokens)
        assert replica == reference.observe(chain, num_tokens)
        if chain and rng.random() < 0.3:
            response = chain + [h(f"{i}-out")]
            fast.cache(response, replica)
            reference.cache(response, replica)
            chains.append(response)
    assert fast.infinite_hits == reference.infinite_hits
    assert fast.placed_hits == reference.placed_hits
    assert sum(fast.placed_hits) > 0


def test_lru_frees_a_request_tail_first_so_prefixes_outlive_extensions():
    cache = LruBlockCache(capacity_blocks=4)
    x, z = ["x0", "x1", "x2"], ["x0", "x1", "z2", "z3"]
    assert cache.use(x) == []
    assert cache.use(z) == ["x2"]  # x2 is older than x's prefix, which z just used again
    assert cache.longest_prefix(x) == 2
    assert cache.longest_prefix(z) == 4
    assert cache.use(["w0", "w1"]) == ["z3", "z2"]  # tail first again
    assert cache.longest_prefix(z) == 2


def test_bounds_replay_in_send_order_and_skip_failed_requests():
    first, second = trace(tokens(1, 2), tokens(1, 2))
    first.send_s, second.send_s = 5.0, 1.0  # second was sent first
    second.prompt_tokens = 1000  # the oracle sizes prompts by their token ids
    failed = RequestRecord("s9", 0, 9.0, prompt_tokens=9, token_ids=array("I", tokens(1, 2)), error="HTTP 500")
    result = bounds([first, second, failed])
    assert result.num_requests == 2
    assert result.infinite_hit_rate == pytest.approx(8 / 18)


@pytest.mark.parametrize("capacity", [None, 1000])
def test_a_request_that_failed_after_its_prefill_caches_its_blocks_without_counting(capacity):
    """Its stream was cut off after the engine cached its prompt: a later request hits those blocks, and
    the ceiling must hold them too, or the measured hit rate could pass it."""
    failed = RequestRecord("s9", 0, 0.0, prompt_tokens=9, token_ids=array("I", tokens(1, 2)), error="stream cut off")
    (later,) = trace(tokens(1, 2, 3))
    later.send_s = 1.0
    result = oracle_bounds([failed, later], BS, MODEL, 1, capacity)
    assert result.num_requests == 1 and result.prompt_tokens == 13
    assert result.infinite_hit_rate == pytest.approx(8 / 13)
    if capacity is not None:
        assert result.placed_hit_rate == pytest.approx(8 / 13)
        assert result.placed_requests_by_replica == [1]


def test_records_without_token_ids_are_rejected():
    with pytest.raises(ValueError, match="no token ids"):
        bounds([RequestRecord("s", 0, 0.0, prompt_tokens=3)])


def test_record_json_round_trip_keeps_token_ids():
    record = RequestRecord("s1", 2, 1.5, prompt_tokens=3, cached_tokens=0, replica_id="r1", ttft_s=0.25,
                           token_ids=array("I", [0, 7, 2**32 - 1]))
    again = RequestRecord.from_json(record.to_json())
    assert again == record
    assert decode_token_ids(encode_token_ids([1, 2, 3])) == array("I", [1, 2, 3])


def test_summary_figures_of_a_small_trace():
    records = [
        RequestRecord("a", 0, 0.0, prompt_tokens=100, cached_tokens=0, replica_id="r0", ttft_s=1.0, latency_s=2.0),
        RequestRecord("a", 1, 3.0, prompt_tokens=200, cached_tokens=96, replica_id="r0", ttft_s=0.2, latency_s=1.0,
                      predicted_cached_tokens=96),
        RequestRecord("b", 0, 1.0, prompt_tokens=100, cached_tokens=64, replica_id="r1", ttft_s=0.4, latency_s=1.0,
                      predicted_cached_tokens=0),
        RequestRecord("c", 0, 1.0, prompt_tokens=50, error="HTTP 500"),
    ]
    summary = summarize(records, ["r0", "r1", "r2"], block_size_tokens=32)
    assert (summary.num_requests, summary.num_errors) == (3, 1)
    assert summary.hit_rate == pytest.approx(160 / 400)
    assert summary.prefill_tokens == 240
    assert summary.prefill_tokens_by_replica == {"r0": 204, "r1": 36, "r2": 0}
    assert summary.load_imbalance == pytest.approx(204 / 80)
    assert summary.turns_per_s == pytest.approx(3 / 4.0)
    assert summary.prediction_accuracy == 0.5
    assert summary.ttft_p50_s == pytest.approx(0.4)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([], 99) is None


def _stale_then_session(replica_ids):
    """Session A (8 blocks, never seen again) fills replica 0; session S starts there and grows to 10 blocks."""
    a = tokens(1, 2, *range(10, 16))
    s0 = tokens(1, 2, 20, 21)
    s1 = tokens(1, 2, 20, 21, *range(22, 28))
    records = [RequestRecord(f"s{i}", 0, float(i), prompt_tokens=len(p), token_ids=array("I", p), replica_id=r)
               for i, (p, r) in enumerate(zip((a, s0, s1), replica_ids))]
    return records


def test_the_placed_bound_is_at_least_the_runs_own_placement():
    """The greedy moved S off full replica 0 (its 4 blocks there) to the empty replica 1 and hit nothing: charging
    a stale block's eviction as much as computing one, it scored below what a sticky router reached."""
    result = oracle_bounds(_stale_then_session(["r0", "r0", "r0"]), BS, MODEL, 2, 10)
    assert result.greedy_hit_rate == pytest.approx(2 * BS / result.prompt_tokens)  # s0 hits the shared 2 blocks
    assert result.own_placement_hit_rate == pytest.approx((2 + 4) * BS / result.prompt_tokens)
    assert result.placed_hit_rate == result.own_placement_hit_rate


def test_a_trace_that_does_not_say_where_its_requests_ran_keeps_the_greedy_bound():
    result = oracle_bounds(_stale_then_session(["r0", None, "r0"]), BS, MODEL, 2, 10)
    assert result.own_placement_hit_rate is None and result.placed_hit_rate == result.greedy_hit_rate


def test_the_feeds_replay_the_simulations_own_placement():
    from bench.bounds_feed import BoundsProcess, SessionBounds

    chains = {name: [h(f"{name}{i}") for i in range(n)] for name, n in (("a", 8), ("s", 10))}
    chains["a"][:2] = chains["s"][:2] = [h("sys0"), h("sys1")]
    results = []
    for feed in (SessionBounds(BS, 2, 10), BoundsProcess(BS, 2, 10)):
        try:
            feed.observe("a", chains["a"], 8 * BS + 1, 0)
            feed.observe("s", chains["s"][:4], 4 * BS + 1, 0)
            feed.observe("s", chains["s"], 10 * BS + 1, 0)
            results.append(feed.result())
        finally:
            feed.close()
    for result in results:
        assert result.own_placement_hit_rate > result.greedy_hit_rate
        assert result.placed_hit_rate == result.own_placement_hit_rate
    assert results[0] == results[1]
