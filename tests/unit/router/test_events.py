"""router.events: wire decoding, sequence gaps and resync, and the ZMQ source against vLLM's publisher."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    ZmqEventPublisher,
)

from router.events import (
    BufferedBatches,
    EventDecodeError,
    ReplicaEventStream,
    ZmqEventSource,
    decode_event_message,
    make_batch_decoder,
)
from router.hashing import hash_request_blocks, root_hash
from router.index import PrefixIndex
from router.types import ReplicaId

BS = 4
MODEL = "warmpath-tiny"
A = ReplicaId("a")
TOKENS = list(range(500, 532))  # 8 full blocks
ENCODER = msgspec.msgpack.Encoder()


def ehash(i: int) -> bytes:
    return i.to_bytes(32, "big")


def stored(first: int, count: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[ehash(i) for i in range(first, first + count)],
        parent_block_hash=None if parent is None else ehash(parent),
        token_ids=TOKENS[first * BS : (first + count) * BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


def frames(seq: int, b: KVEventBatch, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), ENCODER.encode(b)]


def cached_blocks(index: PrefixIndex) -> int:
    return index.longest_prefix(hash_request_blocks(TOKENS, BS, root_hash(MODEL, None)), 0.0).get(A, 0)


def fetch_buffered(source: ZmqEventSource, start_seq: int, timeout_s: float = 5.0) -> BufferedBatches:
    """Asks `source`'s replay socket for the batches from `start_seq` on and waits for the end marker (or gives up
    at the deadline, returning what came)."""
    assert source.request_buffered(start_seq)
    deadline = time.monotonic() + timeout_s
    while (answer := source.collect_buffered()) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return answer if answer is not None else source.abandon_buffered()


@pytest.fixture(scope="module")
def decoder():
    return make_batch_decoder()


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(BS, 1000, MODEL)


@pytest.mark.parametrize(
    "original",
    [
        batch(stored(0, 3)),
        batch(stored(0, 3), BlockRemoved(block_hashes=[ehash(1)], medium="GPU"), AllBlocksCleared()),
        KVEventBatch(ts=1.5, events=[stored(3, 2, parent=2)], data_parallel_rank=1),
        batch(),
    ],
)
@pytest.mark.parametrize("seq", [0, 1, 2**40])
def test_wire_round_trip(decoder, original, seq):
    decoded_seq, decoded = decode_event_message(frames(seq, original), decoder)
    assert decoded_seq == seq
    assert decoded == original


@pytest.mark.parametrize(
    "bad_frames",
    [
        [b"kv", (0).to_bytes(8, "big")],
        [b"kv", b"\x00\x01", ENCODER.encode(batch())],
        [b"kv", (0).to_bytes(8, "big"), b"\xc1not msgpack"],
        [b"kv", (0).to_bytes(8, "big"), ENCODER.encode({"ts": 1})],
    ],
)
def test_malformed_messages_raise(decoder, bad_frames):
    with pytest.raises(EventDecodeError):
        decode_event_message(bad_frames, decoder)


def test_a_payload_nested_past_msgspecs_bound_and_a_seq_past_63_bits_are_malformed(decoder):
    """msgspec raises RecursionError for the one (it passed the decoder: the good batches of that poll were lost,
    and the pump pass ended there); the other made every probe fail to encode its request."""
    nested = ENCODER.encode([1.0, [[0, {"type": "BlockRemoved", "block_hashes": [], "medium": [[[]] * 1]}]]])
    deep = nested.replace(b"\x91\x91\x90", b"\x91" * 100_000 + b"\x90")
    with pytest.raises(EventDecodeError, match="nested too deeply"):
        decode_event_message([b"kv", (0).to_bytes(8, "big"), deep], decoder)
    with pytest.raises(EventDecodeError, match="sequence number"):
        decode_event_message(frames(2**64 - 1, batch()), decoder)


@pytest.mark.parametrize(
    ("seqs_and_batches", "outcomes", "num_cached"),
    [
        # In order from 0.
        ([(0, batch(stored(0, 3))), (1, batch(stored(3, 2, parent=2)))], ["applied", "applied"], 5),
        # Joining late: nothing to clear, start from here.
        ([(7, batch(stored(0, 2)))], ["started"], 2),
        # A gap: the replica is cleared; a block extending a pre-gap parent is skipped.
        ([(0, batch(stored(0, 3))), (2, batch(stored(3, 2, parent=2)))], ["applied", "resynced"], 0),
        # After the gap, fresh root-level blocks are indexed again.
        (
            [(0, batch(stored(0, 3))), (5, batch(stored(3, 1, parent=2))), (6, batch(stored(0, 2)))],
            ["applied", "resynced", "applied"],
            2,
        ),
        # The publisher restarted (seq back to 0): treated as a gap.
        ([(0, batch(stored(0, 4))), (1, batch()), (0, batch())], ["applied", "applied", "resynced"], 0),
    ],
)
def test_stream_gap_rule(index, seqs_and_batches, outcomes, num_cached):
    stream = ReplicaEventStream(A, index)
    assert [stream.accept(seq, b) for seq, b in seqs_and_batches] == outcomes
    assert cached_blocks(index) == num_cached


@pytest.mark.parametrize(
    ("replayed", "outcome", "num_cached", "num_replayed_gaps"),
    [
        # The replay buffer's answer holds the missing batch 1: the gap is filled.
        ([(0, batch(stored(0, 2))), (1, batch(stored(2, 2, parent=1))), (2, batch())], "replayed", 5, 1),
        # In any order.
        ([(1, batch(stored(2, 2, parent=1))), (0, batch())], "replayed", 5, 1),
        # Batch 1 is gone from the buffer: resync.
        ([(0, batch(stored(0, 2))), (2, batch())], "resynced", 0, 0),
        # Nothing asked for, or no answer.
        ((), "resynced", 0, 0),
    ],
)
def test_stream_gap_filled_from_replay(index, replayed, outcome, num_cached, num_replayed_gaps):
    stream = ReplicaEventStream(A, index)
    assert stream.accept(0, batch(stored(0, 2))) == "applied"
    assert stream.fillable_gap_before(2)
    assert stream.accept(2, batch(stored(4, 1, parent=3)), replayed) == outcome
    assert cached_blocks(index) == num_cached
    snapshot = stream.snapshot()
    assert (snapshot.last_seq, snapshot.num_gaps, snapshot.num_replayed_gaps) == (2, 1, num_replayed_gaps)


def test_stream_ignores_a_replay_answer_without_a_gap(index):
    stream = ReplicaEventStream(A, index)
    assert stream.accept(0, batch(stored(0, 2)), [(0, batch(stored(0, 4)))]) == "applied"
    assert stream.accept(1, batch(stored(2, 1, parent=1)), [(5, batch())]) == "applied"
    assert cached_blocks(index) == 3


@pytest.mark.parametrize(
    ("seq", "max_replay_batches", "is_fillable"),
    [
        (4, 4, True),  # batches 1-3 missing: the buffer holds them and batch 4, as many as it holds
        (5, 4, False),  # batches 1-4 missing: with batch 5 one more than it holds, so batch 1 is gone
        (2, 0, False),  # no replay socket
        (1, 4, False),  # in order
        (0, 4, False),  # the publisher restarted
    ],
)
def test_stream_finds_a_gap_worth_asking_for_only_within_the_buffer(index, seq, max_replay_batches, is_fillable):
    stream = ReplicaEventStream(A, index, max_replay_batches=max_replay_batches)
    assert not stream.fillable_gap_before(3)  # nothing received yet: joining late is for the history to cover
    stream.accept(0, batch(stored(0, 1)))
    assert stream.fillable_gap_before(seq) == is_fillable
    # A longer gap is not filled even if an answer comes with it.
    answer = [(s, batch()) for s in range(1, seq)]
    assert stream.accept(seq, batch(), answer) == ("replayed" if is_fillable else "applied" if seq == 1 else "resynced")


def test_stream_finds_no_gap_in_what_a_replay_already_applied(index):
    stream = ReplicaEventStream(A, index)
    stream.accept_replayed([(0, batch()), (1, batch()), (2, batch())])
    assert not stream.fillable_gap_before(1)  # the subscription's own copy: a duplicate
    assert stream.fillable_gap_before(4)


def test_stream_reset_forgets_position_and_blocks(index):
    stream = ReplicaEventStream(A, index)
    stream.accept(0, batch(stored(0, 3)))
    stream.reset()
    assert cached_blocks(index) == 0
    assert stream.accept(9, batch(stored(0, 1))) == "started"


def test_stream_knows_where_the_run_the_index_holds_starts(index):
    """`known_from`: the first batch of the run applied since the replica was last cleared; a reload from a buffer
    starting no earlier would only forget."""
    stream = ReplicaEventStream(A, index)
    assert stream.known_from is None
    stream.accept(5, batch(stored(0, 2)))  # joined late
    stream.accept(6, batch(stored(2, 1, parent=1)))
    assert stream.known_from == 5
    stream.accept(9, batch(stored(3, 1, parent=2)), ())  # a gap nothing filled: cleared, knowledge from 9
    assert stream.known_from == 9
    stream.accept(10, batch(AllBlocksCleared()))  # the engine's cache emptied: all of it known from there
    assert stream.known_from == 10
    stream.reset()
    assert stream.known_from is None


def _publish_until_received(publisher: ZmqEventPublisher, source: ZmqEventSource, deadline_s: float = 10) -> int:
    """Publishes empty probe batches until `source`'s SUB gets one (it is connected then); returns how many
    were published, so the next batch's seq. Probes still in flight arrive later: skip seqs below the count."""
    num_published = 0
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        publisher.publish(batch())
        num_published += 1
        if source.poll_batches(16):
            return num_published
        time.sleep(0.02)
    raise AssertionError("the SUB never received a probe batch")


def test_zmq_source_with_vllm_publisher_and_replay(tmp_path, index):
    """Real vLLM publisher thread (no engine) -> ipc -> ZmqEventSource -> stream -> index."""
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    source = ZmqEventSource(pub_ep, topic="kv", replay_endpoint=replay_ep)
    try:
        first_seq = _publish_until_received(publisher, source)
        sent = [batch(stored(0, 2)), batch(stored(2, 2, parent=1)), batch(stored(4, 4, parent=3))]
        for b in sent:
            publisher.publish(b)
        last_seq = first_seq + len(sent) - 1
        stream = ReplicaEventStream(A, index)
        received = []
        deadline = time.monotonic() + 10
        while (not received or received[-1][0] < last_seq) and time.monotonic() < deadline:
            for seq, b in source.poll_batches(16):
                if seq >= first_seq:  # not a late probe
                    received.append((seq, b))
                    stream.accept(seq, b)
            time.sleep(0.01)
        assert [seq for seq, _ in received] == list(range(first_seq, last_seq + 1))
        assert cached_blocks(index) == 8
        replayed = fetch_buffered(source, first_seq).batches
        assert [seq for seq, _ in replayed] == list(range(first_seq, last_seq + 1))
        assert [b.events for _, b in replayed] == [b.events for b in sent]
        assert source.num_malformed_msgs == 0
    finally:
        source.close()
        publisher.shutdown()


def test_zmq_source_poll_is_non_blocking(tmp_path):
    source = ZmqEventSource(f"ipc://{tmp_path}/nobody")
    outcomes = []

    def calls() -> None:  # no publisher: a blocking receive would wait forever
        outcomes.append(source.poll_batches(10))
        outcomes.append(source.request_buffered(0))  # no replay endpoint configured
        outcomes.append(source.collect_buffered())
        outcomes.append(source.abandon_buffered())

    thread = threading.Thread(target=calls, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "a call blocked"
    source.close()
    assert outcomes == [[], False, None, BufferedBatches([], is_complete=False)]


def test_replayed_batches_are_applied_once(index):
    """History fetched on subscribing, then the subscription's own copies of it: dropped, not a restart."""
    stream = ReplicaEventStream(A, index)
    history = [(1, batch(stored(2, 2, parent=1))), (0, batch(stored(0, 2)))]
    assert stream.accept_replayed(history) == 2
    assert stream.next_seq() == 2
    assert [stream.accept(seq, b) for seq, b in history] == ["duplicate", "duplicate"]
    assert stream.accept(2, batch(stored(4, 1, parent=3))) == "applied"
    assert cached_blocks(index) == 5
    # Once past the replayed range, a lower seq is a publisher restart again.
    assert stream.accept(0, batch()) == "resynced"
    assert cached_blocks(index) == 0


def test_replayed_batches_older_than_the_stream_are_skipped(index):
    stream = ReplicaEventStream(A, index)
    stream.accept(0, batch(stored(0, 2)))
    stream.accept(1, batch(stored(2, 2, parent=1)))
    assert stream.accept_replayed([(0, batch()), (1, batch()), (2, batch(stored(4, 1, parent=3)))]) == 1
    assert stream.next_seq() == 3
    assert cached_blocks(index) == 5
    assert stream.accept_replayed([]) == 0


def test_a_replay_answer_reports_completeness_and_resubscribe_reconnects(tmp_path, index):
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    source = ZmqEventSource(pub_ep, topic="kv", replay_endpoint=replay_ep)
    silent = ZmqEventSource(pub_ep, topic="kv", replay_endpoint=f"ipc://{tmp_path}/nobody")
    try:
        empty = fetch_buffered(source, 0)
        assert empty.batches == [] and empty.is_complete
        publisher.publish(batch(stored(0, 2)))
        deadline = time.monotonic() + 10
        while not (answer := fetch_buffered(source, 0)).batches and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [seq for seq, _ in answer.batches] == [0] and answer.is_complete
        unanswered = fetch_buffered(silent, 0, timeout_s=0.2)
        assert unanswered.batches == [] and not unanswered.is_complete

        source.resubscribe()
        received: list[int] = []
        while not received and time.monotonic() < deadline:
            publisher.publish(batch())  # the new SUB may join after the first few; keep publishing
            received = [seq for seq, _ in source.poll_batches(16)]
            time.sleep(0.02)
        assert received and received[0] >= 1
    finally:
        source.close()
        silent.close()
        publisher.shutdown()


def test_a_new_replay_request_gives_up_on_the_unfinished_one(tmp_path):
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    source = ZmqEventSource(pub_ep, topic="kv", replay_endpoint=replay_ep)
    try:
        for first in range(3):
            publisher.publish(batch(stored(first, 1)))
        deadline = time.monotonic() + 10
        while len(publisher._buffer) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert source.request_buffered(0)
        assert source.request_buffered(2)
        answer = None
        while answer is None and time.monotonic() < deadline:
            answer = source.collect_buffered()
            time.sleep(0.01)
        assert answer is not None and answer.is_complete
        assert [seq for seq, _ in answer.batches] == [2]
        assert source.collect_buffered() is None  # nothing of the first request leaks in later
    finally:
        source.close()
        publisher.shutdown()


def test_joining_after_the_first_batch_without_history_leaves_its_descendants_unplaced(index):
    """Why a new subscription loads the replay buffer: batch 0 holds the shared prefix every later block extends."""
    stream = ReplicaEventStream(A, index)
    assert stream.accept(1, batch(stored(2, 2, parent=1))) == "started"
    assert stream.accept(2, batch(stored(4, 2, parent=3))) == "applied"
    snap = stream.snapshot()
    assert (snap.num_stored_blocks, snap.num_skipped_blocks, snap.num_orphaned_blocks) == (0, 4, 4)
    assert cached_blocks(index) == 0

    with_history = ReplicaEventStream(A, PrefixIndex(BS, 1000, MODEL))
    with_history.accept_replayed([(0, batch(stored(0, 2)))])
    with_history.accept(1, batch(stored(2, 2, parent=1)))
    assert (with_history.snapshot().num_stored_blocks, with_history.snapshot().num_skipped_blocks) == (4, 0)


class _BlockTouched(KVCacheEvent):
    """Stands in for an event type a newer vLLM publishes and this one does not define."""

    block_hashes: list[bytes]


def test_an_unknown_event_type_costs_only_that_event(decoder, index):
    sent = batch(stored(0, 2), _BlockTouched(block_hashes=[ehash(0)]), stored(2, 1, parent=1))
    seq, received = decode_event_message(frames(3, sent), decoder)
    assert seq == 3 and [type(event).__name__ for event in received.events] == [
        "BlockStored", "UnknownEvent", "BlockStored"]
    assert received.events[1].tag == "_BlockTouched" and received.ts == sent.ts
    result = index.apply(A, received.events)
    assert (result.num_stored_blocks, result.num_skipped_events) == (3, 1)


def test_unknown_event_types_are_counted_and_each_logged_once(decoder, index, caplog, monkeypatch):
    """Skipped without a trace, a newer vLLM's event that removes blocks would have left the index crediting
    them with nothing to show why."""
    from router import events

    monkeypatch.setattr(events, "_UNKNOWN_TAGS_LOGGED", set())
    stream = ReplicaEventStream(A, index)
    with caplog.at_level("WARNING", logger="router.events"):
        for seq in range(3):
            _, received = decode_event_message(frames(seq, batch(_BlockTouched(block_hashes=[ehash(0)]))), decoder)
            stream.accept(seq, received)
    assert stream.snapshot().num_unknown_events == 3
    assert caplog.text.count("skipping events of type '_BlockTouched'") == 1


def test_a_known_event_that_does_not_decode_still_fails_its_batch(decoder):
    # Well-formed msgpack, a batch shape, an event tag this vLLM knows, fields it cannot read.
    broken = ENCODER.encode([time.time(), [{"type": "BlockRemoved", "block_hashes": 5, "medium": "GPU"}]])
    with pytest.raises(EventDecodeError):
        decode_event_message([b"kv", (0).to_bytes(8, "big"), broken], decoder)
    unknown = ENCODER.encode([time.time(), [{"type": "BlockTouched", "anything": 5}]])
    assert decode_event_message([b"kv", (0).to_bytes(8, "big"), unknown], decoder)[1].events[0].tag == "BlockTouched"


def poisoned(first: int) -> KVEventBatch:
    """A batch that decodes but that the index cannot apply (a token id outside u32)."""
    event = stored(first, 1, parent=first - 1)
    event.token_ids = [-1] * BS
    return batch(event)


def test_a_batch_the_index_cannot_apply_clears_the_replica_and_the_stream_goes_on(index):
    stream = ReplicaEventStream(A, index)
    assert stream.accept(0, batch(stored(0, 3))) == "applied"
    assert stream.accept(1, poisoned(3)) == "applied"
    assert cached_blocks(index) == 0  # cleared: what the bad batch removed or stored is unknown
    assert stream.accept(2, batch(stored(0, 2))) == "applied"
    assert cached_blocks(index) == 2
    snapshot = stream.snapshot()
    assert (snapshot.last_seq, snapshot.num_gaps, snapshot.num_malformed_batches) == (2, 0, 1)


def test_a_bad_batch_in_a_replay_answer_does_not_stop_the_batches_after_it(index):
    stream = ReplicaEventStream(A, index)
    assert stream.accept_replayed([(0, batch(stored(0, 3))), (1, poisoned(3)), (2, batch(stored(0, 2)))]) == 3
    assert cached_blocks(index) == 2 and stream.snapshot().last_seq == 2


def test_after_a_whole_history_the_first_live_batch_past_it_is_a_gap(index):
    stream = ReplicaEventStream(A, index)
    stream.start_at(0)  # the replay buffer answered whole, and empty
    assert stream.fillable_gap_before(1)  # batch 0 went out before the subscription joined
    assert stream.next_seq() == 0
    assert stream.accept(1, batch(stored(2, 1, parent=1)), [(0, batch(stored(0, 2)))]) == "replayed"
    assert cached_blocks(index) == 3
    snapshot = stream.snapshot()
    assert (snapshot.num_gaps, snapshot.num_replayed_gaps) == (1, 1)


def test_without_a_whole_history_the_first_live_batch_joins_late(index):
    stream = ReplicaEventStream(A, index)
    assert not stream.fillable_gap_before(1)
    assert stream.accept(1, batch(stored(0, 2))) == "started"
    stream.reset()
    stream.start_at(5)
    stream.reset()  # a reload forgets where the stream started
    assert not stream.fillable_gap_before(9)


def test_a_publisher_restarted_after_a_replay_is_resynced_not_dropped_as_copies(index):
    """After a history load, batches at or below the last replayed seq were all taken for the subscription's copies
    of it: an engine restarted on the same endpoints (seq back to 0) had its new blocks dropped, and the old engine's
    stayed credited."""
    stream = ReplicaEventStream(A, index)
    history = [(seq, KVEventBatch(ts=100.0 + seq, events=[])) for seq in range(5)]
    history.append((5, KVEventBatch(ts=105.0, events=[stored(0, 8)])))
    assert stream.accept_replayed(history) == 6
    assert stream.accept(5, history[5][1]) == "duplicate"  # the subscription's own copy of a replayed batch
    assert cached_blocks(index) == 8
    assert stream.accept(0, KVEventBatch(ts=200.0, events=[])) == "resynced"  # newer than every replayed batch
    assert cached_blocks(index) == 0
    assert stream.accept(1, KVEventBatch(ts=201.0, events=[stored(0, 2)])) == "applied"
    assert cached_blocks(index) == 2
