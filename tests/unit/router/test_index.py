"""router.index.PrefixIndex, driven by real vLLM KV event structs."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from router.hashing import RequestBlockHashes, hash_request_blocks, root_hash
from router.index import PrefixIndex, _engine_keys, leading_runs
from router.types import ReplicaId

BS = 4
MODEL = "warmpath-tiny"
A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
TOKENS = list(range(100, 132))  # 8 full blocks


def ehash(i: int) -> bytes:
    """An engine (vLLM) block hash: 32 bytes, as vLLM publishes by default."""
    return i.to_bytes(32, "big")


def stored(first_block: int, num_blocks: int, tokens=TOKENS, parent: int | None = None, **kw) -> BlockStored:
    """BlockStored for blocks [first_block, first_block + num_blocks) of `tokens`."""
    fields = dict(
        block_hashes=[ehash(i) for i in range(first_block, first_block + num_blocks)],
        parent_block_hash=None if parent is None else ehash(parent),
        token_ids=tokens[first_block * BS : (first_block + num_blocks) * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    fields.update(kw)
    return BlockStored(**fields)


def removed(*blocks: int, **kw) -> BlockRemoved:
    return BlockRemoved(block_hashes=[ehash(i) for i in blocks], medium=kw.pop("medium", "GPU"), **kw)


def request_hashes(tokens=TOKENS, model=MODEL, salt=None):
    return hash_request_blocks(tokens, BS, root_hash(model, salt))


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(block_size_tokens=BS, max_blocks_per_replica=1000, model_id=MODEL)


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([stored(0, 3)], {A: 3}),
        ([stored(0, 3), stored(3, 2, parent=2)], {A: 5}),
        ([stored(0, 8)], {A: 8}),
        ([stored(0, 3), stored(4, 2, parent=3)], {A: 3}),  # parent 3 never stored: skipped
        ([stored(0, 8), removed(7, 6, 5)], {A: 5}),  # vLLM evicts a chain from its end
        ([stored(0, 8), removed(0)], {}),
        ([stored(0, 8), AllBlocksCleared()], {}),
        ([stored(0, 8), AllBlocksCleared(), stored(0, 2)], {A: 2}),
        ([stored(0, 2), stored(0, 2), removed(1)], {A: 2}),  # two physical copies, one removed
        ([stored(0, 2), stored(0, 2), removed(1), removed(1)], {A: 1}),
        ([stored(0, 2), removed(9)], {A: 2}),  # unknown engine hash: ignored
        ([stored(0, 8), removed(5, medium="CPU")], {A: 8}),  # another tier's removal
    ],
)
def test_apply_then_longest_prefix(index, events, expected):
    index.apply(A, events)
    assert index.longest_prefix(request_hashes(), now_s=0.0) == expected


@pytest.mark.parametrize(
    "first",
    [
        stored(0, 4, extra_keys=[None, (("mm-hash", 0),), None, None]),  # an image in block 1
        stored(0, 4, extra_keys=[("s1", "s2"), None, None, None]),  # a salt no request can name
    ],
    ids=["multimodal", "two-salts"],
)
def test_blocks_extending_a_block_skipped_on_purpose_are_skipped_not_orphaned(index, first):
    """The rest of a chunked prefill and every decode block extend the skipped ones; as orphans they made
    a healthy stream look blind (the pump then cleared the replica's index and reloaded it, again and again)."""
    extending = [stored(i, 1, parent=i - 1) for i in range(4, 8)]
    results = [index.apply(A, [event]) for event in [first, *extending]]
    assert sum(r.num_orphaned_blocks for r in results) == 0
    assert sum(r.num_skipped_blocks for r in results) == 8 - results[0].num_stored_blocks
    index.apply(A, [removed(7)])  # evicted: a block extending it is an orphan again
    assert index.apply(A, [stored(8, 1, tokens=TOKENS + list(range(4)), parent=7)]).num_orphaned_blocks == 1
    index.apply(A, [AllBlocksCleared()])
    assert index.apply(A, [stored(5, 1, parent=4)]).num_orphaned_blocks == 1


@pytest.mark.parametrize(
    ("event", "num_skipped_blocks"),
    [
        (stored(0, 2, medium="CPU"), 2),  # an offload tier, not the engine's pool
        (stored(0, 2, group_idx=1), 2),
        (stored(0, 2, block_size=8, token_ids=TOKENS[:16]), 2),
        (stored(0, 2, token_ids=TOKENS[:7]), 2),
        (stored(0, 2, extra_keys=[(("mm-hash", 0),), None]), 2),
        (stored(0, 2, extra_keys=[None, (b"embeds-digest",)]), 1),
        (stored(0, 2, extra_keys=[("s1", "s2"), None]), 2),  # two salts: no request names both
        (stored(0, 2, parent=7), 2),
    ],
)
def test_blocks_the_router_cannot_reproduce_are_skipped(index, event, num_skipped_blocks):
    result = index.apply(A, [event])
    assert result.num_skipped_blocks == num_skipped_blocks
    assert result.num_stored_blocks == 2 - num_skipped_blocks
    assert index.snapshot().num_blocks_by_replica[A] == 2 - num_skipped_blocks


def test_a_hybrid_models_index_follows_its_full_attention_group_whatever_its_number(index):
    """vLLM numbers groups by their first layer's kind: Gemma's group 0 is sliding-window, whose blocks leave from
    the front of a chain as the window moves. Followed, the index saw every chain cut at its root and credited
    nothing, while the engine reused the prefix; and one hash names a block in every group, so that group's
    removals took the full-attention group's blocks too."""
    window, full = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}, \
        {"kv_cache_spec_kind": "full_attention"}
    index.apply(A, [stored(0, 8, group_idx=0, **window), stored(0, 8, group_idx=1, **full)])
    # The window moved: its group dropped the first blocks (the full-attention group keeps them).
    result = index.apply(A, [removed(0, 1, 2, 3, group_idx=0)])
    assert result.num_removed_blocks == 0 and result.num_skipped_blocks == 4
    assert index.longest_prefix(request_hashes(), now_s=0.0) == {A: 8}
    assert index.apply(A, [removed(6, 7, group_idx=1)]).num_removed_blocks == 2
    assert index.longest_prefix(request_hashes(), now_s=0.0) == {A: 6}


@pytest.mark.parametrize("events, expected", [
    # A vLLM that names no kinds (or no groups): group 0, as before.
    ([stored(0, 3, group_idx=0), stored(0, 3, group_idx=1, tokens=TOKENS)], {A: 3}),
    ([stored(0, 3)], {A: 3}),
    # MLA caches whole prefixes too; a model with no such group is followed in none.
    ([stored(0, 3, group_idx=0, kv_cache_spec_kind="mla_attention")], {A: 3}),
    ([stored(0, 3, group_idx=0, kv_cache_spec_kind="sliding_window")], {}),
    ([stored(0, 3, group_idx=0, kv_cache_spec_kind="mamba")], {}),
])
def test_the_group_followed_is_the_first_caching_whole_prefixes(index, events, expected):
    index.apply(A, events)
    assert index.longest_prefix(request_hashes(), now_s=0.0) == expected


@pytest.mark.parametrize(
    ("event_kw", "model", "salt", "expected"),
    [
        ({"extra_keys": [("s1",), None]}, MODEL, "s1", {A: 2}),
        ({"extra_keys": [("s1",), None]}, MODEL, None, {}),
        ({"lora_name": "ad", "extra_keys": [("ad",), ("ad",)]}, "ad", None, {A: 2}),
        ({"lora_name": "ad", "extra_keys": [("ad", "s1"), ("ad",)]}, "ad", "s1", {A: 2}),
        ({"lora_name": "ad", "extra_keys": [("ad",), ("ad",)]}, MODEL, None, {}),
        # Two string keys besides the LoRA name: not a salt a request can name, so the blocks are skipped.
        ({"extra_keys": [("s1", "s2"), None]}, MODEL, "s1", {}),
        ({"extra_keys": [("s1", "s2"), None]}, MODEL, "s2", {}),
        ({"lora_name": "ad", "extra_keys": [("ad", "s1", "s2"), ("ad",)]}, "ad", "s1", {}),
    ],
)
def test_cache_salt_and_lora_name_seed_the_chain(index, event_kw, model, salt, expected):
    index.apply(A, [stored(0, 2, **event_kw)])
    assert index.longest_prefix(request_hashes(model=model, salt=salt), 0.0) == expected


def test_int_engine_hashes_match_their_bytes_form(index):
    """vLLM can publish hashes as ints (low 64 bits of the bytes); both name the same block."""
    index.apply(A, [stored(0, 3)])
    index.apply(A, [BlockRemoved(block_hashes=[int.from_bytes(ehash(2), "big") & (2**64 - 1)], medium="GPU")])
    assert index.longest_prefix(request_hashes(), 0.0) == {A: 2}


def test_replicas_are_independent(index):
    index.apply(A, [stored(0, 8)])
    index.apply(B, [stored(0, 3)])
    index.apply(C, [stored(0, 8), AllBlocksCleared()])
    assert index.longest_prefix(request_hashes(), 0.0) == {A: 8, B: 3}
    index.apply(A, [removed(1)])
    assert index.longest_prefix(request_hashes(), 0.0) == {A: 1, B: 3}


def test_unknown_event_types_are_skipped(index):
    class FutureEvent:
        pass

    result = index.apply(A, [FutureEvent(), stored(0, 2)])
    assert (result.num_skipped_events, result.num_stored_blocks) == (1, 2)


@pytest.mark.parametrize(
    ("max_blocks", "events", "num_indexed", "num_evicted", "expected_prefix"),
    [
        (4, [stored(0, 6)], 4, 2, {}),  # blocks 0 and 1 forgotten: no leading match
        (6, [stored(0, 6)], 6, 0, {A: 6}),
        # Re-storing block 0 refreshes it, so block 1 is the one forgotten. The engine still holds it
        # (it evicts a block's extensions first), so the lookup steps over it.
        (4, [stored(0, 4), stored(0, 1), stored(4, 1, parent=3)], 4, 1, {A: 5}),
    ],
)
def test_lru_bound_per_replica(max_blocks, events, num_indexed, num_evicted, expected_prefix):
    index = PrefixIndex(BS, max_blocks, MODEL)
    index.apply(A, events)
    snap = index.snapshot()
    assert snap.num_blocks_by_replica[A] == num_indexed
    assert snap.num_evicted_blocks_by_replica[A] == num_evicted
    assert index.longest_prefix(request_hashes(), 0.0) == expected_prefix


def test_a_replica_with_a_larger_kv_cache_than_the_bound_keeps_its_oldest_blocks():
    """The shared prefix, stored first and hit ever after, is the first block the bound would forget."""
    index = PrefixIndex(BS, 4, MODEL)
    index.set_replica_capacity(A, 8)
    index.set_replica_capacity(B, 2)  # a smaller cache keeps the configured bound
    index.apply(A, [stored(0, 8)])
    index.apply(B, [stored(0, 6)])
    assert index.longest_prefix(request_hashes(), 0.0) == {A: 8}
    assert index.snapshot().num_evicted_blocks_by_replica == {A: 0, B: 2}
    index.remove_replica(A)  # a replica that comes back reports its capacity again
    index.apply(A, [stored(0, 8)])
    assert index.snapshot().num_evicted_blocks_by_replica[A] == 4


def test_an_event_naming_one_engine_hash_twice_leaves_no_owner_bit_behind(index):
    """`blocks` kept one entry for the key while both hashes got the replica's bit: the second outlived the
    block's removal, a clear and the replica itself, and credited the next replica given that slot."""
    event = stored(0, 2, block_hashes=[ehash(7), ehash(7)])
    index.apply(A, [event])
    index.apply(A, [removed(7), removed(7)])
    assert index.longest_prefix(request_hashes(), 0.0) == {}
    index.apply(A, [event])
    index.remove_replica(A)
    index.apply(B, [])  # the next replica, given A's slot
    assert index.longest_prefix(request_hashes(), 0.0) == {}


def test_a_block_the_bound_forgets_forgets_its_extra_copies_too():
    """Block 0 is stored twice, forgotten by the bound, then stored once more: one removal takes it."""
    index = PrefixIndex(BS, 3, MODEL)
    index.apply(A, [stored(0, 1), stored(0, 1), stored(1, 3, parent=0)])  # block 0 (two copies) forgotten
    assert index.snapshot().num_evicted_blocks_by_replica[A] == 1
    index.apply(A, [stored(0, 1)])  # one new copy (block 1 forgotten in turn)
    result = index.apply(A, [removed(0)])
    assert result.num_removed_blocks == 1
    assert index.longest_prefix(request_hashes(), 0.0) == {}  # a stale copy count would keep block 0: {A: 4}


@pytest.mark.parametrize(
    ("pending_at", "ttl_s", "lookup_at", "expected"),
    [
        (0.0, 2.0, 1.9, {A: 8}),
        (0.0, 2.0, 2.0, {}),  # expired exactly at now + ttl
        (0.0, 2.0, 5.0, {}),
    ],
)
def test_pending_counts_until_expiry(index, pending_at, ttl_s, lookup_at, expected):
    index.add_pending(A, request_hashes(), pending_at, ttl_s)
    assert index.longest_prefix(request_hashes(), lookup_at) == expected


def test_pending_is_confirmed_by_events_and_outlives_nothing(index):
    hashes = request_hashes()
    assert index.add_pending(A, hashes, 0.0, 2.0) == 8
    index.apply(A, [stored(0, 3)])
    assert index.snapshot(0.5).num_pending_blocks_by_replica[A] == 5
    assert index.longest_prefix(hashes, 0.5) == {A: 8}
    assert index.longest_prefix(hashes, 3.0) == {A: 3}  # unconfirmed tail expired
    assert index.snapshot(3.0).num_pending_blocks_by_replica[A] == 0


def test_pending_skips_blocks_already_indexed_and_later_pending_extends(index):
    hashes = request_hashes()
    index.apply(A, [stored(0, 2)])
    assert index.add_pending(A, hashes, 0.0, 2.0) == 6
    assert index.add_pending(A, hashes, 1.5, 2.0) == 6  # refreshed: now expires at 3.5
    assert index.longest_prefix(hashes, 3.0) == {A: 8}
    assert index.longest_prefix(hashes, 3.5) == {A: 2}


def test_pending_and_indexed_blocks_combine_across_replicas(index):
    hashes = request_hashes()
    index.apply(A, [stored(0, 8)])
    index.add_pending(B, hashes[:4], 0.0, 2.0)
    assert index.longest_prefix(hashes, 1.0) == {A: 8, B: 4}


def test_a_withdrawn_placement_counts_no_more_and_indexed_blocks_stay(index):
    hashes = request_hashes()
    index.apply(A, [stored(0, 2)])
    index.add_pending(A, hashes, 0.0, 2.0)
    index.add_pending(B, hashes, 0.0, 2.0)
    assert index.withdraw_pending(A, hashes) == 6
    assert index.longest_prefix(hashes, 1.0) == {A: 2, B: 8}  # A's indexed blocks and B's placement stay
    assert index.snapshot(1.0).num_pending_blocks_by_replica[A] == 0
    assert index.withdraw_pending(A, hashes) == 0 and index.withdraw_pending("unknown", hashes) == 0
    assert index.longest_prefix(hashes, 3.0) == {A: 2}  # the expiry of the withdrawn entries finds nothing


def test_clear_replica_keeps_pending(index):
    index.apply(A, [stored(0, 8)])
    index.add_pending(A, request_hashes(tokens=list(range(8))), 0.0, 2.0)
    index.clear_replica(A)
    assert index.longest_prefix(request_hashes(), 0.0) == {}
    assert index.longest_prefix(request_hashes(tokens=list(range(8))), 0.0) == {A: 2}


def test_remove_replica_forgets_everything_and_frees_its_slot(index):
    hashes = request_hashes()
    index.apply(A, [stored(0, 8)])
    index.add_pending(A, request_hashes(tokens=list(range(8))), 0.0, 2.0)
    index.apply(B, [stored(0, 3)])
    index.remove_replica(A)
    assert index.longest_prefix(hashes, 0.0) == {B: 3}
    assert index.longest_prefix(request_hashes(tokens=list(range(8))), 0.0) == {}
    assert index.snapshot().num_unique_blocks == 3
    # A new replica takes the freed slot and inherits nothing.
    index.apply(C, [stored(0, 1)])
    assert index.longest_prefix(hashes, 0.0) == {B: 3, C: 1}
    assert index.longest_prefix(request_hashes(tokens=list(range(8))), 5.0) == {}
    assert A not in index.snapshot().num_blocks_by_replica


@pytest.mark.parametrize("seed", range(20))
def test_lookup_matches_a_block_by_block_walk(seed):
    """Bisected lookups agree with the plain definition on caches vLLM produces (extensions evicted first)."""
    rng = random.Random(seed)
    index = PrefixIndex(BS, 10_000, MODEL)
    tokens = list(range(5000, 5000 + 200 * BS))
    hashes = request_hashes(tokens)
    replicas = [ReplicaId(f"r{i}") for i in range(5)]
    for replica_id in replicas:
        num_stored = rng.randrange(0, 201)
        if num_stored:
            index.apply(replica_id, [stored(0, num_stored, tokens=tokens)])
        num_kept = rng.randrange(0, num_stored + 1)
        index.apply(replica_id, [removed(*reversed(range(num_kept, num_stored)))])  # the tail, last block first
    owners = index._owners
    expected = {}
    for slot, replica_id in enumerate(index._slot_ids):
        count = 0
        while count < len(hashes) and owners.get(hashes[count], 0) >> slot & 1:
            count += 1
        if count:
            expected[replica_id] = count
    assert index.longest_prefix(hashes, 0.0) == expected


@pytest.mark.parametrize(("block_size", "max_blocks"), [(0, 10), (4, 0)])
def test_bad_construction_raises(block_size, max_blocks):
    with pytest.raises(ValueError):
        PrefixIndex(block_size, max_blocks, MODEL)


LONG = list(range(1000, 1000 + 64 * BS))  # 64 full blocks


@pytest.mark.parametrize(
    ("num_shared_blocks", "expected"),
    [
        (64, 64),  # the whole placement: its last block is a checkpoint
        (16, 16),  # the first 16 blocks are all checkpoints
        (12, 12),
        (40, 32),  # past the dense head: rounded down to the checkpoint at block 31
        (47, 32),
        (48, 48),  # the checkpoint at block 47
    ],
)
def test_pending_placements_are_recorded_at_checkpoints(index, num_shared_blocks, expected):
    hashes = request_hashes(LONG)
    assert index.add_pending(A, hashes, 0.0, 2.0) == 16 + 3  # blocks 0-15, 31, 47 and the last (63)
    other = LONG[: num_shared_blocks * BS] + [7] * ((64 - num_shared_blocks) * BS)
    assert index.longest_prefix(request_hashes(other), 1.0) == {A: expected}


def test_pending_checkpoints_extend_an_indexed_prefix(index):
    hashes = request_hashes(LONG)
    index.apply(A, [stored(0, 20, tokens=LONG)])
    assert index.add_pending(A, hashes, 0.0, 2.0, num_held_blocks=20) == 3  # 31, 47, 63: the indexed head is skipped
    assert index.longest_prefix(hashes, 1.0) == {A: 64}
    assert index.longest_prefix(hashes, 2.0) == {A: 20}  # expired; the indexed head stays



def _credited_by_every_block(index: PrefixIndex, hashes, now_s: float) -> dict:
    """The plain definition: each replica's indexed prefix, raised to its furthest pending checkpoint anywhere."""
    index.expire_pending(now_s)
    result = {}
    for slot, replica_id in enumerate(index._slot_ids):
        count = 0
        while count < len(hashes) and index._owners.get(hashes[count], 0) >> slot & 1:
            count += 1
        for position in reversed(range(count, len(hashes))):
            if index._pending_owners.get(hashes[position], 0) >> slot & 1:
                count = position + 1
                break
        if count and replica_id is not None:
            result[replica_id] = count
    return result


def _store_through(index: PrefixIndex, replica_id, tokens, hashes, num_blocks: int) -> None:
    """The engine caches the first `num_blocks` blocks (what it lacks of them), with engine hashes unique per block."""
    held = 0
    slot = index._replicas[replica_id].slot if replica_id in index._replicas else None
    while slot is not None and held < num_blocks and index._owners.get(hashes[held], 0) >> slot & 1:
        held += 1
    if held < num_blocks:
        index.apply(replica_id, [BlockStored(
            block_hashes=[bytes(16) + h for h in hashes[held:num_blocks]],
            parent_block_hash=bytes(16) + hashes[held - 1] if held else None,
            token_ids=tokens[held * BS: num_blocks * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None,
        )])


@pytest.mark.parametrize("seed", range(40))
def test_pending_lookups_credit_what_a_scan_of_every_block_credits(seed):
    # Placements of every length branch off one long chain at random points, on replicas that hold
    # random heads of it; the engine confirms random prefixes of them (a first prefill chunk, or all)
    # before and after they are recorded, and some expire. No block is removed.
    rng = random.Random(seed)
    index = PrefixIndex(BS, 100_000, MODEL)
    base = list(range(20_000, 20_000 + 300 * BS))
    replicas = [ReplicaId(f"r{i}") for i in range(4)]

    def prompt() -> list[int]:
        num_blocks = rng.choice([rng.randrange(1, 40), rng.randrange(1, 300)])
        branch = rng.randrange(num_blocks + 1)
        fresh = [rng.randrange(10**6) for _ in range((num_blocks - branch) * BS)]
        return base[: branch * BS] + fresh + [7]

    for step in range(40):
        now_s = float(step)
        tokens = prompt()
        hashes = request_hashes(tokens)
        replica_id = rng.choice(replicas)
        if rng.random() < 0.3:
            _store_through(index, replica_id, tokens, hashes, rng.randrange(len(hashes) + 1))
        held = index.longest_prefix(hashes, now_s).get(replica_id, 0)
        index.add_pending(replica_id, hashes, now_s, rng.choice([0.5, 3.0, 20.0]), held)
        if rng.random() < 0.4:
            _store_through(index, replica_id, tokens, hashes, rng.randrange(len(hashes) + 1))
        for _ in range(4):
            query = request_hashes(prompt())
            assert index.longest_prefix(query, now_s + 0.25) == _credited_by_every_block(index, query, now_s + 0.25)


def test_a_placement_ending_off_the_grid_is_also_recorded_at_the_grid_before_it(index):
    hashes = request_hashes(LONG[: 40 * BS])  # 40 blocks: the last, 39, lies between grid points 31 and 47
    index.apply(A, [stored(0, 34, tokens=LONG)])
    assert index.add_pending(A, hashes, 0.0, 2.0, num_held_blocks=34) == 2  # 39, and 31 though A holds it
    sharing_all = request_hashes(LONG[: 40 * BS] + [7] * 20 * BS)
    assert index.longest_prefix(sharing_all, 1.0) == {A: 40}

# --- bisected lookups and detached blocks ------------------------------------------------------------


class CountingDict(dict):
    """A dict that counts `get` calls: how many blocks a lookup read."""

    num_gets = 0

    def get(self, key, default=None):
        self.num_gets += 1
        return super().get(key, default)


@pytest.mark.parametrize("seed", range(30))
def test_leading_runs_credits_each_owner_with_its_prefix(seed):
    rng = random.Random(seed)
    num_blocks = rng.randrange(1, 500)
    chain = [f"b{i}" for i in range(num_blocks)]
    lengths = [rng.choice([0, num_blocks, rng.randrange(num_blocks + 1)]) for _ in range(rng.randrange(1, 9))]
    masks = CountingDict()
    for owner, length in enumerate(lengths):
        for block in chain[:length]:
            masks[block] = masks.get(block, 0) | 1 << owner
    masks.num_gets = 0
    credited = {}
    for mask, n in leading_runs(masks.get, chain):
        for owner in range(len(lengths)):
            if mask >> owner & 1:
                assert owner not in credited
                credited[owner] = n
    assert credited == {owner: n for owner, n in enumerate(lengths) if n}
    # A few lookups per distinct run length, not one per block.
    assert masks.num_gets <= 2 + len(set(lengths)) * (num_blocks.bit_length() + 1)


def test_leading_runs_of_nothing():
    assert leading_runs({}.get, []) == []
    assert leading_runs({}.get, ["b0", "b1"]) == []


def test_a_lookup_reads_a_few_blocks_per_replica_not_every_block():
    tokens = list(range(5000, 5000 + 200 * BS))
    index = PrefixIndex(BS, 10_000, MODEL)
    index._owners = owners = CountingDict()
    index.apply(A, [stored(0, 200, tokens=tokens)])
    index.apply(B, [stored(0, 120, tokens=tokens)])
    index.apply(C, [stored(0, 7, tokens=tokens)])
    owners.num_gets = 0
    assert index.longest_prefix(request_hashes(tokens), 0.0) == {A: 200, B: 120, C: 7}
    assert owners.num_gets <= 3 * 9


def test_a_removal_out_of_vllm_order_is_stepped_over():
    """vLLM never removes a block before its extensions; if a stream did, the lookup would not see the gap."""
    tokens = list(range(5000, 5000 + 200 * BS))
    index = PrefixIndex(BS, 10_000, MODEL)
    index.apply(A, [stored(0, 200, tokens=tokens), removed(50)])
    assert index.longest_prefix(request_hashes(tokens), 0.0) == {A: 200}
    index.apply(A, [removed(*range(199, 49, -1))])  # the rest of the tail: the chain ends at block 50
    assert index.longest_prefix(request_hashes(tokens), 0.0) == {A: 50}


BRANCH = TOKENS[: 3 * BS] + list(range(900, 900 + 5 * BS))  # shares blocks 0-2 with TOKENS, then differs


@pytest.mark.parametrize("seed", range(40))
def test_lookups_follow_any_vllm_order_of_events_on_branching_chains(seed):
    """Random stores that extend what a replica holds, removals of blocks nothing extends: lookups match a model."""
    rng = random.Random(seed)
    index = PrefixIndex(BS, 1000, MODEL)
    chains = [(TOKENS, lambda i: i), (BRANCH, lambda i: i if i < 3 else 100 + i)]  # (tokens, engine key of block i)
    parent_of = {key_of(i): key_of(i - 1) for _, key_of in chains for i in range(1, 8)}
    held: dict[ReplicaId, Counter[int]] = {A: Counter(), B: Counter()}  # engine key -> copies held
    for _ in range(80):
        replica_id = rng.choice([A, B])
        copies = held[replica_id]
        tokens, key_of = rng.choice(chains)
        if rng.random() < 0.6:
            length = 0
            while length < 8 and key_of(length) in copies:
                length += 1
            first = rng.randrange(length + 1) if length < 8 else rng.randrange(8)
            num = rng.randrange(1, 9 - first)
            event = stored(first, num, tokens=tokens)
            event.block_hashes = [ehash(key_of(i)) for i in range(first, first + num)]
            event.parent_block_hash = ehash(key_of(first - 1)) if first else None
            copies.update(key_of(i) for i in range(first, first + num))
        else:
            extended = {parent_of[k] for k in copies if k in parent_of}
            leaves = sorted(k for k in copies if k not in extended)
            if not leaves:
                continue
            key = rng.choice(leaves)
            event = removed(key)
            copies[key] -= 1
            held[replica_id] = +copies
        index.apply(replica_id, [event])
        for tokens, key_of in chains:
            expected = {}
            for r, keys in held.items():
                n = 0
                while n < 8 and key_of(n) in keys:
                    n += 1
                if n:
                    expected[r] = n
            assert index.longest_prefix(request_hashes(tokens), 0.0) == expected


@pytest.mark.parametrize(
    "lengths",
    [[32] * 9, [16] * 5, [8], [4, 4], [16, 8, 24], [12] * 3, [40, 32], [33, 31]],
)
def test_engine_keys_are_the_low_64_bits_of_each_hash_whatever_the_lengths(lengths):
    # One length, a multiple of 8, reads the event as one array of words; anything else goes hash by hash
    # (16 + 8 + 24 bytes add up to three 16-byte hashes but must not be read as such).
    rng = random.Random(sum(lengths))
    hashes = [rng.randbytes(n) for n in lengths]
    expected = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]
    assert _engine_keys(hashes) == expected
    assert _engine_keys([int.from_bytes(h, "big") for h in hashes]) == expected  # hashes as ints


def test_a_pending_entry_on_a_held_block_goes_when_the_replica_drops_it(index):
    """A placement whose last block is off the grid is also pending at the grid checkpoint before it, even
    where the replica holds that block: no event confirms that entry, so the block's removal must take it,
    or the replica is credited with the prefix it no longer holds (until the entry expires, extended by
    every placement through it)."""
    system_prompt = list(range(1000, 1000 + 18 * BS))  # 18 blocks
    turn = system_prompt + list(range(5000, 5000 + 2 * BS))  # 20 blocks: the last, 19, is off the grid
    other = system_prompt + list(range(7000, 7000 + 3 * BS))
    turn_hashes, other_hashes = request_hashes(tokens=turn), request_hashes(tokens=other)
    index.apply(A, [stored(0, 18, tokens=turn)])
    index.add_pending(A, turn_hashes, 0.0, 2.0, num_held_blocks=18)
    index.apply(A, [stored(18, 2, tokens=turn, parent=17)])  # the turn's prefill: confirms its last block
    assert index.longest_prefix(other_hashes, 1.0) == {A: 18}
    index.apply(A, [BlockRemoved(block_hashes=[ehash(i) for i in reversed(range(20))], medium="GPU")])
    assert index.longest_prefix(other_hashes, 1.0) == {}
    assert index.snapshot(1.0).num_pending_blocks_by_replica.get(A, 0) == 0


def test_a_clear_drops_the_pending_entry_on_a_block_the_replica_held():
    """That entry (the grid checkpoint before an off-grid last) gets no event to confirm it: after a clear it
    credited the replica with a prefix its engine no longer held, as it would after removing the block."""
    tokens = list(range(45))
    index = PrefixIndex(1, 1000, "m")
    index.apply("A", [BlockStored(block_hashes=[i.to_bytes(32, "big") for i in range(41)], parent_block_hash=None,
                                  token_ids=tokens[:41], block_size=1, lora_id=None, medium="GPU", lora_name=None)])
    index.add_pending("A", hash_request_blocks(tokens, 1, root_hash("m", None)), now_s=0.0, ttl_s=2.0,
                      num_held_blocks=41)
    index.apply("A", [BlockStored(block_hashes=[i.to_bytes(32, "big") for i in range(41, 45)],
                                  parent_block_hash=(40).to_bytes(32, "big"), token_ids=tokens[41:45], block_size=1,
                                  lora_id=None, medium="GPU", lora_name=None)])
    index.apply("A", [AllBlocksCleared()])
    assert index.longest_prefix(hash_request_blocks(tokens[:40], 1, root_hash("m", None)), 1.0) == {}


# -- adoption: orphans whose parent a prompt placed here names ------------------------

JOINED_PROMPT = list(range(500, 548))  # 12 blocks: blocks 0-7 cached before the router joined, 8-11 a turn's new tail
JOINED_BRANCH = JOINED_PROMPT[:32] + list(range(900, 916))  # the same first 8 blocks, another tail


def _placed(index: PrefixIndex, replica: ReplicaId, tokens: list[int], now_s: float = 0.0,
            salt: str | None = None) -> RequestBlockHashes:
    blocks = RequestBlockHashes(tokens, BS, root_hash(MODEL, salt))
    index.note_placed_prompt(replica, blocks, now_s)
    return blocks


def test_an_orphan_continuing_a_prompt_placed_there_is_adopted_with_the_blocks_before_it(index):
    """The engine cached the shared head before the router joined (its history no longer held it): every block
    extending it arrived as an orphan, and the router stayed blind to that replica's prefixes for good."""
    _placed(index, A, JOINED_PROMPT)
    result = index.apply(A, [stored(8, 4, tokens=JOINED_PROMPT, parent=7, extra_keys=[None] * 4)])  # as vLLM sends
    assert (result.num_stored_blocks, result.num_orphaned_blocks) == (4, 0)
    assert index.longest_prefix(request_hashes(JOINED_PROMPT), 0.0) == {A: 12}
    assert index.longest_prefix(request_hashes(JOINED_BRANCH), 0.0) == {A: 8}  # the head, for the next session
    index.apply(A, [stored(12, 1, tokens=JOINED_PROMPT + [1, 2, 3, 4], parent=11)])  # decode chains on as usual
    assert index.longest_prefix(request_hashes(JOINED_PROMPT + [1, 2, 3, 4]), 0.0) == {A: 13}


def test_adopted_blocks_go_with_the_parent_they_were_adopted_with(index):
    """vLLM evicts a chain from its end: once the adopted parent goes, the index no longer knows the blocks
    before it are held (they may be; it forgets rather than invents)."""
    _placed(index, A, JOINED_PROMPT)
    _placed(index, A, JOINED_BRANCH)
    index.apply(A, [stored(8, 4, tokens=JOINED_PROMPT, parent=7)])
    index.apply(A, [stored(8, 4, tokens=JOINED_BRANCH, parent=7, block_hashes=[ehash(i) for i in range(20, 24)])])
    index.apply(A, [removed(11, 10, 9, 8)])
    assert index.longest_prefix(request_hashes(JOINED_BRANCH), 0.0) == {A: 12}  # its tail chained on the adopted parent
    index.apply(A, [removed(23, 22, 21, 20)])
    assert index.longest_prefix(request_hashes(JOINED_BRANCH), 0.0) == {A: 8}
    index.apply(A, [removed(7)])
    assert index.longest_prefix(request_hashes(JOINED_BRANCH), 0.0) == {}
    assert index._owners == {} and index.snapshot().num_blocks_by_replica.get(A, 0) == 0


@pytest.mark.parametrize("placements, event", [
    ([(B, JOINED_PROMPT)], stored(8, 4, tokens=JOINED_PROMPT, parent=7)),  # placed on another replica
    ([(A, JOINED_PROMPT)], stored(8, 1, tokens=JOINED_PROMPT, parent=7)),  # one block of a prompt going on: too little to tell
    ([(A, JOINED_PROMPT), (A, JOINED_PROMPT[:4] + JOINED_PROMPT[:28] + JOINED_PROMPT[32:])], stored(8, 4, tokens=JOINED_PROMPT, parent=7)),  # two parents
    ([], stored(8, 4, tokens=JOINED_PROMPT, parent=7)),
])
def test_an_orphan_no_single_placed_prompt_explains_stays_an_orphan(index, placements, event):
    for replica, tokens in placements:
        _placed(index, replica, tokens)
    result = index.apply(A, [event])
    assert (result.num_stored_blocks, result.num_orphaned_blocks) == (0, event_blocks := len(event.block_hashes))
    assert event_blocks and A not in index.longest_prefix(request_hashes(JOINED_PROMPT), 0.0)


@pytest.mark.parametrize("seed", range(30))
def test_adoption_never_credits_a_block_the_engine_does_not_hold(seed):
    """A router joining late: the engine holds a shared head and some branches it never saw stored. Prompts
    placed on the replica, the tails they store (orphans, adopted) and evictions from chains' ends in any
    order: a lookup never credits more than the engine holds, and after a prompt's tail is stored, exactly."""
    rng = random.Random(seed)
    index = PrefixIndex(BS, 1000, MODEL)
    head = list(range(2000, 2000 + 6 * BS))
    prompts = [head + list(range(3000 + 100 * b, 3000 + 100 * b + 4 * BS)) for b in range(4)]

    def key_of(prompt: int, i: int) -> int:
        return i if i < 6 else 1000 * (prompt + 1) + i

    held: set[int] = {key_of(0, i) for i in range(10)} | {key_of(1, i) for i in range(8)}  # before the router

    def held_prefix(prompt: int) -> int:
        n = 0
        while n < 10 and key_of(prompt, n) in held:
            n += 1
        return n

    for _ in range(60):
        prompt = rng.randrange(len(prompts))
        if rng.random() < 0.5:
            _placed(index, A, prompts[prompt])
            first = held_prefix(prompt)
            if first < 10:
                event = stored(first, 10 - first, tokens=prompts[prompt])
                event.block_hashes = [ehash(key_of(prompt, i)) for i in range(first, 10)]
                event.parent_block_hash = ehash(key_of(prompt, first - 1)) if first else None
                held.update(key_of(prompt, i) for i in range(first, 10))
                index.apply(A, [event])
            got = index.longest_prefix(request_hashes(prompts[prompt]), 0.0).get(A, 0)
            assert got == 10 or first >= 9, (got, first)  # a one-block orphan is not adopted
        else:
            extended = {key_of(p, i - 1) for p in range(len(prompts)) for i in range(1, 10) if key_of(p, i) in held}
            leaves = sorted(held - extended)
            if leaves:
                leaf = rng.choice(leaves)
                held.discard(leaf)
                index.apply(A, [removed(leaf)])
        for p in range(len(prompts)):
            assert index.longest_prefix(request_hashes(prompts[p]), 0.0).get(A, 0) <= held_prefix(p)


SYSTEM_4 = list(range(700, 716))  # 4 blocks cached before the router joined


def _tail_stored(tokens: list[int], first: int, num: int, keys: list[int], parent: int) -> BlockStored:
    return stored(first, num, tokens=tokens, parent=parent, block_hashes=[ehash(k) for k in keys],
                  extra_keys=[None] * num)


def test_a_stand_in_whose_block_becomes_an_adopted_parent_leaves_its_bit_to_the_engine_key(index):
    """A sibling branching off at a block the first adoption held as a stand-in: releasing the stand-in with the
    first parent dropped the bit the sibling's engine key still backed, a hole in the chain."""
    first = SYSTEM_4 + list(range(800, 812)) + [1]
    sibling = SYSTEM_4[:12] + list(range(900, 912)) + [1]
    _placed(index, A, first)
    index.apply(A, [_tail_stored(first, 4, 3, [40, 41, 42], parent=3)])  # parent: the system's block 3
    _placed(index, A, sibling)
    index.apply(A, [_tail_stored(sibling, 3, 3, [50, 51, 52], parent=2)])  # parent: block 2, held as a stand-in
    index.apply(A, [removed(42, 41, 40), removed(3)])  # the first session's chain goes, its end first
    assert index.longest_prefix(request_hashes(sibling), 0.0) == {A: 6}
    index.apply(A, [removed(52, 51, 50), removed(2)])
    assert index._owners == {} and index.snapshot().num_blocks_by_replica.get(A, 0) == 0


def test_adopted_blocks_confirm_the_placement_and_take_its_entries_along_when_they_go(index):
    """Pending entries on adopted blocks outlived their eviction by their TTL, crediting blocks the engine had
    dropped."""
    prompt = SYSTEM_4 + list(range(800, 812)) + [1]
    blocks = _placed(index, A, prompt)
    index.add_pending(A, blocks.hashes(), 0.0, 10.0)
    index.apply(A, [_tail_stored(prompt, 4, 3, [40, 41, 42], parent=3)])
    assert index.snapshot(0.0).num_pending_blocks_by_replica.get(A, 0) == 0
    index.apply(A, [removed(42, 41, 40, 3)])
    assert index.longest_prefix(request_hashes(prompt), 1.0) == {}


@pytest.mark.parametrize("case", ["salted", "withdrawn", "stale", "stale with no placement since"])
def test_a_prompt_that_cannot_explain_an_orphan_adopts_nothing(index, case):
    """A salt is in the engine's first block only (another tenant's orphan matches a salted prompt's tokens);
    a placement Serve sent elsewhere prefills nothing there; a placement long past, neither, also where this
    router placed nothing since (the window was measured from its newest placement, not from now)."""
    prompt = SYSTEM_4 + list(range(800, 812)) + [1]
    now_s = None
    if case == "salted":
        _placed(index, A, prompt, salt="tenant-1")
    elif case == "withdrawn":
        index.forget_placed_prompt(A, _placed(index, A, prompt))
    elif case == "stale":
        _placed(index, A, prompt, now_s=0.0)
        _placed(index, B, JOINED_PROMPT, now_s=31.0)
    else:
        _placed(index, A, prompt, now_s=0.0)
        now_s = 3600.0
    result = index.apply(A, [_tail_stored(prompt, 4, 3, [40, 41, 42], parent=3)], now_s)
    assert (result.num_stored_blocks, result.num_orphaned_blocks) == (0, 3)
