"""router.picker: clamping, weighted totals, tiers and seeded tie-breaking."""

from __future__ import annotations

import math
import random

import pytest

from router.picker import rank_tiers, total_scores
from router.types import ReplicaId

A, B, C, D = (ReplicaId(x) for x in "abcd")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(-0.5, 0.0), (0.0, 0.0), (0.25, 0.25), (1.0, 1.0), (7.0, 1.0), (math.nan, 0.0), (math.inf, 1.0)],
)
def test_each_score_is_clamped_before_weighting(value, expected):
    assert total_scores([A], [(2.0, {A: value})]) == {A: 2.0 * expected}


@pytest.mark.parametrize(
    ("weighted", "expected"),
    [
        ([], {A: 0.0, B: 0.0}),
        ([(1.0, {A: 0.5})], {A: 0.5, B: 0.0}),
        ([(2.0, {A: 0.5, B: 3.0}), (1.0, {B: -1.0})], {A: 1.0, B: 2.0}),
        ([(1.0, {A: 1.0, ReplicaId("other"): 1.0})], {A: 1.0, B: 0.0}),
    ],
)
def test_total_scores(weighted, expected):
    assert total_scores([A, B], weighted) == expected


@pytest.mark.parametrize(
    ("totals", "expected_tier_sets"),
    [
        ({}, []),
        ({A: 1.0}, [{A}]),
        ({A: 1.0, B: 2.0, C: 0.5}, [{B}, {A}, {C}]),
        ({A: 1.0, B: 1.0, C: 0.5, D: 1.0}, [{A, B, D}, {C}]),
        ({A: 0.1 + 0.2, B: 0.3}, [{A, B}]),  # float noise is still a tie
    ],
)
def test_rank_tiers_groups_equal_totals(totals, expected_tier_sets):
    tiers = rank_tiers(totals, random.Random(0))
    assert [set(t) for t in tiers] == expected_tier_sets
    assert sorted(r for t in tiers for r in t) == sorted(totals)


@pytest.mark.parametrize("seed", [0, 1, 42])
def test_tie_breaking_is_deterministic_for_a_seed(seed):
    totals = {ReplicaId(f"r{i}"): 1.0 for i in range(8)}
    assert rank_tiers(totals, random.Random(seed)) == rank_tiers(totals, random.Random(seed))


def test_tie_breaking_spreads_first_place():
    totals = {A: 1.0, B: 1.0, C: 1.0, D: 0.0}
    rng = random.Random(7)
    firsts = {rank_tiers(totals, rng)[0][0] for _ in range(200)}
    assert firsts == {A, B, C}
