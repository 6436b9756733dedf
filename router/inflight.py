"""Requests a router placed and has not yet seen complete, counted per replica."""

from __future__ import annotations

import itertools
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

    Every decision reads the counts, so they are kept per replica as requests
    come and go rather than counted from the requests: each timeout has a
    queue of its own, oldest placement first, so expiry only looks at the
    front. Placement times must not go back (monotonic time).

    The calls one request makes share Serve's internal id (the steps of an
    orchestrator turn), and a call's completion can come after the next call
    was placed: it is then owed (`_owed`), and when it comes it does not end
    the call that runs.

    A dispatched request is ended by its own result (`end_dispatched`, from a
    callback on the result Serve hands `on_request_routed`), not by a
    completion Serve reports under its id: a replica that rejected an attempt
    (full) reports that attempt complete from another thread, possibly after
    the retry was placed, even on the same replica, and sent; ended by it, a
    request that ran was counted nowhere. Serve's reported completions end only
    placements not yet sent, and dispatched ones without a result to watch.
    """

    def __init__(self) -> None:
        # request id -> (replica, placed at), oldest placement first; one queue per timeout.
        self._undispatched: OrderedDict[str, tuple[ReplicaId, float]] = OrderedDict()
        self._dispatched: OrderedDict[str, tuple[ReplicaId, float]] = OrderedDict()
        self._counts: dict[ReplicaId, int] = {}
        # (request id, replica) -> completions still to come of earlier calls under that id, oldest first.
        self._owed: OrderedDict[tuple[str, ReplicaId], int] = OrderedDict()
        # request id -> serial of its dispatch whose result ends it (`end_dispatched`).
        self._self_ending: dict[str, int] = {}
        self._serials = itertools.count(1)

    def place(self, request_id: str, replica_id: ReplicaId, now_s: float, is_dispatched: bool) -> None:
        earlier = self._dispatched.get(request_id)
        if earlier is not None and not is_dispatched:  # a new call under the id of one whose completion is due
            owed = (request_id, earlier[0])
            self._owed[owed] = self._owed.get(owed, 0) + 1
            self._owed.move_to_end(owed)
            while len(self._owed) > MAX_INFLIGHT:
                self._owed.popitem(last=False)
        self._remove(request_id)
        (self._dispatched if is_dispatched else self._undispatched)[request_id] = (replica_id, now_s)
        self._counts[replica_id] = self._counts.get(replica_id, 0) + 1
        while len(self._undispatched) + len(self._dispatched) > MAX_INFLIGHT:
            self._drop_oldest()

    def dispatch(self, request_id: str, replica_id: ReplicaId, now_s: float, is_self_ending: bool = False) -> int:
        """Counts the request as sent to `replica_id` (where Serve sent it, the chosen one or not), placed there
        whether or not it still was (a rejected attempt's completion may have ended its placement).

        Args:
            is_self_ending: its result will end it (`end_dispatched` with the serial returned), so completions
                Serve reports under its id leave it alone. Without, the next such completion ends it: Serve may
                report a request the engine refused at once complete before it reports it routed.

        Returns:
            The dispatch's serial, for `end_dispatched`.
        """
        if not is_self_ending and request_id not in self._undispatched and request_id not in self._dispatched:
            return 0  # ended before it was reported routed (see above): placed again, it would count for long
        self.place(request_id, replica_id, now_s, True)
        serial = next(self._serials)
        if is_self_ending:
            self._self_ending[request_id] = serial
        return serial

    def end_dispatched(self, request_id: str, serial: int) -> None:
        """Stops counting the dispatch `serial` of the request, if it still counts (a later call under the id,
        placed since, goes on)."""
        if self._self_ending.get(request_id) == serial:
            self._remove(request_id)

    def complete(self, request_id: str, replica_id: ReplicaId | None = None) -> bool:
        """Stops counting the request as Serve reports it complete; with `replica_id`, only if it is placed there.

        Why the replica: a replica that rejected the request (full) reports its attempt complete,
        possibly after Serve has placed the retry on another one, which still runs it. A dispatch
        whose result ends it (`end_dispatched`) is left alone.

        Returns:
            False when the request is placed on a replica other than `replica_id` (nothing changed).
        """
        if replica_id is not None and (owed := self._owed.get((request_id, replica_id))):
            # An earlier call under this id ended there: the one placed now goes on.
            if owed == 1:
                del self._owed[(request_id, replica_id)]
            else:
                self._owed[(request_id, replica_id)] = owed - 1
            return True
        placed = self._undispatched.get(request_id) or self._dispatched.get(request_id)
        if placed is None:
            return True
        if replica_id is not None and placed[0] != replica_id:
            return False
        if request_id not in self._self_ending:
            self._remove(request_id)
        return True

    def _remove(self, request_id: str) -> None:
        """Stops counting the request's placement, whatever it is."""
        self._self_ending.pop(request_id, None)
        placed = self._undispatched.pop(request_id, None) or self._dispatched.pop(request_id, None)
        if placed is not None:
            self._uncount(placed[0])

    def counts(self, now_s: float, deciding: str | None = None) -> dict[ReplicaId, int]:
        """Requests in flight per replica (replicas with none are absent); expires what timed out first.

        `deciding`: a request being decided again (Serve asks again while every replica is full, or after one
        refused it): its own placement, not yet sent, is left out, or its decision would count it twice on
        the replica it chose before (its own count, then the one the load guard adds for the request).
        """
        self._expire(self._undispatched, now_s - UNDISPATCHED_TIMEOUT_S)
        self._expire(self._dispatched, now_s - INFLIGHT_TIMEOUT_S)
        counts = dict(self._counts)
        placed = self._undispatched.get(deciding) if deciding is not None else None
        if placed is not None:
            counts[placed[0]] -= 1
            if not counts[placed[0]]:
                del counts[placed[0]]
        return counts

    def _expire(self, queue: OrderedDict[str, tuple[ReplicaId, float]], placed_before_s: float) -> None:
        """Drops the placements of `queue` made before `placed_before_s`."""
        while queue:
            request_id, (replica_id, placed_s) = next(iter(queue.items()))
            if placed_s >= placed_before_s:
                return
            self._remove(request_id)

    def _drop_oldest(self) -> None:
        """Drops the oldest placement of either queue (the bound on bookkeeping)."""
        queues = [queue for queue in (self._undispatched, self._dispatched) if queue]
        oldest = min(queues, key=lambda queue: next(iter(queue.values()))[1])
        self._remove(next(iter(oldest)))

    def _uncount(self, replica_id: ReplicaId) -> None:
        remaining = self._counts[replica_id] - 1
        if remaining:
            self._counts[replica_id] = remaining
        else:
            del self._counts[replica_id]
