"""`PrefixAwarePolicy`: one routing decision, from request to ranked replicas.

Order of one `choose` call:
1. hash the prompt's full blocks (`RequestBlockHashes`), reusing the hashes
   of the session's previous turn (or else of the latest request with the
   same first block) for the prefix it shares; all of them,
   since recording the placement needs every hash anyway, and one tight
   loop costs less than hashing block by block during the lookup;
2. look the blocks up in the `PrefixIndex` (a bisection: a few blocks per
   replica that holds part of the prompt);
3. drop overloaded replicas, unless it is the session's replica and the
   history only it holds outweighs its excess load (`router.load_guard`);
4. score the rest with the configured scorers and rank them (`router.picker`);
   the session's replica goes first when the prefill its history saves
   outweighs its extra load at the guard's rate (`load_guard.prefer_session_history`:
   the scorers' fractions alone gave up a long history for a short queue);
5. name the reason, then `record` the choice: the session's replica and
   pending blocks on the chosen replica (hashing the rest of the prompt).

Reasons, checked in this order:
- "load-guard": the guard removed every replica holding the longest prefix.
- "prefix-hit": the chosen replica holds at least one leading block.
- "session-affinity": the chosen replica served the session's previous turn.
- "cold": nothing was known: no candidate holds a block and the session (if
  any) has no previous replica among the candidates.
- "least-loaded": something was known, but load outranked it.

Decision shape: `ranked_tiers[0]` is exactly the chosen replica, then the rest
of its tie, then lower tiers, then (last, least loaded first) the replicas the
guard removed, so Ray Serve can still fall back to them when all others are full.

Pure apart from what it is handed and two bounded tables of its own: the
index and the session map are passed in and mutated only by `record`; the
policy keeps each session's last block hashes (which changes no decision,
only its cost) and which replica each recently active session is on
(`router.session_activity`, read by the "session-balance" scorer).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from itertools import chain
from typing import Mapping, MutableMapping, Sequence

from cluster.config import RouterConfig
from router.hashing import RequestBlockHashes, reusable_blocks, root_hash
from router.index import PrefixIndex
from router.load_guard import apply_load_guard, prefer_session_history
from router.picker import rank_tiers, total_scores
from router.registry import build_weighted_scorers
from router.scorers import ScoringState
from router.session_activity import SessionActivity
from router.types import Decision, DecisionReason, ReplicaId, ReplicaLoad, RoutingRequest

DEFAULT_NUM_CACHED_SESSIONS = 1024
DEFAULT_NUM_CACHED_PREFIXES = 64
MAX_ACTIVE_SESSIONS = 100_000


class PrefixAwarePolicy:
    """Prefix-aware, load-guarded, session-sticky replica ranking (see module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        block_size_tokens: int,
        rng: random.Random | None = None,
        num_cached_sessions: int = DEFAULT_NUM_CACHED_SESSIONS,
        num_cached_prefixes: int = DEFAULT_NUM_CACHED_PREFIXES,
    ) -> None:
        """Args:
        config: scorer weights, load guard factor and pending TTL.
        block_size_tokens: the engines' KV block size.
        rng: tie-breaking randomness (seed it for reproducible tests).
        num_cached_sessions: sessions whose last block hashes are kept for
            reuse (each costs 4 bytes per prompt token plus its hashes).
        num_cached_prefixes: distinct first blocks (system prompts, in
            practice) whose latest request's hashes are kept for reuse by
            requests of other sessions or of none.
        """
        if block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be >= 1, got {block_size_tokens}")
        if num_cached_sessions < 0 or num_cached_prefixes < 0:
            raise ValueError(f"num_cached_sessions={num_cached_sessions}, num_cached_prefixes="
                             f"{num_cached_prefixes}: both must be >= 0")
        self._scorers = build_weighted_scorers(config.scorer_weights)
        self._load_guard_factor = config.load_guard_factor
        self._load_guard_min_requests = config.load_guard_min_requests
        self._load_guard_tokens_per_excess_request = config.load_guard_tokens_per_excess_request
        self._pending_ttl_s = config.pending_ttl_s
        self._block_size_tokens = block_size_tokens
        self._rng = rng or random.Random()
        self._num_cached_sessions = num_cached_sessions
        self._session_blocks: OrderedDict[str, RequestBlockHashes] = OrderedDict()
        self._activity = SessionActivity(config.session_idle_s, MAX_ACTIVE_SESSIONS)
        self._num_cached_prefixes = num_cached_prefixes
        self._prefix_blocks: OrderedDict[bytes, RequestBlockHashes] = OrderedDict()

    def active_sessions(self, now_s: float) -> dict[ReplicaId, int]:
        """Replica -> sessions this policy placed there that had a request within `session_idle_s` of `now_s`."""
        return dict(self._activity.counts(now_s))

    def choose(
        self,
        request: RoutingRequest,
        candidate_ids: Sequence[ReplicaId],
        loads: Mapping[ReplicaId, ReplicaLoad],
        index: PrefixIndex,
        sessions: MutableMapping[str, ReplicaId],
        now_s: float,
    ) -> Decision:
        """Ranks the candidates for `request` and records the top choice.

        Args:
            request: the request to place.
            candidate_ids: replicas that may take it (non-empty, no duplicates).
            loads: load of every candidate.
            index: the prefix index (pending blocks are added to it).
            sessions: session id -> last replica (updated for this session).
            now_s: current time (monotonic seconds) for pending entries.

        Returns:
            The decision; `decision.replica_id` is the chosen replica.

        Raises:
            ValueError: no candidates, or a candidate without a load.
        """
        if not candidate_ids:
            raise ValueError("no candidate replicas")
        missing = [r for r in candidate_ids if r not in loads]
        if missing:
            raise ValueError(f"no load reported for candidate replicas {missing}")
        blocks = self._request_blocks(request)
        held = index.longest_prefix(blocks.hashes(), now_s)
        # A replica holding more than the reusable blocks saves no more.
        usable_blocks = reusable_blocks(request.num_tokens, self._block_size_tokens)
        prefix_blocks = {r: min(held[r], usable_blocks) for r in candidate_ids if r in held} if usable_blocks else {}
        cached_tokens = {r: n * self._block_size_tokens for r, n in prefix_blocks.items()}
        session_replica = sessions.get(request.session_id) if request.session_id is not None else None
        kept, removed = apply_load_guard(
            candidate_ids, loads, self._load_guard_factor, self._load_guard_min_requests,
            cached_tokens, self._load_guard_tokens_per_excess_request, session_replica,
        )
        active = self._activity.counts_besides(request.session_id, now_s)
        # Affinity bridges the events' lag behind the session's last request; a session idle past
        # `session_idle_s` has its history indexed, or evicted, and draws nothing more to its old replica.
        affine = sessions if self._activity.is_active(request.session_id, now_s) else {}
        state = ScoringState(usable_blocks, prefix_blocks, loads, affine, active)
        weighted = [(weight, scorer.score(request, kept, state)) for scorer, weight in self._scorers]
        totals = total_scores(kept, weighted)
        tiers = rank_tiers(totals, self._rng)
        chosen = prefer_session_history(
            tiers[0][0], session_replica if session_replica in kept else None, loads, cached_tokens,
            self._load_guard_tokens_per_excess_request,
        )
        ranked = [[chosen]]
        for tier in tiers:
            rest = [r for r in tier if r != chosen] if chosen in tier else tier
            if rest:
                ranked.append(rest)
        if removed:
            ranked.append(sorted(removed, key=lambda r: loads[r].num_requests))
        decision = Decision(
            ranked_tiers=ranked,
            reason=self._reason(chosen, candidate_ids, prefix_blocks, removed, session_replica),
            predicted_cached_tokens=self._predicted_tokens(ranked, cached_tokens),
            scores=totals,
            session_id=request.session_id,
            session_replica_before=session_replica,
            session_activity_before=self._activity.entry(request.session_id),
            request_blocks=blocks,
            held_blocks=held,
        )
        self.record(decision, chosen, index, sessions, now_s)
        return decision

    def record(
        self,
        decision: Decision,
        replica_id: ReplicaId,
        index: PrefixIndex,
        sessions: MutableMapping[str, ReplicaId],
        now_s: float,
    ) -> None:
        """Notes that the decision's request went to `replica_id`.

        `choose` calls it for its top choice. Call it again when Ray Serve sent
        the request to a fallback replica instead, after withdrawing the top
        choice's pending entries (`PrefixIndex.withdraw_pending`): left there,
        they would credit it with blocks it never computes.

        Args:
            decision: from `choose`.
            replica_id: the replica that took the request.
            index: receives the request's blocks as pending on `replica_id`.
            sessions: the session (if any) now points at `replica_id`.
            now_s: current time.
        """
        if decision.session_id is not None:
            sessions[decision.session_id] = replica_id
            self._activity.touch(decision.session_id, replica_id, now_s)
        blocks = decision.request_blocks
        if blocks is not None and blocks.num_blocks:
            index.add_pending(
                replica_id, blocks.hashes(), now_s, self._pending_ttl_s, decision.held_blocks.get(replica_id, 0)
            )
            index.note_placed_prompt(replica_id, blocks, now_s)

    def unrecord_session(self, decision: Decision, sessions: MutableMapping[str, ReplicaId]) -> None:
        """Undoes what `record` wrote of the decision's session: its replica and its activity go back to what
        they were. For a request Serve asks to place again, whose first choice must not pass for its session's
        replica (session affinity drew it back there, as `session-affinity`, to a replica holding none of its
        history), nor make a session idle past `session_idle_s` active again (affinity drew it back to its old
        replica, which its history may have left).
        """
        if decision.session_id is None:
            return
        if decision.session_replica_before is None:
            sessions.pop(decision.session_id, None)
        else:
            sessions[decision.session_id] = decision.session_replica_before
        self._activity.restore(decision.session_id, decision.session_activity_before)

    def _request_blocks(self, request: RoutingRequest) -> RequestBlockHashes:
        """The request's block hashes, taking over those of the longest known prefix it shares.

        The session's previous turn shares the most; without one, the latest
        request that began with the same first block (the same system prompt
        and tools, typically) usually shares most of the rest.
        """
        blocks = RequestBlockHashes(
            request.token_ids, self._block_size_tokens, root_hash(request.model_id, request.cache_salt)
        )
        session_id = request.session_id
        previous = None
        if session_id is not None and self._num_cached_sessions:
            previous = self._session_blocks.pop(session_id, None)
            self._session_blocks[session_id] = blocks
            if len(self._session_blocks) > self._num_cached_sessions:
                self._session_blocks.popitem(last=False)
        first_block = blocks.first_block_key()
        if first_block is not None and self._num_cached_prefixes:
            shared = self._prefix_blocks.pop(first_block, None)
            if previous is None:
                previous = shared
            self._prefix_blocks[first_block] = blocks
            if len(self._prefix_blocks) > self._num_cached_prefixes:
                self._prefix_blocks.popitem(last=False)
        if previous is not None:
            blocks.reuse_prefix(previous)
        return blocks

    @staticmethod
    def _reason(
        chosen: ReplicaId,
        candidate_ids: Sequence[ReplicaId],
        prefix_blocks: Mapping[ReplicaId, int],
        removed: Sequence[ReplicaId],
        previous: ReplicaId | None,
    ) -> DecisionReason:
        longest = max(prefix_blocks.values(), default=0)
        if longest and removed:
            best = [r for r, n in prefix_blocks.items() if n == longest]
            if all(r in removed for r in best):
                return "load-guard"
        if prefix_blocks.get(chosen, 0):
            return "prefix-hit"
        if previous == chosen:
            return "session-affinity"
        if not prefix_blocks and previous not in candidate_ids:
            return "cold"
        return "least-loaded"

    @staticmethod
    def _predicted_tokens(ranked: list[list[ReplicaId]], cached_tokens: Mapping[ReplicaId, int]) -> dict[ReplicaId, int]:
        """The cached tokens vLLM will count on each ranked candidate: its reusable leading blocks (`choose`)."""
        return {r: cached_tokens.get(r, 0) for r in chain.from_iterable(ranked)}
