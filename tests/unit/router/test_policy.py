"""router.policy and router.load_guard: reasons, tier shape, pending bursts, sessions."""

from __future__ import annotations

import random

import pytest
from vllm.distributed.kv_events import BlockStored

from cluster.config import (
    MAX_LOAD_GUARD_FACTOR,
    MAX_ROUTER_SECONDS,
    MAX_SCORER_WEIGHT,
    MAX_TOKENS_PER_EXCESS_REQUEST,
    RouterConfig,
)
from router.hashing import hash_request_blocks, root_hash
from router.index import PrefixIndex
from router.load_guard import apply_load_guard, prefer_session_history
from router.policy import PrefixAwarePolicy
from router.types import ReplicaId, ReplicaLoad, RoutingRequest

BS = 4
MODEL = "warmpath-tiny"
A, B, C, D = (ReplicaId(x) for x in "abcd")
IDS = [A, B, C, D]
TOKENS = list(range(1000, 1032))  # 8 full blocks


def loads_of(*counts: int) -> dict[ReplicaId, ReplicaLoad]:
    return {r: ReplicaLoad(n) for r, n in zip(IDS, counts)}


def stored_prefix(num_blocks: int, tokens=TOKENS) -> BlockStored:
    return BlockStored(
        block_hashes=[i.to_bytes(32, "big") for i in range(num_blocks)],
        parent_block_hash=None,
        token_ids=tokens[: num_blocks * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def make_policy(seed: int = 0, **config) -> PrefixAwarePolicy:
    return PrefixAwarePolicy(RouterConfig(**config), BS, rng=random.Random(seed))


def make_index() -> PrefixIndex:
    return PrefixIndex(BS, 10_000, MODEL)


# -- load guard ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "factor", "expected_removed"),
    [
        ((0, 0, 0, 0), 1.5, []),
        ((10, 0, 0, 0), 1.5, [A]),
        ((1, 0), 1.5, []),  # one busy replica out of two: not an imbalance worth acting on
        ((2, 0), 1.5, []),
        ((3, 0), 1.5, [A]),
        ((5, 5, 5, 5), 1.5, []),
        ((9, 9, 0, 0), 1.5, [A, B]),
        ((9, 9, 0, 0), 4.0, []),
    ],
)
def test_load_guard(counts, factor, expected_removed):
    ids = IDS[: len(counts)]
    kept, removed = apply_load_guard(ids, loads_of(*counts), factor)
    assert removed == expected_removed
    assert kept == [r for r in ids if r not in expected_removed]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("factor", [1.01, 1.5, 3.0])
def test_load_guard_never_removes_every_replica(seed, factor):
    rng = random.Random(seed)
    ids = [ReplicaId(f"r{i}") for i in range(rng.randint(1, 16))]
    loads = {r: ReplicaLoad(rng.choice([0, 1, 2, 50, 1000])) for r in ids}
    kept, removed = apply_load_guard(ids, loads, factor)
    assert kept
    assert min(loads[r].num_requests for r in ids) in {loads[r].num_requests for r in kept}
    assert sorted(kept + removed) == sorted(ids)


@pytest.mark.parametrize(
    ("counts", "min_requests", "expected_removed"),
    [
        ((1, 0, 0, 0), 1, [A]),  # 4 replicas: one running a single request is over 1.5x the mean
        ((1, 0, 0, 0), 2, []),  # ... but may hold 2 when the floor is 2
        ((2, 0, 0, 0), 2, [A]),
        ((3, 0), 4, []),
    ],
)
def test_load_guard_floor(counts, min_requests, expected_removed):
    ids = IDS[: len(counts)]
    _, removed = apply_load_guard(ids, loads_of(*counts), 1.5, min_requests)
    assert removed == expected_removed


@pytest.mark.parametrize(
    ("counts", "cached", "session_replica", "tokens_per_request", "expected_removed"),
    [
        ((3, 0), {A: 2000}, A, 512.0, []),  # one request over the limit; 2000 tokens of history outweigh it
        ((3, 0), {A: 2000}, A, None, [A]),  # the count-only rule
        ((3, 0), {A: 2000}, None, 512.0, [A]),  # no session: a shared prefix is worth copying elsewhere
        ((3, 0), {A: 2000}, B, 512.0, [A]),  # the session is on B already
        ((3, 0), {A: 2000, B: 1600}, A, 512.0, [A]),  # B holds most of it too: a move recomputes only 400
        ((3, 0), {A: 500}, A, 512.0, [A]),
        ((3, 0), {A: 512}, A, 512.0, [A]),  # saving exactly the excess is not worth a pile-up
        ((12, 0), {A: 2000}, A, 512.0, []),  # limit 10: three over, worth 1536 tokens < 2000 saved
        ((20, 0), {A: 2000}, A, 512.0, [A]),  # limit 16: five over, worth 2560 tokens > 2000 saved
        ((10, 10, 0, 0), {A: 100, B: 4000}, A, 512.0, [A, B]),  # only the session's replica may come back
        ((3, 0), {A: 2000}, A, 0.0, []),  # 0: an excess request is worth nothing, any saving keeps A
        ((0, 3), {B: 2000}, ReplicaId("gone"), 512.0, [B]),  # the session's replica is not a candidate
    ],
)
def test_load_guard_keeps_a_session_whose_history_outweighs_the_excess_load(
    counts, cached, session_replica, tokens_per_request, expected_removed
):
    ids = IDS[: len(counts)]
    kept, removed = apply_load_guard(ids, loads_of(*counts), 1.5, 2, cached, tokens_per_request, session_replica)
    assert removed == expected_removed
    assert kept == [r for r in ids if r not in expected_removed]


def test_load_guard_factor_must_exceed_one():
    with pytest.raises(ValueError):
        apply_load_guard(IDS, loads_of(0, 0, 0, 0), 1.0)


@pytest.mark.parametrize("factor", [float("inf"), 1e308, float("nan")])
def test_a_factor_with_no_finite_limit_removes_nobody(factor):
    assert apply_load_guard(IDS, loads_of(0, 3, 9, 1), factor) == (IDS, [])


@pytest.mark.parametrize(
    "config",
    [
        {"load_guard_factor": MAX_LOAD_GUARD_FACTOR},
        {"scorer_weights": dict.fromkeys(["prefix-cache", "load", "session-affinity", "session-balance"],
                                         MAX_SCORER_WEIGHT)},
        {"pending_ttl_s": MAX_ROUTER_SECONDS, "session_idle_s": MAX_ROUTER_SECONDS,
         "load_guard_tokens_per_excess_request": MAX_TOKENS_PER_EXCESS_REQUEST},
    ],
    ids=["largest-factor", "largest-weights", "longest-times"],
)
def test_the_largest_values_the_config_accepts_still_decide(config):
    policy = PrefixAwarePolicy(RouterConfig(**config), BS, random.Random(0))
    decision = policy.choose(RoutingRequest(TOKENS, MODEL, "s"), IDS, loads_of(0, 3, 9, 1), PrefixIndex(BS, 100, MODEL),
                             {}, 0.0)
    assert decision.replica_id in IDS


# -- reasons --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cached_on", "counts", "sessions", "expected_choice", "expected_reason"),
    [
        ({}, (0, 0, 0, 0), {}, None, "cold"),
        ({}, (1, 1, 0, 1), {}, C, "cold"),
        ({A: 8}, (0, 0, 0, 0), {}, A, "prefix-hit"),
        ({A: 8, B: 3}, (1, 1, 1, 0), {}, A, "prefix-hit"),
        ({A: 8}, (2, 0, 0, 0), {}, None, "load-guard"),  # 3 of 3 requests is over 1.5x the mean and the floor of 2
        ({}, (0, 0, 0, 0), {"s": B}, B, "session-affinity"),
        ({A: 8}, (0, 0, 0, 0), {"s": B}, A, "prefix-hit"),
        ({A: 8}, (10, 0, 0, 0), {}, None, "load-guard"),
        ({A: 8, B: 2}, (10, 0, 0, 0), {}, B, "load-guard"),  # a partial hit, but the best was guarded
        ({A: 1}, (2, 2, 1, 1), {}, None, "least-loaded"),  # a 1/8 hit loses to load
        ({}, (0, 10, 0, 0), {"s": B}, None, "least-loaded"),  # the session's replica was guarded
        ({}, (0, 0, 0, 0), {"s": ReplicaId("gone")}, None, "cold"),
        # Only a replica that is not a candidate (draining, say) holds the prefix: nothing is known.
        ({ReplicaId("gone"): 8}, (0, 0, 0, 0), {}, None, "cold"),
    ],
)
def test_reasons(cached_on, counts, sessions, expected_choice, expected_reason):
    index = make_index()
    for replica_id, num_blocks in cached_on.items():
        index.apply(replica_id, [stored_prefix(num_blocks)])
    policy = make_policy()
    for session_id, replica_id in sessions.items():
        policy._activity.touch(session_id, replica_id, 0.0)  # its last request, just now
    decision = policy.choose(
        RoutingRequest(TOKENS, MODEL, session_id="s"), IDS, loads_of(*counts), index, dict(sessions), 0.0
    )
    assert decision.reason == expected_reason
    if expected_choice is not None:
        assert decision.replica_id == expected_choice
    if expected_reason == "load-guard":
        assert A in decision.ranked_tiers[-1]  # the guarded prefix holder stays a last resort


@pytest.mark.parametrize(
    ("tokens_per_request", "session_on", "expected_reason"),
    [
        (16.0, A, "prefix-hit"),
        # A holds all 32 tokens, but vLLM computes the last one: 28 saved, fewer than 30 asked for.
        (30.0, A, "load-guard"),
        (32.0, A, "load-guard"),
        (None, A, "load-guard"),
        (16.0, None, "load-guard"),
    ],
)
def test_the_policy_weighs_the_sessions_history_against_the_excess_load(tokens_per_request, session_on,
                                                                        expected_reason):
    index = make_index()
    index.apply(A, [stored_prefix(8)])  # 32 tokens on A, which is one request over the limit of 2
    sessions = {"s": session_on} if session_on else {}
    policy = make_policy(load_guard_tokens_per_excess_request=tokens_per_request)
    decision = policy.choose(RoutingRequest(TOKENS, MODEL, "s"), IDS, loads_of(2, 0, 0, 0), index, sessions, 0.0)
    assert decision.reason == expected_reason
    assert (decision.replica_id == A) == (expected_reason == "prefix-hit")


def test_tiers_put_the_choice_alone_first_and_guarded_replicas_last():
    index = make_index()
    decision = make_policy().choose(
        RoutingRequest(TOKENS, MODEL), IDS, loads_of(0, 0, 20, 30), index, {}, 0.0
    )
    assert len(decision.ranked_tiers[0]) == 1
    assert decision.ranked_tiers[-1] == [C, D]  # removed by the guard, least loaded first
    flat = [r for tier in decision.ranked_tiers for r in tier]
    assert sorted(flat) == sorted(IDS)
    assert set(decision.predicted_cached_tokens) == set(IDS)


@pytest.mark.parametrize(
    ("num_tokens", "cached_blocks", "expected_tokens"),
    [
        (32, 8, 28),  # vLLM recomputes the last token: 7 usable blocks of 8
        (33, 8, 32),
        (32, 3, 12),
        (3, 0, 0),
    ],
)
def test_predicted_cached_tokens(num_tokens, cached_blocks, expected_tokens):
    index = make_index()
    if cached_blocks:
        index.apply(A, [stored_prefix(cached_blocks)])
    tokens = (TOKENS + [7])[:num_tokens]
    decision = make_policy().choose(RoutingRequest(tokens, MODEL), IDS, loads_of(0, 0, 0, 0), index, {}, 0.0)
    assert decision.predicted_cached_tokens[A if cached_blocks else decision.replica_id] == expected_tokens


def test_holding_the_last_block_of_a_prompt_that_fills_it_earns_nothing():
    """vLLM computes the prompt's last token, so that block is computed again wherever it is cached."""
    index = make_index()
    index.apply(A, [stored_prefix(8)])  # the whole 32-token prompt
    index.apply(B, [stored_prefix(7)])  # all but its last block: the same 28 reusable tokens
    loads = {A: ReplicaLoad(0, kv_cache_usage=0.1), B: ReplicaLoad(0)}
    decision = make_policy().choose(RoutingRequest(TOKENS, MODEL), [A, B], loads, index, {}, 0.0)
    assert decision.predicted_cached_tokens == {A: 28, B: 28}
    assert (decision.replica_id, decision.reason) == (B, "prefix-hit")  # the emptier cache, for the same hit


def test_a_prompt_of_one_full_block_is_cold_everywhere():
    index = make_index()
    index.apply(A, [stored_prefix(1)])
    decision = make_policy().choose(RoutingRequest(TOKENS[:BS], MODEL), [A, B], loads_of(1, 0), index, {}, 0.0)
    assert (decision.replica_id, decision.reason) == (B, "cold")  # not behind A's request for nothing
    assert decision.predicted_cached_tokens == {A: 0, B: 0}


# -- recording ------------------------------------------------------------------


def test_a_burst_of_one_new_prefix_follows_the_first_decision():
    index, sessions, policy = make_index(), {}, make_policy(seed=3)
    idle = loads_of(0, 0, 0, 0)
    first = policy.choose(RoutingRequest(TOKENS, MODEL, "s1"), IDS, idle, index, sessions, 0.0)
    assert first.reason == "cold"
    # 2.5 is past the first placement's expiry (2.0): each follower's placement extends the pending entries.
    for i, now_s in enumerate([0.1, 0.5, 1.9, 2.5]):
        follower = policy.choose(RoutingRequest(TOKENS, MODEL, f"t{i}"), IDS, idle, index, sessions, now_s)
        assert (follower.replica_id, follower.reason) == (first.replica_id, "prefix-hit")
    # Pending entries expire pending_ttl_s (2.0 s) after the last placement.
    late = policy.choose(RoutingRequest(TOKENS, MODEL, "u"), IDS, idle, index, sessions, 10.0)
    assert late.reason == "cold"


def test_choose_records_the_session_and_record_corrects_a_fallback():
    index, sessions, policy = make_index(), {}, make_policy()
    decision = policy.choose(RoutingRequest(TOKENS, MODEL, "s"), IDS, loads_of(0, 0, 0, 0), index, sessions, 0.0)
    assert sessions == {"s": decision.replica_id}
    fallback = next(r for r in IDS if r != decision.replica_id)
    policy.record(decision, fallback, index, sessions, 0.1)
    assert sessions == {"s": fallback}
    assert index.snapshot(0.2).num_pending_blocks_by_replica[fallback] == 8


def test_session_turns_reuse_hashes_and_match_a_fresh_hash():
    index, sessions, policy = make_index(), {}, make_policy()
    idle = loads_of(0, 0, 0, 0)
    turn1 = policy.choose(RoutingRequest(TOKENS[:20], MODEL, "s"), IDS, idle, index, sessions, 0.0)
    turn2 = policy.choose(RoutingRequest(TOKENS, MODEL, "s"), IDS, idle, index, sessions, 0.5)
    assert turn2.request_blocks.hashes() == hash_request_blocks(TOKENS, BS, root_hash(MODEL, None))
    assert (turn2.replica_id, turn2.reason) == (turn1.replica_id, "prefix-hit")
    assert turn2.predicted_cached_tokens[turn1.replica_id] == 20


@pytest.mark.parametrize(
    ("candidates", "loads"),
    [([], {}), ([A, B], {A: ReplicaLoad(0)})],
)
def test_bad_inputs_raise(candidates, loads):
    with pytest.raises(ValueError):
        make_policy().choose(RoutingRequest(TOKENS, MODEL), candidates, loads, make_index(), {}, 0.0)


def test_unknown_scorer_in_config_raises():
    with pytest.raises(ValueError, match="unknown scorer"):
        make_policy(scorer_weights={"prefix-cache": 1.0, "lod": 1.0})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decisions_are_reproducible_with_a_seed(seed):
    def run():
        index, sessions, policy = make_index(), {}, make_policy(seed=seed)
        return [
            policy.choose(
                RoutingRequest([i] * 8, MODEL, f"s{i}"), IDS, loads_of(0, 0, 0, 0), index, sessions, 0.0
            ).ranked_tiers
            for i in range(6)
        ]

    assert run() == run()


@pytest.mark.parametrize("seed", range(5))
def test_new_sessions_spread_over_replicas_holding_their_prefix_by_active_sessions(seed):
    # Every replica caches the shared system prompt (6 blocks) and no request is in flight:
    # only the sessions each replica already holds tell the replicas apart.
    index, sessions, policy = make_index(), {}, make_policy(seed=seed)
    for replica_id in IDS:
        index.apply(replica_id, [stored_prefix(6)])
    for i in range(8):
        prompt = TOKENS[:24] + [5000 + i] * 8
        policy.choose(RoutingRequest(prompt, MODEL, f"s{i}"), IDS, loads_of(0, 0, 0, 0), index, sessions, 0.1 * i)
    assert sorted(list(sessions.values()).count(r) for r in IDS) == [2, 2, 2, 2]


def test_active_sessions_count_each_session_on_its_last_replica_until_it_idles():
    index, sessions = make_index(), {}
    policy = make_policy(session_idle_s=10.0)
    for session_id, replica_id, now_s in [("s1", A, 0.0), ("s2", B, 1.0), ("s1", B, 2.0), ("s3", A, 5.0)]:
        decision = policy.choose(RoutingRequest(TOKENS, MODEL, session_id), [A, B], loads_of(0, 0), index, sessions, now_s)
        policy.record(decision, replica_id, index, sessions, now_s)
    assert policy.active_sessions(5.0) == {A: 1, B: 2}
    assert policy.active_sessions(11.5) == {A: 1, B: 1}  # s2 idle for 10.5 s
    assert policy.active_sessions(20.0) == {} and len(sessions) == 3  # idle sessions are still remembered


def test_a_returning_session_is_not_counted_against_its_own_replica():
    # A holds s1 and s3, B holds s2: moving s1 would leave one session on each side either
    # way, so session-balance must not prefer B for s1's next turn (it would, counting s1).
    index, sessions = make_index(), {}
    policy = make_policy(scorer_weights={"session-balance": 1.0})
    for session_id, replica_id in [("s1", A), ("s3", A), ("s2", B)]:
        decision = policy.choose(RoutingRequest(TOKENS, MODEL, session_id), [A, B], loads_of(0, 0), index, sessions, 0.0)
        policy.record(decision, replica_id, index, sessions, 0.0)
    returning = policy.choose(RoutingRequest(TOKENS, MODEL, "s1"), [A, B], loads_of(0, 0), index, sessions, 1.0)
    assert returning.scores[A] == pytest.approx(returning.scores[B])
    policy.record(returning, A, index, sessions, 1.0)  # the tie may have been broken either way
    new = policy.choose(RoutingRequest(TOKENS, MODEL, "s4"), [A, B], loads_of(0, 0), index, sessions, 1.0)
    assert new.scores[B] > new.scores[A]  # a new session still sees A's two sessions


@pytest.mark.parametrize("seed", range(5))
def test_a_fully_cached_prompt_waits_behind_one_request_rather_than_being_recomputed(seed):
    # Default weights (load counts double): one request in flight on the replica holding the
    # whole prompt must not outweigh recomputing all of it on an idle replica.
    index, sessions, policy = make_index(), {}, make_policy(seed=seed)
    index.apply(A, [stored_prefix(8)])
    decision = policy.choose(RoutingRequest(TOKENS, MODEL), [A, B], loads_of(1, 0), index, sessions, 0.0)
    assert decision.replica_id == A
    assert decision.reason == "prefix-hit"


def test_a_fully_cached_prompt_of_no_session_waits_behind_a_sessions_request():
    """The request in flight on the replica holding the whole prompt is a session's (as nearly every one is): its
    session counted against that replica, as many sessions as the other held, and the prompt was recomputed."""
    index, sessions, policy = make_index(), {}, make_policy(seed=0)
    index.apply(A, [stored_prefix(8)])
    first = policy.choose(RoutingRequest(TOKENS, MODEL, session_id="s1"), [A, B], loads_of(0, 0), index, sessions, 0.0)
    assert first.replica_id == A
    for seed in range(20):
        policy = make_policy(seed=seed)
        policy._activity.touch("s1", A, 0.0)
        decision = policy.choose(RoutingRequest(TOKENS, MODEL), [A, B], loads_of(1, 0), index, {"s1": A}, 0.5)
        assert (decision.replica_id, decision.reason) == (A, "prefix-hit")


def test_session_affinity_ends_when_the_session_goes_idle():
    """Affinity bridges the events' lag behind a session's last request: once it has been idle for
    `session_idle_s`, its old replica, busy and holding no more of it than an idle one, drew it back regardless."""
    index, policy = make_index(), make_policy(seed=0)
    for replica_id in (A, B):
        index.apply(replica_id, [stored_prefix(2)])  # the shared prompt only: the session's history is gone
    for now_s, expected in ((1.0, A), (121.0, B)):
        policy = make_policy(seed=0)
        policy._activity.touch("s", A, 0.0)
        decision = policy.choose(RoutingRequest(TOKENS, MODEL, session_id="s"), [A, B], loads_of(1, 0), index,
                                 {"s": A}, now_s)
        assert decision.replica_id == expected, now_s


# -- a long prefix against load -----------------------------------------------------

LONG_BS = 16
SYSTEM = list(range(1000, 1000 + 2048))  # the prefix every replica holds


def _long_stored(tokens: list[int]) -> BlockStored:
    num_blocks = len(tokens) // LONG_BS
    return BlockStored(
        block_hashes=[(i + 1).to_bytes(32, "big") for i in range(num_blocks)], parent_block_hash=None,
        token_ids=tokens[: num_blocks * LONG_BS], block_size=LONG_BS, lora_id=None, medium="GPU", lora_name=None,
    )


def _choose_after_history(history_tokens: int, seed: int, kv_cache_usage: float = 0.5, **config):
    """A session whose system prompt plus `history_tokens` of its own are cached on A (6 requests in flight, its
    KV cache `kv_cache_usage` full, 19 other active sessions); B, C, D hold the system prompt only, B idle and
    just added (no sessions), C and D as busy as A. Below the load guard's limit."""
    policy = PrefixAwarePolicy(RouterConfig(**config), LONG_BS, rng=random.Random(seed))
    for replica, num_sessions in ((A, 19), (C, 20), (D, 20)):
        for i in range(num_sessions):
            policy._activity.touch(f"{replica}-{i}", replica, 0.0)  # sessions waiting on their tools
    index, sessions = PrefixIndex(LONG_BS, 100_000, MODEL), {"s": A}
    history = SYSTEM + [7 + i % 5000 for i in range(history_tokens)]
    index.apply(A, [_long_stored(history)])
    for replica in (B, C, D):
        index.apply(replica, [_long_stored(SYSTEM)])
    loads = {A: ReplicaLoad(6, kv_cache_usage=kv_cache_usage), B: ReplicaLoad(0),
             C: ReplicaLoad(6, kv_cache_usage=kv_cache_usage), D: ReplicaLoad(6, kv_cache_usage=kv_cache_usage)}
    assert apply_load_guard(IDS, loads, 1.5, 2)[1] == []
    return policy.choose(RoutingRequest(history + [9] * 40, MODEL, "s"), IDS, loads, index, sessions, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_a_long_history_stays_where_it_is_cached_however_idle_another_replica_is(seed):
    """The scorers alone (a prefix as a fraction of the prompt, load as a share of the busiest) moved a
    60,000-token history to the idle replica as readily as a 600-token one: a whole prefill to skip a queue."""
    decision = _choose_after_history(60_000, seed)
    assert (decision.replica_id, decision.reason) == (A, "prefix-hit")
    assert decision.ranked_tiers[0] == [A] and B in decision.ranked_tiers[1]
    assert sorted(r for tier in decision.ranked_tiers for r in tier) == sorted(IDS)


@pytest.mark.parametrize("seed", range(5))
def test_a_short_history_still_moves_to_an_idle_replica(seed):
    """600 tokens of history are worth less than six requests of queue at the guard's 512 tokens a request."""
    assert _choose_after_history(600, seed).replica_id == B


def test_without_a_token_rate_the_scorers_decide():
    assert _choose_after_history(60_000, 0, load_guard_tokens_per_excess_request=None).replica_id == B


@pytest.mark.parametrize(
    ("cached", "counts", "expected"),
    [
        ({A: 60_000, B: 2_048}, (6, 0), A),  # 57,952 tokens saved, worth more than 6 requests
        ({A: 4_000, B: 2_048}, (6, 0), B),  # 1,952 tokens saved, worth less than 6 requests (3,072)
        ({A: 2_400, B: 2_048}, (0, 0), B),  # equal load: 352 tokens more is less than one request's worth
        ({A: 2_600, B: 2_048}, (0, 0), A),  # equal load: 552 tokens more is more than one request's worth
        ({A: 60_000}, (6, 0), A),
        ({}, (6, 0), B),
    ],
)
def test_prefer_session_history_prices_load_at_the_guards_rate(cached, counts, expected):
    assert prefer_session_history(B, A, loads_of(*counts), cached, 512.0) == expected


def test_only_the_sessions_replica_outranks_the_scorers():
    """A prefix many requests share is the scorers' to spread: no session, or another replica holding more,
    leaves their choice standing."""
    loads = loads_of(0, 0, 0)
    assert prefer_session_history(B, None, loads, {A: 60_000}, 512.0) == B
    assert prefer_session_history(B, C, loads, {A: 60_000, B: 2_048, C: 2_048}, 512.0) == B
    assert prefer_session_history(B, A, loads, {A: 60_000}, None) == B


@pytest.mark.parametrize("seed", range(5))
def test_new_sessions_sharing_a_long_prefix_still_spread(seed):
    """A shared prefix cached on one replica does not pull every new session there (the scorers copy it)."""
    policy = PrefixAwarePolicy(RouterConfig(), LONG_BS, rng=random.Random(seed))
    index = PrefixIndex(LONG_BS, 100_000, MODEL)
    index.apply(A, [_long_stored(SYSTEM)])
    loads = {A: ReplicaLoad(3), B: ReplicaLoad(0), C: ReplicaLoad(0), D: ReplicaLoad(0)}
    decision = policy.choose(RoutingRequest(SYSTEM + [9] * 40, MODEL, f"new-{seed}"), IDS, loads, index, {}, 0.0)
    assert decision.replica_id != A
