"""The "prefix-cache" scorer: how much of the prompt a replica would not recompute.

Score = leading request blocks the replica holds (indexed or pending) / the
request's reusable blocks (its full blocks before its last token, which vLLM
always computes: the last block of a prompt that fills it exactly is computed
again even where it is cached, so holding it earns nothing). A request with no
reusable block scores 0 everywhere. Values lie in [0, 1] because the policy
caps each replica's blocks at the reusable count.
"""

from __future__ import annotations

from typing import Sequence

from router.scorers import ScoringState
from router.types import ReplicaId, RoutingRequest


class PrefixCacheScorer:
    name = "prefix-cache"

    def score(
        self, request: RoutingRequest, replica_ids: Sequence[ReplicaId], state: ScoringState
    ) -> dict[ReplicaId, float]:
        """Fraction of the request's reusable blocks cached per replica.

        Args:
            request: the request being routed (unused: the state holds its block count).
            replica_ids: candidates.
            state: `prefix_blocks` and `num_reusable_blocks` are read.

        Returns:
            Replica -> fraction, only for replicas holding at least one block.
        """
        num_blocks = state.num_reusable_blocks
        if num_blocks == 0:
            return {}
        prefix = state.prefix_blocks
        return {r: min(prefix[r], num_blocks) / num_blocks for r in replica_ids if r in prefix}
