"""Turns per-scorer scores into ranked tiers of replicas.

Steps: clamp every score to [0, 1] (NaN counts as 0), sum by weight, shuffle
the replicas, then stable-sort by total, highest first. The shuffle breaks ties
fairly across decisions; the stable sort keeps the shuffled order inside a tie.
Replicas whose totals are equal to 9 decimal places (the same nearest multiple
of 1e-9) share a tier, in that shuffled order.

Invariants: every replica passed in appears in exactly one tier; tiers are
non-empty and in strictly decreasing total order. With a seeded `random.Random`
the result is deterministic.
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Sequence

from router.types import ReplicaId

# Totals are compared as whole multiples of 1e-9 (`round(total, 9)` costs four times as much).
_TIE_SCALE = 1e9


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
                # Clamped to [0, 1] inline (NaN: `not value > 0`), as this runs for every candidate.
                totals[replica_id] += weight * ((1.0 if value > 1.0 else value) if value > 0.0 else 0.0)
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
    draw, floor = rng.random, math.floor
    keyed = sorted([(floor(total * _TIE_SCALE + 0.5), draw(), r) for r, total in totals.items()], reverse=True)
    tiers: list[list[ReplicaId]] = []
    previous: float | None = None
    for key, _, replica_id in keyed:
        if key != previous:
            tiers.append([])
            previous = key
        tiers[-1].append(replica_id)
    return tiers
