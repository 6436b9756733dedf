"""router.adapter._EventPump recovering a replica's state, against a scripted stand-in for the ZMQ source.

The source answers at once and in the order the test sets, so these tests need
no sockets and no waiting: the pump's methods are called one at a time.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from router import adapter
from router.adapter import _EventPump
from router.events import BufferedBatches, ReplicaEventStream
from router.index import PrefixIndex
from router.types import ReplicaId

BS = 4
A = ReplicaId("a")


def stored(first: int, count: int, age_s: float = 0.0) -> KVEventBatch:
    """Blocks first..first+count-1 of one chain (engine hash i is block i)."""
    parent = None if first == 0 else (first - 1).to_bytes(32, "big")
    return KVEventBatch(ts=time.time() - age_s, events=[BlockStored(
        block_hashes=[i.to_bytes(32, "big") for i in range(first, first + count)], parent_block_hash=parent,
        token_ids=list(range(first * BS, (first + count) * BS)), block_size=BS, lora_id=None, medium="GPU",
        lora_name=None,
    )])


class ScriptedSource:
    """Stands in for `ZmqEventSource`: `buffer` is what the publisher's replay buffer holds, `live` what the
    subscription has received, `dropped[n]` the seqs the n-th answer (from 1) loses on the way."""

    def __init__(self, buffer: list | None = None) -> None:
        self.buffer: list = buffer or []
        self.live: list = []
        self.dropped: dict[int, set[int]] = {}
        self.asked: list[int] = []
        self.num_resubscribes = 0
        self.num_malformed_msgs = 0
        self.has_replay = True
        self.is_answering = True
        self._asked_from: int | None = None

    def poll_batches(self, max_msgs: int) -> list:
        polled, self.live = self.live[:max_msgs], self.live[max_msgs:]
        return polled

    def request_buffered(self, start_seq: int) -> bool:
        self.asked.append(start_seq)
        self._asked_from = start_seq
        return True

    def collect_buffered(self) -> BufferedBatches | None:
        if self._asked_from is None or not self.is_answering:
            return None
        lost = self.dropped.get(len(self.asked), set())
        batches = [(seq, b) for seq, b in self.buffer if seq >= self._asked_from and seq not in lost]
        self._asked_from = None
        return BufferedBatches(batches, is_complete=True)

    def abandon_buffered(self) -> BufferedBatches:
        self._asked_from = None
        return BufferedBatches([], is_complete=False)

    def resubscribe(self) -> None:
        self.num_resubscribes += 1

    def close(self) -> None:
        pass


class CountingLock:
    """The routing lock, counting how often it is taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_holds = 0

    def __enter__(self):
        self._lock.acquire()
        self.num_holds += 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def running(*replica_ids: str) -> dict:
    """Serve's running replicas as the router sees them, advertising no KV-event endpoints."""
    return {r: SimpleNamespace(replica_id=SimpleNamespace(unique_id=r), routing_stats={}) for r in replica_ids}


@pytest.fixture
def pump() -> _EventPump:
    router = SimpleNamespace(curr_replicas=running(A), lock=CountingLock(), index=PrefixIndex(BS, 1000, "m"))
    return _EventPump(router)


def subscribe(pump: _EventPump, source: ScriptedSource) -> ReplicaEventStream:
    """Subscribes the pump to replica A through `source` and loads A's history from it."""
    stream = ReplicaEventStream(A, pump._router.index)
    pump._sources[A] = ("ipc://a", source, stream)
    pump.watch.subscribed(A)
    pump._request_history(A, source)
    pump._drain()
    return stream


def indexed_blocks(pump: _EventPump) -> int:
    return pump._router.index.snapshot().num_blocks_by_replica.get(A, 0)


def drain_until_answered(pump: _EventPump) -> None:
    for _ in range(10):
        pump._drain()
        if not pump._fetches:
            return
    pytest.fail(f"replay requests still open: {pump._fetches}")


def test_a_probe_answer_with_a_hole_is_applied_up_to_it_and_asked_for_again(pump):
    source = ScriptedSource([(0, stored(0, 4))])
    stream = subscribe(pump, source)
    # The subscription stalls while the replica publishes batches 1-4, and the probe's first answer loses batch 2.
    source.buffer += [(seq, stored(3 + seq, 1, age_s=30)) for seq in range(1, 5)]
    source.dropped[2] = {2}
    pump.watch.request_completed(A, time.monotonic() - 60)
    pump._probe_quiet_streams()
    drain_until_answered(pump)
    assert source.asked == [0, 1, 2]
    assert indexed_blocks(pump) == 8
    snapshot = stream.snapshot()
    assert (snapshot.last_seq, snapshot.num_gaps) == (4, 0)
    health = pump.watch.health(time.monotonic())[A]
    assert (health.num_stalls, health.num_recovered_batches) == (1, 4)
    assert source.num_resubscribes == 1


def test_a_batch_missed_after_an_empty_history_is_filled_from_the_replay_buffer(pump):
    source = ScriptedSource()
    stream = subscribe(pump, source)  # the buffer is empty when asked
    # Batch 0 goes out before the subscription joined; the subscription's first batch is 1, extending it.
    source.buffer += [(0, stored(0, 2)), (1, stored(2, 1))]
    source.live.append((1, stored(2, 1)))
    drain_until_answered(pump)
    assert source.asked == [0, 0]
    assert indexed_blocks(pump) == 3
    snapshot = stream.snapshot()
    assert (snapshot.last_seq, snapshot.num_orphaned_blocks, snapshot.num_replayed_gaps) == (1, 0, 1)


def test_a_live_batch_the_index_cannot_apply_does_not_stop_the_ones_after_it(pump):
    source = ScriptedSource([(0, stored(0, 3))])
    stream = subscribe(pump, source)
    poisoned = stored(3, 1)
    poisoned.events[0].token_ids[0] = -1
    source.live += [(1, poisoned), (2, stored(0, 2))]
    drain_until_answered(pump)
    assert indexed_blocks(pump) == 2  # cleared at the bad batch, then batch 2's root blocks
    snapshot = stream.snapshot()
    assert (snapshot.last_seq, snapshot.num_malformed_batches, snapshot.num_gaps) == (2, 1, 0)


def test_index_entries_of_replicas_serve_no_longer_runs_are_dropped_subscribed_or_not(pump):
    index = pump._router.index
    pump._router.curr_replicas = running(A, "b")
    index.add_pending(ReplicaId("b"), [b"x" * 16], time.monotonic(), 60.0)  # placed before it advertised
    index.add_pending(A, [b"y" * 16], time.monotonic(), 60.0)
    pump._sync_subscriptions()
    assert index.replica_ids() == {A, ReplicaId("b")}
    pump._router.curr_replicas = running(A)
    pump._sync_subscriptions()
    assert index.replica_ids() == {A}


def test_events_are_applied_a_bounded_number_of_blocks_per_hold_of_the_routing_lock(pump, monkeypatch):
    monkeypatch.setattr(adapter, "LOCK_HOLD_BLOCKS", 4)
    source = ScriptedSource([(seq, stored(2 * seq, 2)) for seq in range(4)])
    lock = pump._router.lock
    stream = subscribe(pump, source)
    assert indexed_blocks(pump) == 8
    num_holds = lock.num_holds
    source.live += [(seq, stored(2 * seq, 2)) for seq in range(4, 8)]
    pump._drain()
    assert indexed_blocks(pump) == 16 and stream.snapshot().last_seq == 7
    assert lock.num_holds - num_holds == 2  # 8 blocks, 4 per hold


def _unreachable_probe(pump: _EventPump) -> None:
    """A probe whose answer never comes: its deadline has passed by the next drain."""
    pump.watch.request_completed(A, time.monotonic() - 60)
    pump.watch._replicas[A].last_probe_at = None  # due again at once
    pump._probe_quiet_streams()
    pump._fetches[A].deadline = 0.0
    pump._drain()


def test_a_replica_whose_replay_buffer_stays_away_stops_being_credited_until_it_answers(pump):
    """Each unreachable probe resubscribes; the blocks indexed for the replica were kept however long the
    outage lasted, while its engine evicted unseen (the index predicted hits without bound)."""
    source = ScriptedSource([(0, stored(0, 8))])
    subscribe(pump, source)
    assert indexed_blocks(pump) == 8
    source.is_answering = False
    for _ in range(adapter.UNREACHABLE_PROBES_BEFORE_CLEARING - 1):
        _unreachable_probe(pump)
    assert indexed_blocks(pump) == 8  # one slow answer proves little: kept for a while
    _unreachable_probe(pump)
    assert indexed_blocks(pump) == 0
    assert A in pump._fetches and pump._fetches[A].kind == "history"  # asked for again
    source.is_answering = True
    drain_until_answered(pump)
    assert indexed_blocks(pump) == 8  # back as its replay buffer holds it
    assert pump.watch.health(time.monotonic())[A].num_unreachable == adapter.UNREACHABLE_PROBES_BEFORE_CLEARING


def test_a_replica_without_a_replay_buffer_keeps_its_blocks_through_probes(pump):
    """Without a buffer every probe is unreachable at once: that says nothing about the stream."""
    source = ScriptedSource([(0, stored(0, 8))])
    subscribe(pump, source)
    source.has_replay = False
    source.request_buffered = lambda start_seq: False
    for _ in range(adapter.UNREACHABLE_PROBES_BEFORE_CLEARING + 1):
        pump.watch.request_completed(A, time.monotonic() - 60)
        pump.watch._replicas[A].last_probe_at = None
        pump._probe_quiet_streams()
    assert indexed_blocks(pump) == 8


def test_a_batch_between_unreachable_probes_starts_the_count_again(pump):
    source = ScriptedSource([(0, stored(0, 8))])
    subscribe(pump, source)
    source.is_answering = False
    for _ in range(adapter.UNREACHABLE_PROBES_BEFORE_CLEARING - 1):
        _unreachable_probe(pump)
    source.live = [(1, stored(8, 1))]
    source.buffer.append((1, stored(8, 1)))
    pump._drain()
    for _ in range(adapter.UNREACHABLE_PROBES_BEFORE_CLEARING - 1):
        _unreachable_probe(pump)
    assert indexed_blocks(pump) == 9


def test_a_history_given_up_on_is_asked_for_once_more_when_the_replicas_events_come_back(pump):
    """After an outage long enough to forget the replica, its history was asked for once, with a deadline the
    outage outlasted; when the publisher came back, the stream joined from its next live batch and the
    replica's whole cache, in its replay buffer, was never asked for again."""
    source = ScriptedSource([(0, stored(0, 8))])
    subscribe(pump, source)
    source.is_answering = False
    for _ in range(adapter.UNREACHABLE_PROBES_BEFORE_CLEARING):
        _unreachable_probe(pump)
    assert indexed_blocks(pump) == 0
    pump._fetches[A].deadline = 0.0
    pump._drain()  # the history asked for after the outage did not answer in time either
    assert not pump._fetches
    source.is_answering = True  # the publisher is back: its buffer, then a live batch
    source.buffer.append((1, stored(8, 1)))
    source.live = [(1, stored(8, 1))]
    drain_until_answered(pump)
    assert indexed_blocks(pump) == 9  # the whole cache, not the one live batch


def test_a_history_asked_for_again_that_does_not_answer_is_not_asked_for_a_third_time(pump):
    """Else a replica whose replay buffer is broken but whose events flow would drop its live batches for ever."""
    source = ScriptedSource([(0, stored(0, 8))])
    subscribe(pump, source)
    source.is_answering = False
    for _ in range(adapter.UNREACHABLE_PROBES_BEFORE_CLEARING):
        _unreachable_probe(pump)
    pump._fetches[A].deadline = 0.0
    pump._drain()
    source.live = [(1, stored(8, 1))]
    pump._drain()  # events came: the history is asked for again, the batch left to the buffer
    assert A in pump._fetches and pump._fetches[A].is_retry
    pump._fetches[A].deadline = 0.0
    pump._drain()
    source.live = [(2, stored(0, 1))]  # a chain from its root: indexed from live events alone
    pump._drain()
    assert not pump._fetches and indexed_blocks(pump) == 1  # from live events, as before
