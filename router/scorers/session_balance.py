"""The "session-balance" scorer: prefer replicas holding fewer active sessions.

Score = 1 - active sessions of the replica / (most active sessions of any
candidate + 1). The +1 keeps a handful of sessions from swinging the score
across its whole range: one session against none is 0.5 against 1.0, not 0
against 1, while at realistic counts the score is the plain relative load.
(It does not make a burst of identical new sessions follow the first: with
the first request in flight, its replica's load and session shares cost it
as much as its cached prompt earns, and the burst spreads, each replica
prefilling the prompt once.) It matters where the
prefix scorer ties, which is where a new session starts: every replica that
cached the shared system prompt and tools looks the same to the prefix scorer,
and in-flight counts (the "load" scorer) miss sessions waiting on a tool.
A request of no session scores nothing here: it brings no session along, and
its replica's sessions cost it nothing the load scorer does not count (scored,
one session on the replica holding its whole prompt cancelled the load scorer's
preference for waiting behind one request over recomputing the prompt).
See `router.session_activity` for what counts as active.
"""

from __future__ import annotations

from itertools import repeat
from typing import Sequence

from router.scorers import ScoringState, shares_of_busiest_plus_one
from router.types import ReplicaId, RoutingRequest


class SessionBalanceScorer:
    name = "session-balance"

    def score(
        self, request: RoutingRequest, replica_ids: Sequence[ReplicaId], state: ScoringState
    ) -> dict[ReplicaId, float]:
        """Relative spare session capacity of each candidate.

        Args:
            request: `session_id` is read.
            replica_ids: candidates.
            state: `active_sessions` is read.

        Returns:
            Replica -> score for every candidate; none for a request of no session.
        """
        if request.session_id is None:
            return {}
        shares = shares_of_busiest_plus_one(list(map(state.active_sessions.get, replica_ids, repeat(0))))
        return {r: 1.0 - share for r, share in zip(replica_ids, shares)}
