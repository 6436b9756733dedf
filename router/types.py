"""Value types shared by the router's pure modules.

Why a separate module: the index, the scorers, the picker and the policy all
speak about replicas, requests and loads; keeping these types here lets each of
those modules depend on this one instead of on each other.

Invariants:
- `RoutingRequest.token_ids` is always an `array("I")` (unsigned 32-bit, the
  encoding `router.hashing` hashes), built once when the request is made.
- `ReplicaLoad` counts are >= 0 and `kv_cache_usage` lies in [0, 1].
- `Decision.ranked_tiers` is non-empty, holds no empty tier and names every
  replica at most once; `predicted_cached_tokens` has one entry per ranked replica.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Literal, NewType

from router.hashing import RequestBlockHashes, as_token_array

ReplicaId = NewType("ReplicaId", str)

DecisionReason = Literal["prefix-hit", "session-affinity", "least-loaded", "load-guard", "cold"]


@dataclass(frozen=True)
class RoutingRequest:
    """What the router knows about one request when it picks a replica.

    Building it (tokenising, then the list -> `array("I")` conversion) is the
    caller's cost; a decision only takes one bytes copy of the array.
    """

    token_ids: array
    model_id: str
    session_id: str | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise the one field that may arrive as a list.
        object.__setattr__(self, "token_ids", as_token_array(self.token_ids))
        if not self.model_id:
            raise ValueError("RoutingRequest.model_id must be non-empty")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """Load of one replica as last reported (Ray routing stats or queue probes)."""

    num_ongoing_requests: int
    num_queued_requests: int = 0
    kv_cache_usage: float = 0.0
    # Requests the replica holds, running or waiting: what the load guard compares. Stored, not a
    # property, since every decision reads it for every candidate.
    num_requests: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_ongoing_requests < 0 or self.num_queued_requests < 0:
            raise ValueError(
                f"request counts must be >= 0, got ongoing={self.num_ongoing_requests} "
                f"queued={self.num_queued_requests}"
            )
        if not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must lie in [0, 1], got {self.kv_cache_usage}")
        object.__setattr__(self, "num_requests", self.num_ongoing_requests + self.num_queued_requests)


@dataclass(frozen=True)
class Decision:
    """Outcome of one routing decision.

    `ranked_tiers[0]` is a single replica, the policy's choice; later tiers are
    fallbacks in order (Ray Serve tries them when the earlier ones are full).
    `reason` says why the choice won (see `router.policy`). `request_blocks`
    keeps the request's block hashes and `held_blocks` the index's leading
    blocks per replica at decision time, so that recording the placement
    after routing neither hashes the prompt nor walks the index again.
    """

    ranked_tiers: list[list[ReplicaId]]
    reason: DecisionReason
    predicted_cached_tokens: dict[ReplicaId, int]
    scores: dict[ReplicaId, float]
    session_id: str | None = None
    # The session's replica before this decision made it the chosen one (None: the session was new), so that a
    # decision Serve asks again for can be undone (`router.adapter`).
    session_replica_before: ReplicaId | None = field(default=None, repr=False, compare=False)
    # And its activity before (`SessionActivity.entry`: replica and last request time), so that undoing the
    # decision leaves an idle session idle.
    session_activity_before: tuple[ReplicaId, float] | None = field(default=None, repr=False, compare=False)
    request_blocks: RequestBlockHashes | None = field(default=None, repr=False, compare=False)
    held_blocks: dict[ReplicaId, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def replica_id(self) -> ReplicaId:
        """The chosen replica."""
        return self.ranked_tiers[0][0]
