"""`SessionActivity`: how many recently active sessions each replica holds.

Why: agent sessions are long-lived and mostly idle from the engine's point of
view (a tool runs, the user reads), so a replica's in-flight request count says
little about the load its sessions will bring. A session placed on the replica
that looks idle right now keeps coming back there; placing new sessions by
in-flight counts alone piles sessions onto replicas whose sessions happen to
be between steps, and the load guard later has to move them off, at the cost
of recomputing their history. Counting active sessions per replica lets the
"session-balance" scorer spread new sessions the way a session hash would,
while the prefix scorer still keeps every returning session where its cache is.

A session counts for the replica of its latest request until `idle_s` seconds
pass without a request. At most `max_sessions` are tracked (least recently
active forgotten first). Not thread-safe; the router calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

from router.types import ReplicaId


class SessionActivity:
    """Active sessions per replica, expired lazily in order of last activity."""

    def __init__(self, idle_s: float, max_sessions: int) -> None:
        if idle_s <= 0 or max_sessions < 1:
            raise ValueError(f"idle_s={idle_s} must be > 0 and max_sessions={max_sessions} >= 1")
        self._idle_s = idle_s
        self._max_sessions = max_sessions
        # session id -> (replica, last active), least recently active first
        self._sessions: OrderedDict[str, tuple[ReplicaId, float]] = OrderedDict()
        self._counts: dict[ReplicaId, int] = {}

    def touch(self, session_id: str, replica_id: ReplicaId, now_s: float) -> None:
        """Records a request of `session_id` on `replica_id` at `now_s` (times never decrease)."""
        previous = self._sessions.pop(session_id, None)
        if previous is not None:
            _decrement(self._counts, previous[0])
        self._sessions[session_id] = (replica_id, now_s)
        self._counts[replica_id] = self._counts.get(replica_id, 0) + 1
        if len(self._sessions) > self._max_sessions:
            _, (oldest_replica, _) = self._sessions.popitem(last=False)
            _decrement(self._counts, oldest_replica)

    def entry(self, session_id: str | None) -> tuple[ReplicaId, float] | None:
        """The session's replica and last request time as tracked now (None: not tracked), for `restore`."""
        return self._sessions.get(session_id) if session_id is not None else None

    def restore(self, session_id: str, entry: tuple[ReplicaId, float] | None) -> None:
        """Puts `session_id` back as `entry` read before a `touch` (None: untracked), in its place by time.

        Why in place: `counts` expires sessions from the front, in order of last activity.
        """
        current = self._sessions.pop(session_id, None)
        if current is not None:
            _decrement(self._counts, current[0])
        if entry is None:
            return
        later = []
        while self._sessions and next(reversed(self._sessions.values()))[1] > entry[1]:
            later.append(self._sessions.popitem())
        self._sessions[session_id] = entry
        self._sessions.update(reversed(later))
        self._counts[entry[0]] = self._counts.get(entry[0], 0) + 1

    def counts(self, now_s: float) -> Mapping[ReplicaId, int]:
        """Replica -> sessions active within `idle_s` of `now_s` (replicas with none are absent)."""
        sessions, horizon = self._sessions, now_s - self._idle_s
        while sessions:
            session_id, (replica_id, last_s) = next(iter(sessions.items()))
            if last_s > horizon:
                break
            del sessions[session_id]
            _decrement(self._counts, replica_id)
        return self._counts

    def counts_besides(self, session_id: str | None, now_s: float) -> Mapping[ReplicaId, int]:
        """`counts(now_s)` without `session_id` itself: the sessions a request of it would share a replica with.

        Why: a returning session already counts for its own replica, which would
        make that replica look busier than moving the session anywhere else by
        exactly the one session a move would carry along.
        """
        counts = self.counts(now_s)
        entry = self._sessions.get(session_id) if session_id is not None else None
        if entry is None:
            return counts
        besides = dict(counts)
        _decrement(besides, entry[0])
        return besides

    def is_active(self, session_id: str | None, now_s: float) -> bool:
        """Whether `session_id` had a request within `idle_s` of `now_s`."""
        entry = self._sessions.get(session_id) if session_id is not None else None
        return entry is not None and entry[1] > now_s - self._idle_s

    def __len__(self) -> int:
        return len(self._sessions)


def _decrement(counts: dict[ReplicaId, int], replica_id: ReplicaId) -> None:
    """One session fewer on `replica_id`; replicas with none are absent."""
    count = counts[replica_id] - 1
    if count:
        counts[replica_id] = count
    else:
        del counts[replica_id]
