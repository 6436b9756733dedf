"""Routing decisions and statistics shared by the router and the ingress of one process.

Why a module of its own: Ray Serve pickles the router's module by value, so a
process-wide object defined there would be copied, not shared. Imported from
here, the router, the HTTP ingress and the `/v1/router` debug route see the
same objects:
- `DECISIONS`: request -> decision, read once by the ingress to set the
  `x-warmpath-route` and `x-warmpath-predicted-cached-tokens` headers;
- `STATS`: decisions counted by reason, and predicted vs actual cached tokens
  (vLLM's `usage.prompt_tokens_details.cached_tokens`) as prediction accuracy;
- `LIVE_ROUTERS`: the routers of this process, for their state snapshots.
All are bounded and thread-safe (the KV event pump runs on its own thread).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Optional

from router.types import Decision

MAX_DECISIONS = 4096


@dataclass(frozen=True)
class LoggedDecision:
    """A decision and when it was made (wall-clock ns), for a retroactive routing span."""

    decision: Decision
    start_ns: int
    end_ns: int


class DecisionLog:
    """Bounded map request -> decision, read once by the caller of the same process.

    A request is named by Serve's request id and its internal request id. The
    request id is the client's `x-request-id` when it sent one, so two requests
    in flight may share it; the internal id is Serve's own, one per request
    (the proxy's, which a deployment's calls to other deployments keep). A
    caller that names both gets its own decision; one that names only the
    request id gets the decision logged under it only while no other request
    in the log shares that id, and None otherwise: no headers, rather than
    another request's.
    """

    def __init__(self, capacity: int = MAX_DECISIONS) -> None:
        self._capacity = capacity
        self._items: OrderedDict[tuple[str, str], LoggedDecision] = OrderedDict()
        # request id -> the internal ids logged under it, for callers that know the request id only.
        self._internal_ids: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def put(self, request_id: str, internal_request_id: str, logged: LoggedDecision) -> None:
        """Logs a request's decision; a request routed again (a replica refused it) replaces its decision."""
        with self._lock:
            key = (request_id, internal_request_id)
            self._items[key] = logged
            self._items.move_to_end(key)
            self._internal_ids.setdefault(request_id, set()).add(internal_request_id)
            while len(self._items) > self._capacity:
                self._forget(*self._items.popitem(last=False)[0])

    def pop(self, request_id: str, internal_request_id: Optional[str] = None) -> Optional[LoggedDecision]:
        """Takes a request's decision out of the log (see the class docstring for a request id alone)."""
        with self._lock:
            if internal_request_id is None:
                internal_ids = self._internal_ids.get(request_id, ())
                if len(internal_ids) != 1:
                    return None
                (internal_request_id,) = internal_ids
            logged = self._items.pop((request_id, internal_request_id), None)
            if logged is not None:
                self._forget(request_id, internal_request_id)
            return logged

    def _forget(self, request_id: str, internal_request_id: str) -> None:
        internal_ids = self._internal_ids.get(request_id)
        if internal_ids is not None:
            internal_ids.discard(internal_request_id)
            if not internal_ids:
                del self._internal_ids[request_id]


# Why a chat or completion request was placed by load, not by its prefix: no tokenizer yet (a fresh
# router), a prompt over the window (not rendered, `MAX_CHARS_PER_TOKEN`), nothing to match (a prompt that
# does not render, or a request that skips the prefix cache), or a fault of the router itself.
LOAD_ROUTED_CAUSES = ("no-tokenizer", "over-window", "no-prefix", "router-error")


class RoutingStats:
    """Counters of decisions and of prediction accuracy (within one KV block counts as exact)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_decisions_by_reason: Counter[str] = Counter()
        # Requests of prefix-routed methods placed by load alone, by why (`LOAD_ROUTED_CAUSES`).
        self.num_routed_by_load: Counter[str] = Counter()
        self.num_predictions = 0
        self.num_predictions_within_block = 0
        self.sum_predicted_tokens = 0
        self.sum_actual_tokens = 0
        self.sum_abs_error_tokens = 0

    def count_decision(self, reason: str) -> None:
        with self._lock:
            self.num_decisions_by_reason[reason] += 1

    def recount(self, counted_reason: str, reason: str) -> None:
        """A decision counted as `counted_reason` is now counted as `reason` (the same request decided again)."""
        with self._lock:
            if self.num_decisions_by_reason[counted_reason] > 0:
                self.num_decisions_by_reason[counted_reason] -= 1
            self.num_decisions_by_reason[reason] += 1

    def count_fallback(self, reason: str) -> None:
        """A decision counted as `reason` was served elsewhere (`FALLBACK_REASON`), as the decisions metric, the
        route header and span say: `/v1/router` counted it as the chosen replica's reason."""
        self.recount(reason, FALLBACK_REASON)

    def count_routed_by_load(self, cause: str) -> None:
        """A chat or completion request placed by load alone (`LOAD_ROUTED_CAUSES` says why), once a request."""
        with self._lock:
            self.num_routed_by_load[cause] += 1

    def count_prediction(self, predicted_tokens: int, actual_tokens: int, block_size_tokens: int) -> None:
        error = abs(predicted_tokens - actual_tokens)
        with self._lock:
            self.num_predictions += 1
            self.num_predictions_within_block += error <= block_size_tokens
            self.sum_predicted_tokens += predicted_tokens
            self.sum_actual_tokens += actual_tokens
            self.sum_abs_error_tokens += error

    def snapshot(self) -> dict:
        with self._lock:
            n = self.num_predictions
            return {
                "decisions_by_reason": dict(self.num_decisions_by_reason),
                "routed_by_load": dict(self.num_routed_by_load),
                "num_predictions": n,
                "prediction_accuracy": self.num_predictions_within_block / n if n else None,
                "mean_abs_error_tokens": self.sum_abs_error_tokens / n if n else None,
                "predicted_cached_tokens": self.sum_predicted_tokens,
                "actual_cached_tokens": self.sum_actual_tokens,
            }


DECISIONS = DecisionLog()
STATS = RoutingStats()


def pop_current() -> Optional[LoggedDecision]:
    """The decision of the request this task serves, taken out of `DECISIONS` by both of Serve's request ids
    (from Serve's request context), so two requests sharing a client's `x-request-id` never swap decisions."""
    from ray.serve.context import _get_serve_request_context

    context = _get_serve_request_context()
    return DECISIONS.pop(context.request_id, context._internal_request_id)
LIVE_ROUTERS: "weakref.WeakSet" = weakref.WeakSet()


def withdraw_placement(logged: Optional[LoggedDecision], served_replica_id: Optional[str]) -> None:
    """Tells this process's routers that the decision's request was refused before prefill: it caches nothing."""
    if logged is None:
        return
    for router in list(LIVE_ROUTERS):
        router.withdraw(logged.decision, served_replica_id)


# The route a response reports when Serve sent the call to another replica than the chosen one (that one
# was full): the decision's reason described a replica that did not serve it.
FALLBACK_REASON = "fallback"


def served_reason(decision: Decision, served_replica_id: Optional[str]) -> str:
    """Why the call went where it was served: the decision's reason, or `FALLBACK_REASON` elsewhere."""
    if served_replica_id and served_replica_id != decision.replica_id:
        return FALLBACK_REASON
    return decision.reason


def record_route_span(logged: Optional[LoggedDecision], served_replica_id: Optional[str]) -> None:
    """A `warmpath.route` span (child of the current span) for a decision made on Serve's routing task.

    The decision ran on the handle's routing task, outside the caller's trace
    context, so its span is recorded afterwards with the measured start and end.
    """
    from opentelemetry import trace

    if logged is None or not trace.get_current_span().is_recording():
        return
    decision = logged.decision
    replica = served_replica_id or decision.replica_id
    span = trace.get_tracer("warmpath").start_span("warmpath.route", start_time=logged.start_ns)
    span.set_attribute("warmpath.route.reason", served_reason(decision, replica))
    span.set_attribute("warmpath.route.replica", replica)
    span.set_attribute("warmpath.route.chosen_replica", decision.replica_id)
    span.set_attribute("warmpath.route.predicted_cached_tokens", decision.predicted_cached_tokens.get(replica, 0))
    span.end(end_time=logged.end_ns)
