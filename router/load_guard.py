"""Load guard: no replica takes more than `load_guard_factor` times the mean load,
unless it holds the request's session and moving the session costs more than the queue.

Why: prefix affinity concentrates traffic. A hot prefix (one system prompt for
every agent, a popular document) would otherwise pile every request onto the
replica that cached it first; past some imbalance recomputing the prefix
elsewhere is cheaper than queueing, and the copy then serves later requests
there too. A session's own history is different: nobody else reuses it, so
moving a session recomputes all of it for this one request, and on a replica
only a request or two over the limit that prefill costs more than the wait it
saves.

Rule, counting the request being routed (loads are whole requests):
    mean_after = (sum of num_requests + 1) / number of replicas
    limit      = max(ceil(load_guard_factor * mean_after), min_requests)
    a replica passes iff its num_requests + 1 <= limit
Rounding the limit up keeps the guard from firing on tiny imbalances (one busy
replica out of two); `min_requests` keeps it from firing at all while every
replica is nearly idle, where a cache miss costs more than a short queue.

Then, with `tokens_per_excess_request` set, the session's replica comes back
if the rule removed it and
    saved_tokens > excess_requests * tokens_per_excess_request
    saved_tokens    = its cached prefix tokens - the longest among the kept replicas
    excess_requests = its num_requests + 1 - limit   (>= 1 for a removed replica)
so a session a little over the limit stays with its history, and one far over
it stays only with a very long one.

A factor so large that the limit is no finite number removes nobody.

The same rate then settles the choice among the kept replicas
(`prefer_session_history`): the scorers weigh a prefix as a fraction of the
prompt and load as a fraction of the busiest replica, so on their own a
session's 60,000 cached tokens counted no more than 600, and its replica lost
to an idle one as soon as it served a few requests with its KV cache half
full: the turn recomputed its whole history to skip a queue that continuous
batching absorbs. The session's replica is chosen over the scorers' first when
    saved_tokens > max(its num_requests - the first's, 1) * tokens_per_excess_request
    saved_tokens = its cached prefix tokens - the first's
At equal load its history must still save more than one request's worth. Only
the session's own replica: a prefix many requests share (a system prompt, a
document) is the scorers' to spread, since a copy on another replica serves
the requests after this one too; held to this rule, every new session piled
onto the first replica that cached the shared prefix until the guard stopped
it (simulated: load imbalance 1.2 -> 2.0 at 64 replicas).

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
    cached_tokens: Mapping[ReplicaId, int] | None = None,
    tokens_per_excess_request: float | None = None,
    session_replica: ReplicaId | None = None,
) -> tuple[list[ReplicaId], list[ReplicaId]]:
    """Splits candidates into those under the limit and those over it.

    Args:
        replica_ids: candidates; each must have an entry in `loads`.
        loads: current load per replica.
        load_guard_factor: multiple of the mean load allowed (> 1).
        min_requests: a replica may always hold this many requests, this one included.
        cached_tokens: tokens of the request's prefix each replica holds (absent: none).
        tokens_per_excess_request: prefill tokens one request over the limit is
            worth; None keeps the count-only rule.
        session_replica: the replica that served the request's session last, the
            only one the cost rule can bring back (None: no session, no exception).

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
    allowed = load_guard_factor * mean_after
    if not math.isfinite(allowed):
        return list(replica_ids), []
    # The epsilon keeps float noise (1.1 * 10 = 11.000000000000002) from adding a request.
    limit = max(math.ceil(allowed - 1e-9), min_requests)
    if max(counts) < limit:  # the usual case: nobody is over it
        return list(replica_ids), []
    is_kept = [n + 1 <= limit for n in counts]
    if not any(is_kept):
        lightest = min(counts)
        is_kept = [n == lightest for n in counts]
    if cached_tokens and tokens_per_excess_request is not None and session_replica in replica_ids:
        i = replica_ids.index(session_replica)
        if not is_kept[i]:
            best_kept = max((cached_tokens.get(r, 0) for r, k in zip(replica_ids, is_kept) if k), default=0)
            saved = cached_tokens.get(session_replica, 0) - best_kept
            is_kept[i] = saved > (counts[i] + 1 - limit) * tokens_per_excess_request
    kept = [r for r, k in zip(replica_ids, is_kept) if k]
    removed = [r for r, k in zip(replica_ids, is_kept) if not k]
    return kept, removed


def prefer_session_history(
    first: ReplicaId,
    session_replica: ReplicaId | None,
    loads: Mapping[ReplicaId, ReplicaLoad],
    cached_tokens: Mapping[ReplicaId, int],
    tokens_per_excess_request: float | None,
) -> ReplicaId:
    """The replica to choose: the scorers' `first`, unless the session's replica saves more prefill than the
    requests it has over `first` are worth (module docstring).

    Args:
        first: the scorers' choice among the kept replicas.
        session_replica: the replica that served the request's session last, if it was kept (else None).
        loads: current load of each.
        cached_tokens: tokens of the request's prefix each replica holds (absent: none).
        tokens_per_excess_request: prefill tokens one request of load is worth; None: the scorers decide.

    Returns:
        The chosen replica.
    """
    if tokens_per_excess_request is None or session_replica is None or session_replica == first:
        return first
    saved = cached_tokens.get(session_replica, 0) - cached_tokens.get(first, 0)
    excess = loads[session_replica].num_requests - loads[first].num_requests
    return session_replica if saved > max(excess, 1) * tokens_per_excess_request else first
