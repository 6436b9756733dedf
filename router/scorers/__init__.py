"""Scorers: one file per scorer, each a pure function of the state it is passed.

Protocol: a scorer has a `name` (its registry key, kebab-case) and
`score(request, replica_ids, state) -> dict[ReplicaId, float]`. Values lie in
[0, 1], higher is better; a replica left out scores 0. Scorers own no state:
everything they read is in `ScoringState`, built once per decision by the
policy, so one scorer instance can serve every decision and every thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from router.types import ReplicaId, ReplicaLoad, RoutingRequest


@dataclass(frozen=True, slots=True)
class ScoringState:
    """What the scorers of one decision may read.

    Attributes:
        num_reusable_blocks: the request's full KV blocks before its last token, the most a
            cache hit can reuse (vLLM always computes the last token).
        prefix_blocks: leading request blocks each replica holds, up to `num_reusable_blocks`
            (absent: 0).
        loads: load of every candidate replica.
        session_replicas: session id -> replica its previous request went to.
        active_sessions: replica -> recently active sessions it holds, the request's own
            session left out (absent: 0).
    """

    num_reusable_blocks: int
    prefix_blocks: Mapping[ReplicaId, int]
    loads: Mapping[ReplicaId, ReplicaLoad]
    session_replicas: Mapping[str, ReplicaId]
    active_sessions: Mapping[ReplicaId, int] = field(default_factory=dict)


def shares_of_busiest_plus_one(counts: Sequence[int]) -> list[float]:
    """Each candidate's count over one more than the largest candidate's count, in the same order.

    Relative, because replicas do not report their capacity; the +1 keeps a
    single request or session against none from spanning the whole [0, 1) range.
    Lists, not maps: the dense scorers run this over every candidate of every decision.
    """
    scale = 1.0 / (max(counts, default=0) + 1)
    return [count * scale for count in counts]


class Scorer(Protocol):
    name: str

    def score(
        self, request: RoutingRequest, replica_ids: Sequence[ReplicaId], state: ScoringState
    ) -> dict[ReplicaId, float]:
        """Scores in [0, 1] for (a subset of) `replica_ids`; missing replicas score 0."""
        ...
