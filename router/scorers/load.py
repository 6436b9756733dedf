"""The "load" scorer: prefer replicas with fewer requests and free KV cache.

Score = 1 - (request_share + kv_cache_usage) / 2, where request_share is the
replica's running plus queued requests divided by one more than the largest
such count among the candidates. Relative, because Ray Serve's routing stats
give counts but the router is not told each replica's capacity; kv_cache_usage
is already a fraction of capacity. Values lie in [0, 1]. The hard limit on
load is `router.load_guard`; this only ranks.

The +1 (as in "session-balance") keeps one request in flight against none
from spanning the whole range: without it, at the default weight of 2, a
replica holding a request's entire prompt but serving one other request would
tie with an idle replica holding nothing, and stateless repeats of a long
prompt would be recomputed to save a wait behind a single request. At the
counts of a busy cluster the score is the plain relative load.
"""

from __future__ import annotations

from typing import Sequence

from router.scorers import ScoringState, shares_of_busiest_plus_one
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
        candidate_loads = list(map(state.loads.__getitem__, replica_ids))
        shares = shares_of_busiest_plus_one([load.num_requests for load in candidate_loads])
        return {
            r: 1.0 - (share + load.kv_cache_usage) / 2.0 for r, share, load in zip(replica_ids, shares, candidate_loads)
        }
