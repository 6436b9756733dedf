"""Load guard: no replica takes more than `load_guard_factor` times the mean load.

Why: prefix affinity concentrates traffic. A hot prefix (one system prompt for
every agent) would otherwise pile every request onto the replica that cached
it first; past some imbalance recomputing the prefix elsewhere is cheaper than
queueing.

Rule, counting the request being routed (loads are whole requests):
    mean_after = (sum of num_requests + 1) / number of replicas
    limit      = max(ceil(load_guard_factor * mean_after), min_requests)
    a replica passes iff its num_requests + 1 <= limit
Rounding the limit up keeps the guard from firing on tiny imbalances (one busy
replica out of two); `min_requests` keeps it from firing at all while every
replica is nearly idle, where a cache miss costs more than a short queue.

Invariant: never removes every replica. The least-loaded replica holds at most
floor(mean) requests, and factor > 1 makes limit >= floor(mean) + 1, so it
always passes; an explicit check keeps the promise even for odd inputs.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from router.types import ReplicaId, ReplicaLoad


def apply_load_guard(
    replica_ids: Sequence[ReplicaId],
    loads: Mapping[ReplicaId, ReplicaLoad],
    load_guard_factor: float,
    min_requests: int = 1,
) -> tuple[list[ReplicaId], list[ReplicaId]]:
    """Splits candidates into those under the limit and those over it.

    Args:
        replica_ids: candidates; each must have an entry in `loads`.
        loads: current load per replica.
        load_guard_factor: multiple of the mean load allowed (> 1).
        min_requests: a replica may always hold this many requests, this one included.

    Returns:
        (kept, removed), each in the input order; `kept` is non-empty when
        `replica_ids` is.
    """
    if load_guard_factor <= 1.0:
        raise ValueError(f"load_guard_factor must be > 1, got {load_guard_factor}")
    if not replica_ids:
        return [], []
    counts = [loads[r].num_requests for r in replica_ids]
    mean_after = (sum(counts) + 1) / len(counts)
    # The epsilon keeps float noise (1.1 * 10 = 11.000000000000002) from adding a request.
    limit = max(math.ceil(load_guard_factor * mean_after - 1e-9), min_requests)
    kept = [r for r, n in zip(replica_ids, counts) if n + 1 <= limit]
    if not kept:
        lightest = min(counts)
        kept = [r for r, n in zip(replica_ids, counts) if n == lightest]
    kept_set = set(kept)
    return kept, [r for r in replica_ids if r not in kept_set]
