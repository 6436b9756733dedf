"""Turns per-scorer scores into ranked tiers of replicas.

Steps: clamp every score to [0, 1] (NaN counts as 0), sum by weight, shuffle
the replicas, then stable-sort by total, highest first. The shuffle breaks ties
fairly across decisions; the stable sort keeps the shuffled order inside a tie.
Replicas whose totals are equal (to 9 decimal places) share a tier, in that
shuffled order.

Invariants: every replica passed in appears in exactly one tier; tiers are
non-empty and in strictly decreasing total order. With a seeded `random.Random`
the result is deterministic.
"""

from __future__ import annotations

import random
from typing import Mapping, Sequence

from router.types import ReplicaId

_TIE_DIGITS = 9


def clamp_score(value: float) -> float:
    """`value` limited to [0, 1]; NaN becomes 0 (`not value > 0` is true for NaN)."""
    if not value > 0.0:
        return 0.0
    return 1.0 if value > 1.0 else value


def total_scores(
    replica_ids: Sequence[ReplicaId], weighted: Sequence[tuple[float, Mapping[ReplicaId, float]]]
) -> dict[ReplicaId, float]:
    """Weighted sum of clamped scores per replica.

    Args:
        replica_ids: the replicas to total (others in the score maps are ignored).
        weighted: (weight, scores) per scorer; a replica missing from a map scores 0 there.

    Returns:
        Replica -> total, for every replica in `replica_ids`.
    """
    totals = dict.fromkeys(replica_ids, 0.0)
    for weight, scores in weighted:
        for replica_id, value in scores.items():
            if replica_id in totals:
                totals[replica_id] += weight * clamp_score(value)
    return totals


def rank_tiers(totals: Mapping[ReplicaId, float], rng: random.Random) -> list[list[ReplicaId]]:
    """Replicas grouped into tiers of equal total, best tier first.

    The shuffle is done by giving every replica a random key and sorting on
    (total, key): the same uniform order inside a tie as `rng.shuffle` followed
    by a stable sort, without `random.shuffle`'s Python-level call per item.

    Args:
        totals: replica -> total score.
        rng: source of the tie-breaking keys (seed it in tests).

    Returns:
        Ranked tiers; empty if `totals` is empty.
    """
    draw = rng.random
    keyed = sorted(((round(total, _TIE_DIGITS), draw(), r) for r, total in totals.items()), reverse=True)
    tiers: list[list[ReplicaId]] = []
    previous: float | None = None
    for key, _, replica_id in keyed:
        if key != previous:
            tiers.append([])
            previous = key
        tiers[-1].append(replica_id)
    return tiers
