"""The "session-affinity" scorer: send a session's next turn where its last one went.

Why, beyond the prefix index: the previous turn's blocks may not be indexed
yet (events lag prefill, the router restarted, or a gap forced a resync), and
the engine's cache for the session is most likely still on that replica.
Score 1.0 for the replica in `state.session_replicas[request.session_id]` when
it is a candidate; every other replica scores 0. The policy passes the sessions
only while the request's session is active (`router.session_activity`): once it
has been idle that long, its history is indexed where it is cached, and its old
replica, perhaps long since evicted it, beat an idle replica holding as much.
"""

from __future__ import annotations

from typing import Sequence

from router.scorers import ScoringState
from router.types import ReplicaId, RoutingRequest


class SessionAffinityScorer:
    name = "session-affinity"

    def score(
        self, request: RoutingRequest, replica_ids: Sequence[ReplicaId], state: ScoringState
    ) -> dict[ReplicaId, float]:
        """1.0 for the session's previous replica, if any and still a candidate.

        Args:
            request: `session_id` is read.
            replica_ids: candidates.
            state: `session_replicas` is read (never written).

        Returns:
            At most one entry.
        """
        if request.session_id is None:
            return {}
        previous = state.session_replicas.get(request.session_id)
        if previous is None or previous not in replica_ids:
            return {}
        return {previous: 1.0}
