"""The "load" scorer: prefer replicas with fewer requests and free KV cache.

Score = 1 - (request_share + kv_cache_usage) / 2, where request_share is the
replica's running plus queued requests divided by the largest such count among
the candidates (0 when every candidate is idle). Relative, because Ray Serve's
routing stats give counts but the router is not told each replica's capacity;
kv_cache_usage is already a fraction of capacity. Values lie in [0, 1]. The
hard limit on load is `router.load_guard`; this only ranks.
"""

from __future__ import annotations

from typing import Sequence

from router.scorers import ScoringState
from router.types import ReplicaId, RoutingRequest


class LoadScorer:
    name = "load"

    def score(
        self, request: RoutingRequest, replica_ids: Sequence[ReplicaId], state: ScoringState
    ) -> dict[ReplicaId, float]:
        """One minus the normalised load of each candidate.

        Args:
            request: unused.
            replica_ids: candidates; each must have an entry in `state.loads`.
            state: `loads` is read.

        Returns:
            Replica -> score for every candidate.
        """
        loads = state.loads
        max_requests = max((loads[r].num_requests for r in replica_ids), default=0)
        scale = 1.0 / max_requests if max_requests else 0.0
        return {
            r: 1.0 - (loads[r].num_requests * scale + loads[r].kv_cache_usage) / 2.0
            for r in replica_ids
        }
