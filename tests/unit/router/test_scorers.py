"""router.scorers.* and router.registry: values in [0, 1], no state, strict keys."""

from __future__ import annotations

import pytest

from router.registry import SCORERS, build_weighted_scorers, lookup_scorer, register_scorer
from router.scorers import ScoringState
from router.scorers.load import LoadScorer
from router.scorers.prefix_cache import PrefixCacheScorer
from router.scorers.session_affinity import SessionAffinityScorer
from router.types import ReplicaId, ReplicaLoad, RoutingRequest

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
IDS = [A, B, C]
IDLE = {r: ReplicaLoad(0) for r in IDS}


def state(num_blocks=0, prefix=None, loads=None, sessions=None) -> ScoringState:
    return ScoringState(num_blocks, prefix or {}, loads or IDLE, sessions or {})


def request(session_id=None) -> RoutingRequest:
    return RoutingRequest([1, 2, 3], "m", session_id=session_id)


@pytest.mark.parametrize(
    ("num_blocks", "prefix", "expected"),
    [
        (0, {}, {}),
        (4, {}, {}),
        (4, {A: 4, B: 1}, {A: 1.0, B: 0.25}),
        (4, {A: 2, ReplicaId("not-a-candidate"): 4}, {A: 0.5}),
        (2, {A: 5}, {A: 1.0}),  # never above 1, even if handed an inconsistent count
    ],
)
def test_prefix_cache(num_blocks, prefix, expected):
    assert PrefixCacheScorer().score(request(), IDS, state(num_blocks, prefix)) == expected


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        (IDLE, {A: 1.0, B: 1.0, C: 1.0}),
        ({A: ReplicaLoad(1), B: ReplicaLoad(0), C: ReplicaLoad(0)}, {A: 0.75, B: 1.0, C: 1.0}),  # not the whole range
        ({A: ReplicaLoad(4), B: ReplicaLoad(2), C: ReplicaLoad(0)}, {A: 0.6, B: 0.8, C: 1.0}),
        ({A: ReplicaLoad(1, 3), B: ReplicaLoad(0, 2), C: ReplicaLoad(0)}, {A: 0.6, B: 0.8, C: 1.0}),
        (
            {A: ReplicaLoad(0, 0, 1.0), B: ReplicaLoad(0, 0, 0.5), C: ReplicaLoad(0)},
            {A: 0.5, B: 0.75, C: 1.0},
        ),
        ({A: ReplicaLoad(2, 0, 1.0), B: ReplicaLoad(2), C: ReplicaLoad(0)}, {A: 1 / 6, B: 2 / 3, C: 1.0}),
    ],
)
def test_load(loads, expected):
    assert LoadScorer().score(request(), IDS, state(loads=loads)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("session_id", "sessions", "expected"),
    [
        (None, {"s": A}, {}),
        ("s", {}, {}),
        ("s", {"s": B}, {B: 1.0}),
        ("s", {"s": ReplicaId("gone")}, {}),
        ("t", {"s": B}, {}),
    ],
)
def test_session_affinity(session_id, sessions, expected):
    assert SessionAffinityScorer().score(request(session_id), IDS, state(sessions=sessions)) == expected


@pytest.mark.parametrize("scorer", [PrefixCacheScorer(), LoadScorer(), SessionAffinityScorer()])
def test_scorers_stay_in_unit_interval_and_keep_no_state(scorer):
    st = state(3, {A: 3, B: 1}, {A: ReplicaLoad(9, 9, 1.0), B: ReplicaLoad(1), C: ReplicaLoad(0)}, {"s": A})
    first = scorer.score(request("s"), IDS, st)
    assert all(0.0 <= v <= 1.0 for v in first.values())
    assert scorer.score(request("s"), IDS, st) == first
    assert vars(scorer) == {}


@pytest.mark.parametrize("key", ["prefix-cache", "load", "session-affinity"])
def test_builtin_scorers_are_registered_under_their_names(key):
    assert lookup_scorer(key)().name == key


@pytest.mark.parametrize(
    ("key", "message"),
    [("load", "already registered"), ("Load_Scorer", "kebab-case")],
)
def test_register_rejects_duplicates_and_bad_keys(key, message):
    with pytest.raises(ValueError, match=message):
        register_scorer(key, LoadScorer)


def test_unknown_key_lists_known_keys():
    with pytest.raises(ValueError, match=r"known scorers: \['load', 'prefix-cache', 'session-affinity', 'session-balance'\]"):
        lookup_scorer("prefix-cahce")


@pytest.mark.parametrize(
    ("weights", "expected_names"),
    [
        ({"prefix-cache": 1.0, "load": 0.5}, ["prefix-cache", "load"]),
        ({"prefix-cache": 1.0, "load": 0.0}, ["prefix-cache"]),
        ({}, []),
    ],
)
def test_build_weighted_scorers(weights, expected_names):
    assert [s.name for s, _ in build_weighted_scorers(weights)] == expected_names


@pytest.mark.parametrize("weights", [{"nope": 0.0}, {"load": -1.0}, {"load": float("inf")}, {"load": float("nan")}])
def test_build_weighted_scorers_rejects_bad_entries(weights):
    with pytest.raises(ValueError):
        build_weighted_scorers(weights)


def test_registry_holds_exactly_the_builtins():
    assert sorted(SCORERS) == ["load", "prefix-cache", "session-affinity", "session-balance"]
