"""The routers a simulation compares, behind one interface (`SimRouter`).

Apart from the event loop so that a policy, production or baseline, is added or
changed without touching the simulation: warmpath drives the production
`PrefixAwarePolicy` and `PrefixIndex`, the baselines are small functions of the
same state. What each baseline approximates is in `bench.simulator`'s docstring.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from array import array
from dataclasses import dataclass
from typing import Sequence, get_args

from bench.fingerprint_masks import FingerprintMasks
from bench.trace import RequestRecord
from bench.workloads import Session
from cluster.config import RouterConfig, RouterPolicy
from router.hashing import RequestBlockHashes
from router.index import PrefixIndex, leading_runs
from router.policy import PrefixAwarePolicy
from router.types import ReplicaId, ReplicaLoad, RoutingRequest

POLICIES: tuple[RouterPolicy, ...] = get_args(RouterPolicy)


@dataclass(slots=True, eq=False)
class SimRequest:
    """One model call in flight."""

    session_id: str
    step_index: int
    arrival_s: float
    token_ids: array
    num_output_tokens: int
    is_last_of_session: bool
    session: Session | None = None
    blocks: RequestBlockHashes | None = None
    replica: int | None = None
    record: RequestRecord | None = None
    num_blocks_held: int = 0
    pinned_replica: int | None = None  # a replayed request kept where the live run served it (no routing)


class SimRouter:
    """Base of the simulated routers: sees every replica's request count, and KV events if it asks.

    `route` returns the index of the replica that takes the request. It may set
    `request.blocks` (warmpath hashes the prompt itself) and the record's route
    fields; otherwise the simulation hashes the prompt before routing.
    """

    wants_kv_events = False

    def __init__(self, num_replicas: int, rng: random.Random) -> None:
        self.num_requests = [0] * num_replicas
        self.rng = rng

    def route(self, request: SimRequest, now_s: float) -> int:
        raise NotImplementedError

    def on_load(self, replica: int, num_requests: int, kv_cache_usage: float) -> None:
        self.num_requests[replica] = num_requests

    def on_kv_events(self, replica: int, events: list, now_s: float) -> None:
        return None

    def _least_loaded(self, candidates: Sequence[int]) -> int:
        loads = self.num_requests
        best = min(loads[c] for c in candidates)
        return self.rng.choice([c for c in candidates if loads[c] == best])


class Pow2Router(SimRouter):
    """Ray Serve's default: two replicas at random, the one with fewer requests."""

    def route(self, request: SimRequest, now_s: float) -> int:
        n = len(self.num_requests)
        if n == 1:
            return 0
        a, b = self.rng.sample(range(n), 2)
        loads = self.num_requests
        if loads[a] != loads[b]:
            return a if loads[a] < loads[b] else b
        return a


class RoundRobinRouter(SimRouter):
    """Replicas in turn, whatever the request."""

    def __init__(self, num_replicas: int, rng: random.Random) -> None:
        super().__init__(num_replicas, rng)
        self._next = 0

    def route(self, request: SimRequest, now_s: float) -> int:
        chosen = self._next
        self._next = (chosen + 1) % len(self.num_requests)
        return chosen


def _hash64(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "big")


class SessionHashRouter(SimRouter):
    """Consistent hashing of the session id on a ring with 100 virtual nodes per replica (no fallback)."""

    NUM_VIRTUAL_NODES = 100

    def __init__(self, num_replicas: int, rng: random.Random) -> None:
        super().__init__(num_replicas, rng)
        ring = sorted((_hash64(f"r{r}:{v}"), r) for r in range(num_replicas) for v in range(self.NUM_VIRTUAL_NODES))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]

    def route(self, request: SimRequest, now_s: float) -> int:
        i = bisect.bisect_left(self._points, _hash64(request.session_id))
        return self._owners[i % len(self._owners)]


class PrefixTreeRouter(SimRouter):
    """Approximation of Ray's `PrefixCacheAffinityRouter` (see `bench.simulator`'s docstring)."""

    MATCH_RATE_THRESHOLD = 0.1

    def __init__(self, num_replicas: int, rng: random.Random) -> None:
        super().__init__(num_replicas, rng)
        # Block -> bitmask of the replicas sent a prompt holding it. Like Ray's tree with its
        # defaults it never forgets, so it is kept as fingerprints (a hundred million blocks and more).
        self._owners = FingerprintMasks(num_replicas)
        self._num_blocks = [0] * num_replicas

    def route(self, request: SimRequest, now_s: float) -> int:
        hashes = request.blocks.hashes()
        # Whole prompts are inserted, so every replica's set is prefix-closed along the chain:
        # `leading_runs` bisects it into (replicas, blocks they hold), longest last.
        runs = leading_runs(self._owners.get, hashes)
        matched = runs[-1][1] if runs else 0
        if hashes and matched / len(hashes) >= self.MATCH_RATE_THRESHOLD:
            mask = runs[-1][0]  # the replicas holding the longest match
            candidates = [r for r in range(len(self._num_blocks)) if mask >> r & 1]
        else:
            fewest = min(self._num_blocks)
            candidates = [r for r, n in enumerate(self._num_blocks) if n == fewest]
        chosen = self._least_loaded(candidates)
        held = next((n for mask, n in runs if mask >> chosen & 1), 0)
        self._owners.set_bit(hashes[held:], chosen)
        self._num_blocks[chosen] += len(hashes) - held
        return chosen


class WarmpathRouter(SimRouter):
    """The production policy and index, driven by simulated loads and KV events, and told each replica's
    KV capacity as production replicas report it."""

    wants_kv_events = True

    def __init__(self, num_replicas: int, rng: random.Random, config: RouterConfig, block_size_tokens: int,
                 model_id: str, kv_capacity_blocks: int) -> None:
        super().__init__(num_replicas, rng)
        self.replica_ids = [ReplicaId(f"r{i}") for i in range(num_replicas)]
        self._slot = {r: i for i, r in enumerate(self.replica_ids)}
        self.index = PrefixIndex(block_size_tokens, config.max_blocks_per_replica, model_id)
        for replica_id in self.replica_ids:
            self.index.set_replica_capacity(replica_id, kv_capacity_blocks)
        self.policy = PrefixAwarePolicy(config, block_size_tokens, rng=rng)
        self.sessions: dict[str, ReplicaId] = {}
        self.loads = {r: ReplicaLoad(0) for r in self.replica_ids}
        self._model_id = model_id

    def on_load(self, replica: int, num_requests: int, kv_cache_usage: float) -> None:
        super().on_load(replica, num_requests, kv_cache_usage)
        self.loads[self.replica_ids[replica]] = ReplicaLoad(num_requests, 0, min(max(kv_cache_usage, 0.0), 1.0))

    def on_kv_events(self, replica: int, events: list, now_s: float) -> None:
        self.index.apply(self.replica_ids[replica], events, now_s)

    def route(self, request: SimRequest, now_s: float) -> int:
        routing = RoutingRequest(request.token_ids, self._model_id, session_id=request.session_id)
        decision = self.policy.choose(routing, self.replica_ids, self.loads, self.index, self.sessions, now_s)
        request.blocks = decision.request_blocks
        chosen = decision.replica_id
        request.record.route = decision.reason
        request.record.predicted_cached_tokens = decision.predicted_cached_tokens.get(chosen, 0)
        return self._slot[chosen]


def make_router(policy: RouterPolicy, num_replicas: int, rng: random.Random, config: RouterConfig,
                block_size_tokens: int, model_id: str, kv_capacity_blocks: int) -> SimRouter:
    if policy == "warmpath":
        return WarmpathRouter(num_replicas, rng, config, block_size_tokens, model_id, kv_capacity_blocks)
    routers = {"pow2": Pow2Router, "round-robin": RoundRobinRouter, "session-hash": SessionHashRouter,
               "prefix-tree": PrefixTreeRouter}
    if policy not in routers:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    return routers[policy](num_replicas, rng)
