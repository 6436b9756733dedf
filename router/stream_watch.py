"""Notices a replica whose KV-event stream went quiet while it serves requests, or delivers blocks the index cannot place.

Why: a router that receives no events from a replica still routes, falling back
on pending placements and session affinity, so a broken subscription hides
behind a hit rate that looks fine while predictions for that replica go stale.
Silence alone proves nothing (a fully cached prompt with a short answer stores
no block), so silence only makes a replica *due for a probe*: the event pump
asks the publisher's replay buffer for every batch after the last one it
received. Batches coming back that were published a while ago mean the
subscription missed them (a stall; the pump decides, `router.adapter`); the
end marker alone means the replica had nothing to say (quiet); no answer means
the publisher is unreachable.

A stream can also deliver and still leave the router blind: when the index
misses a replica's early blocks (a history that could not be loaded, a gap the
buffer could not fill), every block stored later extends them and is skipped
as an orphan. A healthy stream has next to no orphans, so `looks_blind`
notices them piling up as a share of the blocks arriving (other prompts'
blocks, stored under roots the index does know, keep arriving meanwhile), and
the pump then reloads the replica's state from its replay buffer, if that buffer
reaches back further than the run of batches the index holds (else a reload
would forget the blocks learned before the buffer's oldest batch, and find
nothing the index lacks).

Threads: `request_completed` runs on Serve's event loop, everything else on the
event pump's thread; one lock guards the table.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Literal

from router.types import ReplicaId

# A completion this old with no batch since makes its replica due for a probe.
PROBE_GRACE_S = 2.0
# At most one probe per replica per this interval.
MIN_PROBE_INTERVAL_S = 10.0
# Probes in a row that found a replica's replay buffer unreachable, after which the router stops crediting
# the replica with its indexed blocks (its engine evicts on, unseen) until its events come back.
UNREACHABLE_PROBES_BEFORE_CLEARING = 3
# Orphaned blocks (parent unknown) in one window of arriving blocks that call a stream blind, if they are
# also at least BLIND_ORPHANED_SHARE of the window's blocks (stored and orphaned).
BLIND_ORPHANED_BLOCKS = 64
BLIND_ORPHANED_SHARE = 0.25
# Arriving blocks after which a window that did not call the stream blind starts over, so that a long
# healthy past does not outweigh orphans arriving now.
BLIND_WINDOW_BLOCKS = 1024
# The wait before a replica's second reload; it doubles after each (a buffer that no longer holds the
# replica's early blocks cannot cure it), up to MAX_RELOAD_INTERVAL_S.
MIN_RELOAD_INTERVAL_S = 60.0
MAX_RELOAD_INTERVAL_S = 3600.0

# The publisher's clock is read against this router's through live batches: their smallest difference
# (router's receipt minus publisher's timestamp: transit plus clock skew) is the offset. It may rise by this
# much per live delivery, so a publisher's clock stepped back is followed within seconds.
CLOCK_OFFSET_RISE_S = 0.01
# A reading this much above the offset is taken at once: the publisher's clock was stepped back (corrected
# after running ahead), or a batch stamped far in the future set the offset; rising 0.01 s a delivery, it
# took a step of an hour 360,000 deliveries, every probe until then a stall.
CLOCK_STEP_S = 60.0

ProbeOutcome = Literal["quiet", "stalled", "unreachable"]


@dataclass(slots=True)
class _ReplicaWatch:
    last_batch_at: float | None = None
    num_completed_since_batch: int = 0
    first_completed_at: float | None = None
    last_probe_at: float | None = None
    num_probes: int = 0
    num_stalls: int = 0
    num_unreachable: int = 0
    num_unreachable_in_a_row: int = 0
    num_recovered_batches: int = 0
    stored_mark: int = 0
    orphaned_mark: int = 0
    last_reload_at: float | None = None
    num_reloads: int = 0
    clock_offset_s: float | None = None


@dataclass(frozen=True, slots=True)
class StreamHealth:
    """One replica's subscription as operators see it (`/v1/router`)."""

    seconds_since_last_batch: float | None
    num_completed_since_batch: int
    num_probes: int
    num_stalls: int
    num_unreachable: int
    num_recovered_batches: int
    num_reloads: int
    # This router's clock minus the publisher's, plus the fastest delivery seen; None before a live batch.
    publisher_clock_offset_s: float | None


class EventStreamWatch:
    """Per replica: when its event stream last delivered, and what completed since."""

    def __init__(self, probe_grace_s: float = PROBE_GRACE_S, min_probe_interval_s: float = MIN_PROBE_INTERVAL_S) -> None:
        self._probe_grace_s = probe_grace_s
        self._min_probe_interval_s = min_probe_interval_s
        self._lock = threading.Lock()
        self._replicas: dict[ReplicaId, _ReplicaWatch] = {}

    def subscribed(self, replica_id: ReplicaId) -> None:
        """Starts watching a replica, from a clean slate."""
        with self._lock:
            self._replicas[replica_id] = _ReplicaWatch()

    def forget(self, replica_id: ReplicaId) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)

    def batch_received(self, replica_id: ReplicaId, now: float) -> None:
        with self._lock:
            watch = self._replicas.get(replica_id)
            if watch is not None:
                watch.last_batch_at = now
                watch.num_completed_since_batch = 0
                watch.first_completed_at = None
                watch.num_unreachable_in_a_row = 0

    def publisher_clock_read(self, replica_id: ReplicaId, newest_published_at: float, received_at: float) -> None:
        """A live delivery: its newest batch's timestamp (publisher's clock) and when it arrived (`time.time()`)."""
        offset_s = received_at - newest_published_at
        if not math.isfinite(offset_s):
            return
        with self._lock:
            watch = self._replicas.get(replica_id)
            if watch is not None:
                known = watch.clock_offset_s
                if known is None or offset_s > known + CLOCK_STEP_S:  # a step back, or a bogus stamp before
                    watch.clock_offset_s = offset_s
                else:
                    watch.clock_offset_s = min(offset_s, known + CLOCK_OFFSET_RISE_S)

    def on_publisher_clock(self, replica_id: ReplicaId, wall_time: float) -> float:
        """`wall_time` (this router's `time.time()`) as the replica's publisher stamps it; unchanged before its
        first live batch.

        Why: a probe calls a subscription stalled when the replay buffer returns batches published a
        while ago; read on this router's clock, a publisher whose clock runs a few seconds behind made
        every batch look old, and every probe a stall.
        """
        with self._lock:
            watch = self._replicas.get(replica_id)
            offset_s = watch.clock_offset_s if watch is not None else None
        return wall_time if offset_s is None else wall_time - offset_s

    def request_completed(self, replica_id: ReplicaId, now: float) -> None:
        """A request this router sent to the replica finished; replicas not watched are ignored."""
        with self._lock:
            watch = self._replicas.get(replica_id)
            if watch is not None:
                watch.num_completed_since_batch += 1
                if watch.first_completed_at is None:
                    watch.first_completed_at = now

    def due_for_probe(self, now: float) -> list[ReplicaId]:
        """Replicas that finished a request at least the grace period ago with no batch since."""
        with self._lock:
            return [
                replica_id
                for replica_id, watch in self._replicas.items()
                if watch.first_completed_at is not None
                and now - watch.first_completed_at >= self._probe_grace_s
                and (watch.last_probe_at is None or now - watch.last_probe_at >= self._min_probe_interval_s)
            ]

    def probed(self, replica_id: ReplicaId, outcome: ProbeOutcome, num_recovered_batches: int, now: float) -> int:
        """Records a probe. Quiet or stalled: the replica waits for new completions before the next probe;
        unreachable: it is probed again after the interval.

        Returns:
            The unreachable probes in a row this one ends (0 after another outcome, or a batch since).
        """
        with self._lock:
            watch = self._replicas.get(replica_id)
            if watch is None:
                return 0
            watch.last_probe_at = now
            watch.num_probes += 1
            watch.num_recovered_batches += num_recovered_batches
            if outcome == "unreachable":
                watch.num_unreachable += 1
                watch.num_unreachable_in_a_row += 1
                return watch.num_unreachable_in_a_row
            watch.num_unreachable_in_a_row = 0
            if outcome == "stalled":
                watch.num_stalls += 1
            watch.num_completed_since_batch = 0
            watch.first_completed_at = None
            return 0

    def start_window(self, replica_id: ReplicaId, num_stored_blocks: int, num_orphaned_blocks: int) -> None:
        """Starts a window of arriving blocks at the stream's running totals: after a reload, so that the
        replayed blocks' orphans (parents older than the buffer) do not call the stream blind again."""
        with self._lock:
            if (watch := self._replicas.get(replica_id)) is not None:
                watch.stored_mark, watch.orphaned_mark = num_stored_blocks, num_orphaned_blocks

    def looks_blind(self, replica_id: ReplicaId, num_stored_blocks: int, num_orphaned_blocks: int, now: float) -> bool:
        """Whether to reload the replica's state: in the current window of arriving blocks (module
        constants), at least `BLIND_ORPHANED_BLOCKS` orphans arrived and they are at least
        `BLIND_ORPHANED_SHARE` of the window, and the wait after the previous reload has passed.

        A window starts at the last reload, or once `BLIND_WINDOW_BLOCKS` blocks arrived without
        calling the stream blind. Args are the stream's running totals (`StreamSnapshot`); a True
        answer counts as a reload.
        """
        with self._lock:
            watch = self._replicas.get(replica_id)
            if watch is None:
                return False
            num_orphaned = num_orphaned_blocks - watch.orphaned_mark
            num_arrived = num_orphaned + num_stored_blocks - watch.stored_mark
            if num_orphaned < BLIND_ORPHANED_BLOCKS or num_orphaned < BLIND_ORPHANED_SHARE * num_arrived:
                if num_arrived >= BLIND_WINDOW_BLOCKS:
                    watch.stored_mark, watch.orphaned_mark = num_stored_blocks, num_orphaned_blocks
                return False
            if watch.last_reload_at is not None:
                wait_s = min(MIN_RELOAD_INTERVAL_S * 2 ** (watch.num_reloads - 1), MAX_RELOAD_INTERVAL_S)
                if now - watch.last_reload_at < wait_s:
                    return False
            watch.stored_mark, watch.orphaned_mark = num_stored_blocks, num_orphaned_blocks
            watch.last_reload_at = now
            watch.num_reloads += 1
            return True

    def health(self, now: float) -> dict[ReplicaId, StreamHealth]:
        with self._lock:
            return {
                replica_id: StreamHealth(
                    seconds_since_last_batch=None if watch.last_batch_at is None else now - watch.last_batch_at,
                    num_completed_since_batch=watch.num_completed_since_batch,
                    num_probes=watch.num_probes,
                    num_stalls=watch.num_stalls,
                    num_unreachable=watch.num_unreachable,
                    num_recovered_batches=watch.num_recovered_batches,
                    num_reloads=watch.num_reloads,
                    publisher_clock_offset_s=watch.clock_offset_s,
                )
                for replica_id, watch in self._replicas.items()
            }
