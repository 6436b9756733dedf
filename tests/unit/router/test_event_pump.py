"""router.adapter._EventPump against vLLM's real publisher: history on subscribing, and the quiet-stream probe.

The pump's methods are called one at a time (no thread), with a stand-in for
the Serve router that holds only what the pump reads: the running replicas
with their routing stats, the routing lock and the index.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Callable

import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from router import adapter
from router.adapter import _EventPump
from router.events import BufferedBatches, ReplicaEventStream, ZmqEventSource
from router.index import PrefixIndex
from router.types import ReplicaId

BS = 4
A = ReplicaId("a")


def stored(first: int, count: int, age_s: float = 0.0) -> KVEventBatch:
    parent = None if first == 0 else first - 1
    return KVEventBatch(ts=time.time() - age_s, events=[BlockStored(
        block_hashes=[i.to_bytes(32, "big") for i in range(first, first + count)],
        parent_block_hash=None if parent is None else parent.to_bytes(32, "big"),
        token_ids=list(range(first * BS, (first + count) * BS)), block_size=BS, lora_id=None, medium="GPU",
        lora_name=None,
    )])


def indexed_blocks(pump: _EventPump) -> int:
    return pump._router.index.snapshot().num_blocks_by_replica.get(A, 0)


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def new_publisher(tmp_path, suffix: str = "") -> ZmqEventPublisher:
    return ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/pub{suffix}", replay_endpoint=f"ipc://{tmp_path}/replay{suffix}"
    )


def advertised(replica_id: ReplicaId, tmp_path, suffix: str = "", replay_endpoint: str | None = None):
    """A running replica as the router sees it, advertising `new_publisher(tmp_path, suffix)`'s endpoints."""
    stats = {"kv_events_endpoint": f"ipc://{tmp_path}/pub{suffix}",
             "kv_events_replay_endpoint": replay_endpoint or f"ipc://{tmp_path}/replay{suffix}"}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=replica_id), routing_stats=stats)


@pytest.fixture
def publisher(tmp_path):
    pub = new_publisher(tmp_path)
    yield pub
    pub.shutdown()


def make_pump(tmp_path, replay_endpoint: str | None = None) -> _EventPump:
    replica = advertised(A, tmp_path, replay_endpoint=replay_endpoint)
    router = SimpleNamespace(curr_replicas={A: replica}, lock=threading.Lock(), index=PrefixIndex(BS, 1000, "m"))
    return _EventPump(router)


def answered(pump: _EventPump, timeout_s: float = 10.0) -> None:
    """Drains until no request to a replay buffer is waiting for its answer."""
    assert wait_until(lambda: (pump._drain(), not pump._fetches)[1], timeout_s)


def probe_answered(pump: _EventPump) -> None:
    """Makes replica A due for a probe (a request finished a minute ago, no batch since), probes, and drains
    until the replay buffer's answer is in."""
    pump.watch.request_completed(A, time.monotonic() - 60)
    pump._probe_quiet_streams()
    answered(pump)


def subscribe(pump: _EventPump) -> None:
    """Subscribes to the advertised replicas and waits until their replay buffers are loaded (or given up on)."""
    pump._sync_subscriptions()
    answered(pump, timeout_s=90)


def publish_and_drain(publisher: ZmqEventPublisher, pump: _EventPump, first_block: int) -> bool:
    """Publishes block `first_block` (blocks before it published already) and drains; True once the index
    holds every block published."""
    publisher.publish(stored(first_block, 1))
    time.sleep(0.02)
    pump._drain()
    return indexed_blocks(pump) == first_block + 1


@pytest.fixture
def new_pump(tmp_path, publisher):
    """Makes pumps subscribed to `publisher`'s endpoints; closes their sockets after the test."""
    pumps: list[_EventPump] = []

    def make(replay_endpoint: str | None = None) -> _EventPump:
        pumps.append(make_pump(tmp_path, replay_endpoint))
        return pumps[-1]

    yield make
    for pump in pumps:
        for _, source, _ in pump._sources.values():
            source.close()


def published(publisher: ZmqEventPublisher, count: int, timeout_s: float = 10.0) -> None:
    """Waits until the publisher's replay buffer holds `count` batches."""
    assert wait_until(lambda: len(publisher._buffer) >= count, timeout_s)


def test_subscribing_loads_the_replay_buffer(publisher, new_pump):
    publisher.publish(stored(0, 3))
    publisher.publish(stored(3, 2))
    published(publisher, 2)
    pump = new_pump()
    subscribe(pump)
    assert indexed_blocks(pump) == 5
    state = pump.stream_states()[A]
    assert (state["last_seq"], state["num_gaps"], state["num_malformed_msgs"]) == (1, 0, 0)
    publisher.publish(stored(5, 1))
    assert wait_until(lambda: (pump._drain(), indexed_blocks(pump))[1] == 6)
    assert pump.stream_states()[A]["num_gaps"] == 0


def test_a_stalled_subscription_is_recovered_and_resubscribed(tmp_path, publisher, new_pump):
    pump = new_pump()
    subscribe(pump)
    _, source, _ = pump._sources[A]
    # Break the subscription: its SUB now listens where nothing publishes.
    source._sub.close(linger=0)
    source._sub = zmq.Context.instance().socket(zmq.SUB)
    source._sub.setsockopt(zmq.SUBSCRIBE, b"")
    source._sub.connect(f"ipc://{tmp_path}/nobody")
    publisher.publish(stored(0, 4, age_s=30))
    published(publisher, 1)
    pump._drain()
    assert indexed_blocks(pump) == 0
    probe_answered(pump)
    assert indexed_blocks(pump) == 4
    state = pump.stream_states()[A]
    assert (state["num_probes"], state["num_stalls"], state["num_recovered_batches"]) == (1, 1, 1)
    # The new subscription delivers what comes next (a batch sent before it connected: as a gap, replayed).
    next_blocks = iter(range(4, 1000))
    assert wait_until(lambda: publish_and_drain(publisher, pump, next(next_blocks)))


def test_a_batch_published_as_the_probe_runs_is_applied_without_a_stall(publisher, new_pump):
    pump = new_pump()
    subscribe(pump)
    sub_before = pump._sources[A][1]._sub
    publisher.publish(stored(0, 2))
    published(publisher, 1)
    # Probed before draining (the SUB may hold it already): the answer first, then the subscription's own
    # copy, a duplicate, not a restart.
    probe_answered(pump)
    assert indexed_blocks(pump) == 2
    state = pump.stream_states()[A]
    assert (state["num_stalls"], state["num_recovered_batches"]) == (0, 1)
    assert pump._sources[A][1]._sub is sub_before
    pump._drain()
    assert indexed_blocks(pump) == 2 and pump.stream_states()[A]["num_gaps"] == 0


def test_a_publisher_whose_clock_runs_behind_is_no_stall(publisher, new_pump):
    """Its batches are stamped 30 s in the past as they are published: read on the router's clock, a
    batch the probe brings back as it is published looked 30 s old, and every probe a stall."""
    pump = new_pump()
    subscribe(pump)
    publisher.publish(stored(0, 2, age_s=30))
    assert wait_until(lambda: (pump._drain(), indexed_blocks(pump))[1] == 2)  # live: the clocks are read
    assert pump.stream_states()[A]["publisher_clock_offset_s"] >= 30
    publisher.publish(stored(2, 2, age_s=30))
    published(publisher, 2)
    probe_answered(pump)
    assert indexed_blocks(pump) == 4
    state = pump.stream_states()[A]
    assert (state["num_probes"], state["num_stalls"], state["num_recovered_batches"]) == (1, 0, 1)


def test_a_quiet_replica_is_probed_but_left_alone(publisher, new_pump):
    pump = new_pump()
    subscribe(pump)
    sub_before = pump._sources[A][1]._sub
    probe_answered(pump)
    state = pump.stream_states()[A]
    assert (state["num_probes"], state["num_stalls"], state["num_unreachable"]) == (1, 0, 0)
    assert pump._sources[A][1]._sub is sub_before


def test_an_unreachable_publisher_is_reported(tmp_path, publisher, new_pump, caplog, monkeypatch):
    monkeypatch.setattr(adapter, "HISTORY_TIMEOUT_S", 0.2)  # the history load nobody answers gives up at once
    pump = new_pump(replay_endpoint=f"ipc://{tmp_path}/nobody")
    subscribe(pump)
    pump.watch.request_completed(A, time.monotonic() - 60)
    with caplog.at_level("WARNING", logger="ray.serve"):
        pump._probe_quiet_streams()
        answered(pump)
    assert pump.stream_states()[A]["num_unreachable"] == 1
    assert "does not answer" in caplog.text


@pytest.mark.parametrize(("capacity", "num_indexed"), [(None, 1000), (1500, 1200)])
def test_a_replica_whose_kv_cache_is_larger_than_the_index_bound_is_indexed_whole(publisher, new_pump, capacity,
                                                                                   num_indexed):
    """The index's bound (1000 blocks here) rises to the size the replica reports, also when it comes back."""
    pump = new_pump()
    replica = pump._router.curr_replicas[A]
    replica.routing_stats["kv_capacity_blocks"] = capacity
    subscribe(pump)
    publisher.publish(stored(0, 1200))
    assert wait_until(lambda: (pump._drain(), indexed_blocks(pump))[1] == num_indexed)
    pump._router.curr_replicas.clear()
    subscribe(pump)  # dropped, with its index entries
    assert indexed_blocks(pump) == 0
    pump._router.curr_replicas[A] = replica
    subscribe(pump)  # its replay buffer again
    assert indexed_blocks(pump) == num_indexed


def test_a_replica_that_stops_advertising_is_dropped(publisher, new_pump):
    pump = new_pump()
    subscribe(pump)
    assert pump.subscribed_replicas() == [A]
    pump._router.curr_replicas.clear()
    subscribe(pump)
    assert pump.subscribed_replicas() == [] and pump.stream_states() == {}


def test_history_is_applied_only_when_whole(publisher, new_pump, monkeypatch):
    publisher.publish(stored(0, 3))
    published(publisher, 1)
    pump = new_pump()
    monkeypatch.setattr(adapter, "HISTORY_TIMEOUT_S", 0.2)
    monkeypatch.setattr(ZmqEventSource, "collect_buffered", lambda self: None)  # the end marker never comes
    subscribe(pump)
    assert indexed_blocks(pump) == 0
    assert pump.stream_states()[A]["last_seq"] is None


def test_live_batches_during_the_history_load_follow_it_in_order(publisher, new_pump, monkeypatch):
    publisher.publish(stored(0, 3))
    published(publisher, 1)
    pump = new_pump()
    is_answer_held = True
    collect = ZmqEventSource.collect_buffered
    monkeypatch.setattr(ZmqEventSource, "collect_buffered", lambda self: None if is_answer_held else collect(self))
    pump._sync_subscriptions()
    _, source, _ = pump._sources[A]
    num_published = 1
    while not source._sub.poll(50):  # until the subscription holds a live batch
        publisher.publish(stored(2 + num_published, 1))
        num_published += 1
    pump._drain()
    assert indexed_blocks(pump) == 0  # live batches wait for the history
    is_answer_held = False
    assert wait_until(lambda: (pump._drain(), not pump._fetches)[1])
    pump._drain()
    assert indexed_blocks(pump) == 3 + num_published - 1
    state = pump.stream_states()[A]
    assert (state["last_seq"], state["num_gaps"]) == (num_published - 1, 0)


def test_a_history_with_dropped_replies_is_asked_for_again_from_the_hole(publisher, new_pump, monkeypatch):
    for first in range(4):
        publisher.publish(stored(first * 2, 2))
    published(publisher, 4)
    pump = new_pump()
    collect = ZmqEventSource.collect_buffered
    asked: list[int] = []
    request = ZmqEventSource.request_buffered

    def collect_dropping_seq_2(self):
        answer = collect(self)
        if answer is None or asked[-1] != 0:
            return answer
        return BufferedBatches([b for b in answer.batches if b[0] != 2], is_complete=True)

    def record_request(self, start_seq):
        asked.append(start_seq)
        return request(self, start_seq)

    monkeypatch.setattr(ZmqEventSource, "collect_buffered", collect_dropping_seq_2)
    monkeypatch.setattr(ZmqEventSource, "request_buffered", record_request)
    subscribe(pump)
    assert asked == [0, 2]
    assert indexed_blocks(pump) == 8
    assert pump.stream_states()[A]["last_seq"] == 3


def test_a_full_replay_buffer_loads_whole(publisher, new_pump, monkeypatch):
    """10 000 batches: more than vLLM's replay socket sends to one subscriber without dropping some."""
    for first in range(10_000):
        publisher.publish(stored(first, 1))
    # Correctness here, not speed: the history comes in about ten answers of 1,000 batches, and on a
    # busy machine one of them can lose its end marker (the test below), so the bounds are wide.
    published(publisher, 10_000, timeout_s=300)
    monkeypatch.setattr(adapter, "HISTORY_TIMEOUT_S", 300.0)
    pump = new_pump()
    pump._sync_subscriptions()
    answered(pump, timeout_s=330)
    state = pump.stream_states()[A]
    assert (state["last_seq"], state["num_gaps"], state["num_stored_blocks"]) == (9_999, 0, 10_000)


class DroppingDealer:
    """A replay socket whose first `keep` replies arrive and the rest of the answer, end marker included,
    is lost: what vLLM's replay socket does once its send queue to one subscriber is full, as it can be on
    a busy machine when the answer is the last reply of thousands."""

    def __init__(self, dealer: zmq.Socket, keep: int) -> None:
        self._dealer, self._left = dealer, keep

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        while True:
            frames = self._dealer.recv_multipart(flags=flags)  # zmq.Again once nothing is queued
            if self._left > 0:
                self._left -= 1
                return frames

    def close(self, linger: int | None = None) -> None:
        self._dealer.close(linger=linger)


def first_answer_loses_its_end(monkeypatch) -> list[int]:
    """From now on, the first replay request's answer keeps its first 1,000 replies only; returns the list of
    the seqs each request asked from."""
    asked: list[int] = []
    request = ZmqEventSource.request_buffered

    def request_buffered(self, start_seq: int) -> bool:
        asked.append(start_seq)
        sent = request(self, start_seq)
        if len(asked) == 1:
            self._dealer = DroppingDealer(self._dealer, keep=1_000)
        return sent

    monkeypatch.setattr(ZmqEventSource, "request_buffered", request_buffered)
    return asked


def test_a_history_that_lost_its_end_is_asked_for_again_from_where_it_stopped(publisher, new_pump, monkeypatch):
    for first in range(3_000):
        publisher.publish(stored(first, 1))
    published(publisher, 3_000, timeout_s=60)
    monkeypatch.setattr(adapter, "HISTORY_TIMEOUT_S", 60.0)
    asked = first_answer_loses_its_end(monkeypatch)
    pump = new_pump()
    started = time.monotonic()
    subscribe(pump)
    state = pump.stream_states()[A]
    assert (state["last_seq"], state["num_gaps"], state["num_stored_blocks"]) == (2_999, 0, 3_000)
    # From where the first answer stopped; the publisher may drop replies of a later answer as well (its
    # send queue fills on a busy machine), and each is asked for again from where it stopped.
    assert asked[:2] == [0, 1_000] and asked == sorted(set(asked))
    assert time.monotonic() - started < 30  # once its replies stopped, not at the deadline


def test_a_reload_that_lost_its_end_is_asked_for_again_from_where_it_stopped(publisher, new_pump, monkeypatch):
    """A reload's answer, as long as a history's, loses its end the same way: it waited for its deadline, holding
    the replica's live batches, then kept the index blind."""
    for first in range(3_000):
        publisher.publish(stored(first, 1))
    published(publisher, 3_000, timeout_s=60)
    monkeypatch.setattr(adapter, "HISTORY_TIMEOUT_S", 60.0)
    pump = new_pump()
    subscribe(pump)
    _, source, stream = pump._sources[A]
    with pump._router.lock:  # blind after a resync at the newest batch, as `accept` does at a gap
        pump._router.index.clear_replica(A)
        stream._known_from = stream.snapshot().last_seq
    asked = first_answer_loses_its_end(monkeypatch)
    started = time.monotonic()
    pump._reload(A, source, stream)
    answered(pump, timeout_s=60)
    state = pump.stream_states()[A]
    assert asked[:2] == [0, 1_000] and (state["last_seq"], state["num_batches"]) == (2_999, 6_000)  # all again
    assert time.monotonic() - started < 30  # once its replies stopped, not at the deadline


def test_a_replica_whose_blocks_arrive_as_orphans_is_reloaded(publisher, new_pump, monkeypatch):
    """The history could not be loaded (nor when asked again as events came), and every block after the first
    batch extends blocks the index lacks."""
    publisher.publish(stored(0, 4))
    published(publisher, 1)
    pump = new_pump()
    monkeypatch.setattr(adapter, "HISTORY_TIMEOUT_S", 0.2)
    collect = ZmqEventSource.collect_buffered
    monkeypatch.setattr(ZmqEventSource, "collect_buffered", lambda self: None)
    subscribe(pump)  # gives up on the history
    publisher.publish(stored(4, 16))
    assert wait_until(lambda: (pump._drain(), A in pump._fetches)[1])  # its events came: asked again
    answered(pump)  # ... and given up on again
    monkeypatch.setattr(adapter, "HISTORY_TIMEOUT_S", 30.0)
    monkeypatch.setattr(ZmqEventSource, "collect_buffered", collect)
    next_blocks = iter(range(20, 10_000, 16))
    assert wait_until(lambda: (publisher.publish(stored(next(next_blocks), 16)), pump._drain(),
                               pump.stream_states()[A]["num_reloads"] >= 1)[2])
    assert wait_until(lambda: (pump._drain(), not pump._fetches)[1], timeout_s=30)
    state = pump.stream_states()[A]
    assert state["num_orphaned_blocks"] >= 64
    assert indexed_blocks(pump) == state["last_seq"] * 16 + 4  # the root batch and every batch after it


def test_a_reload_keeps_the_index_where_the_replay_buffer_reaches_back_no_further(tmp_path):
    """A shared prompt cached before the buffer's oldest batch: every block extending it arrives as an orphan.
    The reload forgot what the index held (the prompt's sibling chains, learned from the history) and loaded a
    buffer holding none of it, again at every reload."""
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/pub-small",
                                  replay_endpoint=f"ipc://{tmp_path}/replay-small", buffer_steps=4)
    router = SimpleNamespace(curr_replicas={A: advertised(A, tmp_path, "-small")}, lock=threading.Lock(),
                             index=PrefixIndex(BS, 1000, "m"))
    pump = _EventPump(router)
    try:
        publisher.publish(stored(0, 10))
        published(publisher, 1)
        subscribe(pump)
        assert indexed_blocks(pump) == 10 and pump._sources[A][2].known_from == 0
        orphans = iter(range(1000, 100_000, 100))  # each batch's parent was never stored
        assert wait_until(lambda: (publisher.publish(stored(next(orphans), 16)), pump._drain(),
                                   pump.stream_states()[A]["num_reloads"] >= 1)[2])
        answered(pump)
        assert indexed_blocks(pump) == 10  # the buffer's oldest batch is past the run the index holds: kept
        assert pump._sources[A][2].known_from == 0
    finally:
        for _, source, _ in pump._sources.values():
            source.close()
        publisher.shutdown()


B = ReplicaId("b")


@pytest.fixture
def second_publisher(tmp_path):
    pub = new_publisher(tmp_path, "-b")
    yield pub
    pub.shutdown()


def subscribed_after_block_0(publisher: ZmqEventPublisher, new_pump) -> _EventPump:
    """A pump subscribed to replica A once `publisher` published block 0 (loaded from its replay buffer)."""
    publisher.publish(stored(0, 1))
    published(publisher, 1)
    pump = new_pump()
    subscribe(pump)
    return pump


def lose_live_batches(source: ZmqEventSource, monkeypatch, seqs) -> None:
    """The subscription of `source` misses the batches numbered in `seqs`."""
    poll = source.poll_batches
    monkeypatch.setattr(source, "poll_batches", lambda max_msgs: [b for b in poll(max_msgs) if b[0] not in seqs])


def record_requests(source: ZmqEventSource, monkeypatch) -> list[int]:
    """The start seqs of the replay requests `source` sends from now on."""
    asked: list[int] = []
    request = source.request_buffered
    monkeypatch.setattr(source, "request_buffered", lambda start_seq: (asked.append(start_seq), request(start_seq))[1])
    return asked


def lose_batch_1_of_a(pump: _EventPump, monkeypatch) -> Callable[[bool], None]:
    """Replica A's subscription misses batch 1; returns a switch that holds back (True) or lets through
    (False) the answers of A's replay buffer."""
    source = pump._sources[A][1]
    collect = source.collect_buffered
    is_held = [True]
    lose_live_batches(source, monkeypatch, {1})
    monkeypatch.setattr(source, "collect_buffered", lambda: None if is_held[0] else collect())
    return lambda held: is_held.__setitem__(0, held)


def test_a_gap_is_filled_from_the_replay_buffer_while_other_replicas_go_on(
    tmp_path, publisher, second_publisher, new_pump, monkeypatch
):
    publisher.publish(stored(0, 1))
    second_publisher.publish(stored(0, 1))
    published(publisher, 1)
    published(second_publisher, 1)
    pump = new_pump()
    pump._router.curr_replicas[B] = advertised(B, tmp_path, "-b")
    subscribe(pump)
    index = pump._router.index
    assert index.snapshot().num_blocks_by_replica == {A: 1, B: 1}
    hold_answers = lose_batch_1_of_a(pump, monkeypatch)
    monkeypatch.setattr(adapter, "REPLAY_TIMEOUT_S", 60.0)  # the answer is held back by the test, not lost
    publisher.publish(stored(1, 1))
    publisher.publish(stored(2, 1))
    assert wait_until(lambda: (pump._drain(), A in pump._fetches)[1])
    assert pump._fetches[A].kind == "gap"
    # While A waits for its replay buffer, B's events are applied; A's live batch 2 waits for the gap.
    second_publisher.publish(stored(1, 2))
    assert wait_until(lambda: (pump._drain(), index.snapshot().num_blocks_by_replica[B] == 3)[1])
    assert A in pump._fetches and index.snapshot().num_blocks_by_replica[A] == 1
    hold_answers(False)
    answered(pump)
    assert index.snapshot().num_blocks_by_replica[A] == 3
    state = pump.stream_states()[A]
    assert (state["last_seq"], state["num_gaps"], state["num_replayed_gaps"]) == (2, 1, 1)


def test_a_gap_the_replay_buffer_does_not_fill_in_time_resynchronises(publisher, new_pump, monkeypatch):
    pump = subscribed_after_block_0(publisher, new_pump)
    lose_batch_1_of_a(pump, monkeypatch)  # answers held back for good
    monkeypatch.setattr(adapter, "REPLAY_TIMEOUT_S", 0.2)
    publisher.publish(stored(1, 1))
    publisher.publish(stored(2, 1))
    assert wait_until(lambda: (pump._drain(), A in pump._fetches)[1])
    answered(pump)
    state = pump.stream_states()[A]
    # The replica is cleared at the gap, and block 2, whose parent the index lost, is not indexed.
    assert (state["last_seq"], state["num_gaps"], state["num_replayed_gaps"]) == (2, 1, 0)
    assert indexed_blocks(pump) == 0


def test_a_gap_fill_with_dropped_replies_is_asked_for_again_from_the_hole(publisher, new_pump, monkeypatch):
    pump = subscribed_after_block_0(publisher, new_pump)
    source = pump._sources[A][1]
    collect = source.collect_buffered
    asked = record_requests(source, monkeypatch)
    lose_live_batches(source, monkeypatch, {1, 2, 3, 4})

    def collect_dropping_from_seq_3():
        # The first answer to the gap [1, 5) loses its replies from seq 3 on, as past the publisher's send queue.
        answer = collect()
        if answer is None or asked[-1] != 1:
            return answer
        return BufferedBatches([b for b in answer.batches if b[0] < 3], is_complete=True)

    monkeypatch.setattr(source, "collect_buffered", collect_dropping_from_seq_3)
    monkeypatch.setattr(adapter, "REPLAY_TIMEOUT_S", 60.0)
    for first in range(1, 6):
        publisher.publish(stored(first, 1))
    assert wait_until(lambda: (pump._drain(), A in pump._fetches)[1])
    answered(pump)
    assert asked == [1, 3]
    assert indexed_blocks(pump) == 6
    state = pump.stream_states()[A]
    assert (state["last_seq"], state["num_gaps"], state["num_replayed_gaps"]) == (5, 1, 1)


def test_a_gap_longer_than_the_replay_buffer_is_not_asked_for(publisher, new_pump, monkeypatch):
    monkeypatch.setattr(adapter, "DEFAULT_MAX_REPLAY_BATCHES", 1)  # the publisher keeps one batch
    pump = subscribed_after_block_0(publisher, new_pump)
    source = pump._sources[A][1]
    asked = record_requests(source, monkeypatch)
    lose_live_batches(source, monkeypatch, {1, 2})
    for first in range(1, 4):
        publisher.publish(stored(first, 1))
    assert wait_until(lambda: (pump._drain(), pump.stream_states()[A]["last_seq"] == 3)[1])
    assert asked == [] and not pump._fetches
    state = pump.stream_states()[A]
    assert (state["num_gaps"], state["num_replayed_gaps"]) == (1, 0)
    assert indexed_blocks(pump) == 0


def test_a_gap_in_the_middle_of_a_poll_is_filled_after_what_came_before_it(publisher, new_pump, monkeypatch):
    pump = subscribed_after_block_0(publisher, new_pump)
    _, source, stream = pump._sources[A]
    monkeypatch.setattr(source, "poll_batches", lambda max_msgs: [])  # the test hands the pump its batches
    for first in range(1, 4):
        publisher.publish(stored(first, 1))
    published(publisher, 4)
    pump._apply_live(A, source, stream, [(1, stored(1, 1)), (3, stored(3, 1))])
    assert indexed_blocks(pump) == 2 and pump._fetches[A].kind == "gap"  # batch 1 applied, 3 waits for 2
    answered(pump)
    assert indexed_blocks(pump) == 4
    state = pump.stream_states()[A]
    assert (state["last_seq"], state["num_gaps"], state["num_replayed_gaps"]) == (3, 1, 1)


def test_a_replica_advertising_an_endpoint_zmq_refuses_leaves_the_others_subscribed(publisher, tmp_path, caplog):
    bad = ReplicaId("bad")
    broken = SimpleNamespace(replica_id=SimpleNamespace(unique_id=bad),
                             routing_stats={"kv_events_endpoint": "tcp://10.0.0.5", "kv_events_replay_endpoint": None})
    pump = make_pump(tmp_path)
    pump._router.curr_replicas = {bad: broken, A: advertised(A, tmp_path)}
    publisher.publish(stored(0, 3))
    published(publisher, 1)
    try:
        for _ in range(3):
            subscribe(pump)
        assert pump.subscribed_replicas() == [A] and indexed_blocks(pump) == 3
        refusals = [r for r in caplog.records if "cannot subscribe to KV events of replica bad" in r.getMessage()]
        assert len(refusals) == 1  # said once, not at every pass
        broken.routing_stats = {"kv_events_endpoint": f"ipc://{tmp_path}/other", "kv_events_replay_endpoint": None}
        pump._sync_subscriptions()  # new endpoints are tried again
        assert sorted(pump.subscribed_replicas()) == sorted([A, bad])
    finally:
        for _, source, _ in pump._sources.values():
            source.close()


def test_a_replay_endpoint_zmq_refuses_fails_every_request_without_blocking():
    source = ZmqEventSource("ipc:///tmp/warmpath-no-such-publisher", replay_endpoint="tcp://10.0.0.5")
    outcomes = []

    def ask_twice() -> None:
        for _ in range(2):
            try:
                source.request_buffered(0)
                outcomes.append("sent")
            except zmq.ZMQError:
                outcomes.append("refused")

    asker = threading.Thread(target=ask_twice, daemon=True)
    asker.start()
    asker.join(timeout=10)
    source.close()
    assert outcomes == ["refused", "refused"]  # the second did not block on an unconnected socket


class _SizedRouter(SimpleNamespace):
    """The stand-in router, able to change its block size as `PrefixKVRouter` does."""

    use_block_size = adapter.PrefixKVRouter.use_block_size


def test_a_block_size_the_engines_chose_is_the_one_the_router_indexes_in(tmp_path, publisher):
    """vLLM may set another block size than the configured one: indexed in the configured size, every stored block
    was skipped as another size and the router was blind to every replica, saying nothing."""
    from cluster.config import RouterConfig

    engine_bs = 2 * BS
    publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[i.to_bytes(32, "big") for i in range(3)], parent_block_hash=None,
        token_ids=list(range(3 * engine_bs)), block_size=engine_bs, lora_id=None, medium="GPU", lora_name=None,
    )]))
    published(publisher, 1)
    replica = advertised(A, tmp_path)
    replica.routing_stats["block_size"] = engine_bs
    router = _SizedRouter(curr_replicas={A: replica}, lock=threading.Lock(),
                          args=SimpleNamespace(router=RouterConfig(), model_id="m"))
    router.use_block_size(BS)
    pump = _EventPump(router)
    try:
        subscribe(pump)
        assert router.block_size_tokens == engine_bs and router.policy is not None
        assert indexed_blocks(pump) == 3  # the replica's history, replayed into the index of the new size
    finally:
        for _, source, _ in pump._sources.values():
            source.close()


class _BlockCountingLock:
    """The routing lock, recording how many blocks each hold added to the index."""

    def __init__(self, blocks: Callable[[], int]) -> None:
        self._lock, self._blocks, self.added = threading.Lock(), blocks, []

    def __enter__(self):
        self._lock.acquire()
        self._at = self._blocks()

    def __exit__(self, *exc_info):
        self.added.append(self._blocks() - self._at)
        self._lock.release()


def test_a_long_gap_filled_from_the_replay_buffer_is_applied_a_slice_per_hold_of_the_routing_lock(monkeypatch):
    """A gap's batches (up to the 1000 the publisher's send queue answers) were applied in one hold of the lock:
    every routing decision of the process waited hundreds of milliseconds."""
    monkeypatch.setattr(adapter, "LOCK_HOLD_BLOCKS", 1000)
    per_batch, num_missing = 250, 20
    batches = {seq: stored(seq * per_batch, per_batch) for seq in range(num_missing + 2)}
    router = SimpleNamespace(curr_replicas={}, index=PrefixIndex(BS, 10**6, "m"))
    router.lock = _BlockCountingLock(lambda: router.index.snapshot().num_blocks_by_replica.get(A, 0))
    pump = _EventPump(router)
    stream = ReplicaEventStream(A, router.index)
    with router.lock:
        stream.accept(0, batches[0])
    answer = BufferedBatches([(seq, batches[seq]) for seq in range(1, num_missing + 1)], is_complete=True)
    source = SimpleNamespace(request_buffered=lambda start: True, collect_buffered=lambda: answer,
                             poll_batches=lambda limit: [], replies_stopped=lambda *args: False)
    pump._sources[A] = ("endpoint", source, stream)
    pump._apply_live(A, source, stream, [(num_missing + 1, batches[num_missing + 1])])  # after a gap
    assert pump._fetches[A].kind == "gap"
    router.lock.added.clear()
    pump._drain()
    assert not pump._fetches and indexed_blocks(pump) == (num_missing + 2) * per_batch
    assert max(router.lock.added) <= adapter.LOCK_HOLD_BLOCKS + 2 * per_batch  # the last slice, the held batch
    state = stream.snapshot()
    assert (state.last_seq, state.num_gaps, state.num_replayed_gaps) == (num_missing + 1, 1, 1)
