"""Requests a router placed and has not yet seen complete, counted per replica."""

from __future__ import annotations

from collections import OrderedDict

from router.types import ReplicaId

MAX_INFLIGHT = 16_384
INFLIGHT_TIMEOUT_S = 900.0
UNDISPATCHED_TIMEOUT_S = 30.0


class InflightRequests:
    """Requests this router placed and Serve has not reported complete, by replica.

    Why: Serve's queue-length cache is refreshed by probes and replica replies,
    so a burst of requests routed within one probe round trip all read the same
    stale counts and the load guard never sees them. Counting our own
    placements from the decision until `on_request_completed` closes that gap.
    A request counts once, on the replica it was last placed on. A decision
    that is never dispatched (the caller gave up while routing) gets no
    completion, so it stops counting after `UNDISPATCHED_TIMEOUT_S`; a
    dispatched one after `INFLIGHT_TIMEOUT_S`.
    """

    def __init__(self) -> None:
        # request id -> (replica, placed at, is dispatched), oldest placement first.
        self._placed: OrderedDict[str, tuple[ReplicaId, float, bool]] = OrderedDict()

    def place(self, request_id: str, replica_id: ReplicaId, now_s: float, is_dispatched: bool) -> None:
        self._placed[request_id] = (replica_id, now_s, is_dispatched)
        self._placed.move_to_end(request_id)
        while len(self._placed) > MAX_INFLIGHT:
            self._placed.popitem(last=False)

    def complete(self, request_id: str) -> None:
        self._placed.pop(request_id, None)

    def counts(self, now_s: float) -> dict[ReplicaId, int]:
        out: dict[ReplicaId, int] = {}
        expired = []
        for request_id, (replica_id, placed_s, is_dispatched) in self._placed.items():
            if now_s - placed_s > (INFLIGHT_TIMEOUT_S if is_dispatched else UNDISPATCHED_TIMEOUT_S):
                expired.append(request_id)
            else:
                out[replica_id] = out.get(replica_id, 0) + 1
        for request_id in expired:
            del self._placed[request_id]
        return out
