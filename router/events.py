"""From vLLM's ZMQ KV-event stream to `PrefixIndex.apply`, with gap detection.

Wire format (vLLM `distributed/kv_events.py`, `ZmqEventPublisher`): each batch
is one multipart message `[topic, seq, payload]`; `seq` is an 8-byte big-endian
unsigned counter starting at 0 per publisher, `payload` a msgpack
`KVEventBatch` (`ts`, `events`, `data_parallel_rank`). The optional replay
socket is a ROUTER: a DEALER sends `[b"", start_seq]` and receives
`[b"", topic, seq, payload]` for every buffered batch with seq >= start_seq
(the last `buffer_steps` batches, 10 000 by default), then
`[b"", b"", END_SEQ, b""]` with END_SEQ = -1 as a signed 8-byte integer.

Resync rule (`ReplicaEventStream.accept`):
- seq == expected (last + 1; 0 for the first batch): apply.
- anything else (joining late, a jump forward, or a restart back to a lower
  seq): the batches [expected, seq) are missing. A gap the publisher's buffer
  can hold (`fillable_gap_before`: at most `max_replay_batches` long) is worth
  asking the replay socket for; if the caller passes the answer to `accept`
  and it holds every missing batch, they are applied in order. Otherwise the
  replica's indexed blocks are cleared (except on the first batch, when there
  is nothing to clear) and the stream starts fresh from this batch. Blocks
  stored before the gap are then unknown and later blocks that extend them are
  skipped (unknown parent): the index under-predicts, never over-predicts.
- After `accept_replayed` (history fetched when subscribing, or batches a
  probe found the subscription had missed), the subscription's own copies of
  those batches are dropped as duplicates until a newer one arrives.
- After a whole history (`start_at`), the first live batch is no longer
  "joining late": the stream knows which seq comes next, so batches the
  subscription missed between the history and its first live batch are a gap
  like any other.
- A batch the index cannot apply (`PrefixIndex.apply` raises) is counted as
  malformed, the replica's blocks are cleared as at a resync, and the stream
  moves past it, so one bad batch never stops the batches after it.

Decoding: a batch holding an event type this vLLM does not know (a newer
publisher) keeps its known events; the unknown ones become `UnknownEvent`,
which `PrefixIndex.apply` skips and counts.

The stream never talks to the network: fetching from the replay socket
(`ZmqEventSource.request_buffered` and `collect_buffered`) is the caller's,
so that one replica's fetch never holds up another's events.

Importing this module does not import vLLM; `make_batch_decoder` does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import msgspec

from router.index import APPLIED_EVENT_TYPES, ApplyResult, PrefixIndex
from router.types import ReplicaId

if TYPE_CHECKING:
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

logger = logging.getLogger("ray.serve")

END_SEQ_BYTES = (-1).to_bytes(8, "big", signed=True)
# vLLM's default `KVEventsConfig.buffer_steps`: how many batches a publisher keeps for replay.
DEFAULT_MAX_REPLAY_BATCHES = 10_000

StreamOutcome = Literal["applied", "replayed", "resynced", "started", "duplicate"]


# Sequence numbers at or past this are malformed (a signed 64-bit count; vLLM's start at 0).
MAX_SEQ = 2**63


class EventDecodeError(ValueError):
    """A message that is not a well-formed `[topic, seq, KVEventBatch]`."""


# The event types the index does not apply that were logged already (once per process each).
_UNKNOWN_TAGS_LOGGED: set[str] = set()


class UnknownEvent:
    """An event of a type this vLLM does not define, kept by its tag so the index can skip and count it."""

    __slots__ = ("tag",)

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __repr__(self) -> str:
        return f"UnknownEvent({self.tag!r})"


class _LooseEventBatch(msgspec.Struct, array_like=True):
    """A `KVEventBatch` with its events left undecoded, to decode them one at a time."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _EventTag(msgspec.Struct):
    """The tag of one encoded event (vLLM's events are tagged maps; the tag field is `type`)."""

    type: str


class BatchDecoder:
    """Decodes vLLM's `KVEventBatch` payloads; a batch with event types it does not know keeps the rest.

    The whole batch is decoded at once when it can be (every batch of a publisher of this vLLM's
    version); only a batch that fails is decoded again event by event. An event whose tag this vLLM
    knows but whose fields do not decode still fails the whole batch: skipping a removal the index
    cannot read would leave it predicting a block the engine no longer holds.
    """

    def __init__(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        self._batch_type = KVEventBatch
        self._whole = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._loose = msgspec.msgpack.Decoder(type=_LooseEventBatch)
        self._tag = msgspec.msgpack.Decoder(type=_EventTag)
        self._event = msgspec.msgpack.Decoder(type=BlockStored | BlockRemoved | AllBlocksCleared)
        self._known_tags = frozenset(t.__name__ for t in (BlockStored, BlockRemoved, AllBlocksCleared))

    def decode(self, payload: bytes) -> KVEventBatch:
        """The batch in `payload`; raises msgspec's `DecodeError` or `ValidationError` if it is none."""
        try:
            return self._whole.decode(payload)
        except msgspec.ValidationError:
            return self._decode_event_by_event(payload)

    def _decode_event_by_event(self, payload: bytes) -> KVEventBatch:
        loose = self._loose.decode(payload)
        events = []
        for raw in loose.events:
            tag = self._tag.decode(raw).type
            events.append(self._event.decode(raw) if tag in self._known_tags else UnknownEvent(tag))
        return self._batch_type(ts=loose.ts, events=events, data_parallel_rank=loose.data_parallel_rank)


def make_batch_decoder() -> BatchDecoder:
    """Decoder for vLLM's `KVEventBatch` payloads (imports vLLM, and with it torch)."""
    return BatchDecoder()


def decode_event_message(frames: Sequence[bytes], decoder: BatchDecoder) -> tuple[int, KVEventBatch]:
    """Decodes one multipart message `[topic, seq, payload]`.

    Args:
        frames: the message's frames, as received by a SUB socket.
        decoder: from `make_batch_decoder`.

    Returns:
        (sequence number, batch); events of types this vLLM does not know are `UnknownEvent`s.

    Raises:
        EventDecodeError: wrong frame count, a seq that is not 8 bytes, or a
            payload that is not a `KVEventBatch`.
    """
    if len(frames) != 3:
        raise EventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    _, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise EventDecodeError(f"sequence frame must be 8 bytes, got {len(seq_bytes)}")
    seq = int.from_bytes(seq_bytes, "big")
    if seq >= MAX_SEQ:  # vLLM counts from 0 by one; past this no `next_seq` fits the replay request's 8 bytes
        raise EventDecodeError(f"sequence number {seq} is past {MAX_SEQ - 1}")
    try:
        batch = decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise EventDecodeError(f"payload is not a KVEventBatch: {err}") from None
    except RecursionError:  # msgspec's own bound on nesting (an `extra_keys` value, an unknown event)
        raise EventDecodeError("payload is not a KVEventBatch: nested too deeply") from None
    return seq, batch


@dataclass(frozen=True, slots=True)
class StreamSnapshot:
    """Stream position and counters. `num_gaps` excludes joining late (the first batch);
    `num_replayed_gaps` counts those of them filled from the replay buffer.

    `num_skipped_blocks` counts stored blocks the index did not place, and
    `num_orphaned_blocks` those of them whose parent it does not know (stored
    before a gap or before the router joined): orphans arriving while little
    else is stored mean the router is blind to that replica.
    `num_malformed_batches` counts batches the index could not apply (each
    cleared the replica's blocks), `num_unknown_events` events of a type this
    vLLM does not define (skipped: a newer publisher's; each new type is logged
    once, since one that removes blocks would leave the index crediting them).
    """

    last_seq: int | None
    num_batches: int
    num_gaps: int
    num_replayed_gaps: int
    num_stored_blocks: int
    num_skipped_blocks: int
    num_orphaned_blocks: int
    num_malformed_batches: int = 0
    num_unknown_events: int = 0


@dataclass(frozen=True, slots=True)
class BufferedBatches:
    """A replay answer: the batches received, and whether the publisher's end marker came too.

    Even a complete answer can have holes: vLLM's replay socket drops replies
    once its send queue to one subscriber is full (1000 messages), and a full
    buffer is 10 000. The first replies are never dropped (the queue starts
    empty), so the answer starts at the oldest batch held from the asked seq on.
    """

    batches: list[tuple[int, KVEventBatch]]
    is_complete: bool

    def leading_run(self) -> list[tuple[int, KVEventBatch]]:
        """The batches in seq order up to the first missing seq."""
        ordered = sorted(self.batches, key=lambda item: item[0])
        for i in range(1, len(ordered)):
            if ordered[i][0] != ordered[i - 1][0] + 1:
                return ordered[:i]
        return ordered


class ReplicaEventStream:
    """Sequence tracking for one replica's event stream; see the module docstring for the rule.

    Invariant: after `accept` returns, every batch with a sequence number up to
    `last_seq` has been applied to the index, or the index holds no block of
    this replica stored before the most recent resync.
    """

    def __init__(
        self, replica_id: ReplicaId, index: PrefixIndex, max_replay_batches: int = DEFAULT_MAX_REPLAY_BATCHES
    ) -> None:
        """Args:
        replica_id: whose events these are.
        index: where to apply them.
        max_replay_batches: how many batches the publisher's replay buffer
            holds (its `buffer_steps`; 0 without a replay socket): a longer
            gap is not worth asking for.
        """
        self.replica_id = replica_id
        self._index = index
        self._max_replay_batches = max_replay_batches
        self._last_seq: int | None = None
        # Where a stream with no batch yet starts, once a whole history said so (`start_at`); None: unknown.
        self._start_seq: int | None = None
        self._replayed_through: int | None = None
        self._replayed_last_ts = 0.0  # the newest timestamp of the batches replayed through `_replayed_through`
        # The first batch of the run the index holds of this replica (every batch since applied, none before
        # it since the replica was last cleared); None: nothing applied since.
        self._known_from: int | None = None
        self._num_batches = 0
        self._num_stored_blocks = 0
        self._num_skipped_blocks = 0
        self._num_orphaned_blocks = 0
        self._num_gaps = 0
        self._num_replayed_gaps = 0
        self._num_malformed_batches = 0
        self._num_unknown_events = 0

    def fillable_gap_before(self, seq: int) -> bool:
        """Whether batches are missing before `seq` that the replay buffer may still hold.

        False for the first batch of a stream whose start is unknown (joining late: the history load is
        what covers that), a duplicate, a batch in order, a restart (seq back down) and a gap longer than
        the buffer.
        """
        if not self._is_position_known() or (self._replayed_through is not None and seq <= self._replayed_through):
            return False
        return self._fits_replay_buffer(seq - self.next_seq())

    def accept(
        self, seq: int, batch: KVEventBatch, replayed: Sequence[tuple[int, KVEventBatch]] = ()
    ) -> StreamOutcome:
        """Applies one received batch, first filling a gap before it from `replayed` or resyncing.

        Args:
            seq, batch: as received.
            replayed: what the replay buffer answered when asked for the
                batches from `next_seq()` on (asked because
                `fillable_gap_before(seq)`); ignored without a gap.

        Returns:
            "applied" (in order), "started" (first batch of a stream whose
            start is unknown, nothing replayed), "replayed" (missing batches
            taken from `replayed` and applied first), "resynced" (the
            replica's blocks were cleared) or "duplicate" (already applied
            from a replay; nothing done).
        """
        if self._replayed_through is not None:
            # The subscription's own copy of a replayed batch is that batch, timestamp and all; a later one at
            # such a seq is a restarted publisher's (seq back down), dropped as a copy it left the old engine's
            # blocks credited and the new engine's unseen.
            if seq <= self._replayed_through and batch.ts <= self._replayed_last_ts:
                return "duplicate"
            self._replayed_through = None
        is_position_known = self._is_position_known()
        expected = self.next_seq()
        outcome: StreamOutcome = "applied"
        if seq != expected:
            if is_position_known:
                self._num_gaps += 1
            missing = self._missing_batches(replayed, expected, seq)
            if missing is not None:
                for missing_batch in missing:
                    self._apply(missing_batch)
                outcome = "replayed"
                if is_position_known:
                    self._num_replayed_gaps += 1
            elif not is_position_known:
                outcome = "started"
            else:
                self._index.clear_replica(self.replica_id)
                self._known_from = seq
                outcome = "resynced"
        if self._known_from is None:
            self._known_from = expected if outcome == "replayed" else seq
        if self._apply(batch).is_cleared:
            self._known_from = seq
        self._last_seq = seq
        return outcome

    def accept_replayed(self, batches: Sequence[tuple[int, KVEventBatch]]) -> int:
        """Applies fetched batches newer than the stream's position, in seq order.

        For batches fetched from the replay buffer outside the normal flow; the
        subscription may still deliver its own copies of them, which `accept`
        then drops. Returns how many batches were applied.
        """
        num_applied = 0
        for seq, batch in sorted(batches, key=lambda item: item[0]):
            if self._last_seq is None or seq > self._last_seq:
                self.accept(seq, batch)
                num_applied += 1
        if num_applied:
            self._replayed_through = self._last_seq
            self._replayed_last_ts = max(batch.ts for _, batch in batches)
        return num_applied

    def next_seq(self) -> int:
        """The sequence number this stream expects next (before the first batch: where `start_at` put it, else 0)."""
        if self._last_seq is not None:
            return self._last_seq + 1
        return self._start_seq or 0

    def start_at(self, seq: int) -> None:
        """Tells a stream with no batch yet that batch `seq` comes next.

        Why: after the replay buffer answered whole, every batch before `seq` is applied (or none was
        published), so a first live batch past `seq` means the subscription missed some, which the
        buffer may still hold; without this the stream would take it as joining late, and every block
        extending the missed ones would be an orphan.
        """
        if self._last_seq is None:
            self._start_seq = seq

    def reset(self) -> None:
        """Forgets the stream position and the replica's blocks (its engine restarted)."""
        self._index.clear_replica(self.replica_id)
        self._last_seq = None
        self._start_seq = None
        self._replayed_through = None
        self._known_from = None

    @property
    def known_from(self) -> int | None:
        """The first batch of the run the index holds of this replica; None when it holds nothing of the stream.

        Why: a replay buffer that reaches back no further cannot give back what the index lacks, and
        reloading from it would forget the blocks learned before the buffer's oldest batch.
        """
        return self._known_from

    def snapshot(self) -> StreamSnapshot:
        """Position and gap counters, for metrics and tests."""
        return StreamSnapshot(
            self._last_seq, self._num_batches, self._num_gaps, self._num_replayed_gaps,
            self._num_stored_blocks, self._num_skipped_blocks, self._num_orphaned_blocks,
            self._num_malformed_batches, self._num_unknown_events,
        )

    def _is_position_known(self) -> bool:
        return self._last_seq is not None or self._start_seq is not None

    def _apply(self, batch: KVEventBatch) -> ApplyResult:
        """Applies one batch; one the index cannot apply clears the replica instead (module docstring)."""
        self._num_batches += 1
        try:
            result = self._index.apply(self.replica_id, batch.events, time.monotonic())
        except Exception:
            self._num_malformed_batches += 1
            logger.warning("KV events of replica %s: a batch the index cannot apply; clearing the replica's blocks",
                           self.replica_id, exc_info=True)
            self._index.clear_replica(self.replica_id)
            return ApplyResult(is_cleared=True)
        self._num_stored_blocks += result.num_stored_blocks
        self._num_skipped_blocks += result.num_skipped_blocks
        self._num_orphaned_blocks += result.num_orphaned_blocks
        if result.num_skipped_events:
            self._num_unknown_events += result.num_skipped_events
            for event in batch.events:
                tag = event.tag if isinstance(event, UnknownEvent) else type(event).__name__
                if tag not in _UNKNOWN_TAGS_LOGGED and tag not in APPLIED_EVENT_TYPES:
                    _UNKNOWN_TAGS_LOGGED.add(tag)
                    logger.warning("KV events of replica %s: skipping events of type %r, which this router does "
                                   "not know (a newer vLLM's?); if they remove blocks, routing over-predicts hits",
                                   self.replica_id, tag)
        return result

    def _fits_replay_buffer(self, num_missing: int) -> bool:
        """Whether a gap of `num_missing` batches is one the publisher's replay buffer can hold."""
        # Batch `stop` (the one that showed the gap) is in the buffer too: it holds `num_missing + 1` of them.
        return 0 < num_missing < self._max_replay_batches

    def _missing_batches(
        self, replayed: Sequence[tuple[int, KVEventBatch]], start: int, stop: int
    ) -> list[KVEventBatch] | None:
        """Batches [start, stop) taken from `replayed`, or None unless it holds every one of them."""
        if not self._fits_replay_buffer(stop - start):
            return None
        wanted = {seq: batch for seq, batch in replayed if start <= seq < stop}
        if len(wanted) != stop - start:
            return None
        return [wanted[seq] for seq in range(start, stop)]


class ZmqEventSource:
    """Non-blocking subscriber to one replica's publisher, for a background thread.

    Owns a SUB socket (and, when a replay endpoint is given, a DEALER for
    replay requests). ZMQ sockets are not thread-safe: one thread calls every
    method. Malformed messages are dropped and counted; the missing sequence
    number then shows up as a gap in `ReplicaEventStream`. One replay request
    is answered at a time: `request_buffered` starts it (giving up on an
    unfinished one), `collect_buffered` or `abandon_buffered` ends it; none of
    them waits.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        context: zmq.Context | None = None,
        decoder: BatchDecoder | None = None,
    ) -> None:
        """Args:
        endpoint: the publisher's PUB address, e.g. "tcp://10.0.0.5:5557".
        topic: topic prefix to subscribe to ("" is all).
        replay_endpoint: the publisher's ROUTER address, or None.
        context: ZMQ context (default: the process-wide instance).
        decoder: from `make_batch_decoder` (default: a new one).
        """
        import zmq

        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self._decoder = decoder or make_batch_decoder()
        self._endpoint = endpoint
        self._topic = topic
        self._sub = self._new_sub()
        self._replay_endpoint = replay_endpoint
        self._dealer: zmq.Socket | None = None
        self._replayed: list[tuple[int, KVEventBatch]] = []
        self._is_replay_pending = False
        self._last_reply_s: float | None = None  # monotonic time of the pending answer's latest reply
        self.num_malformed_msgs = 0

    @property
    def has_replay(self) -> bool:
        """Whether the publisher has a replay buffer to ask (its ROUTER endpoint was advertised)."""
        return self._replay_endpoint is not None

    def _new_sub(self) -> zmq.Socket:
        sub = self._ctx.socket(self._zmq.SUB)
        try:
            sub.setsockopt(self._zmq.SUBSCRIBE, self._topic.encode("utf-8"))
            sub.connect(self._endpoint)
        except BaseException:  # an address ZMQ refuses: no socket left behind
            sub.close(linger=0)
            raise
        return sub

    def poll_batches(self, max_msgs: int) -> list[tuple[int, KVEventBatch]]:
        """Up to `max_msgs` batches already received; never blocks."""
        zmq = self._zmq
        out: list[tuple[int, KVEventBatch]] = []
        for _ in range(max_msgs):
            try:
                frames = self._sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                out.append(decode_event_message(frames, self._decoder))
            except EventDecodeError:
                self.num_malformed_msgs += 1
        return out

    def request_buffered(self, start_seq: int) -> bool:
        """Sends a replay request without waiting (False: no replay endpoint); collect with `collect_buffered`."""
        if self._replay_endpoint is None:
            return False
        if self._is_replay_pending:
            self.abandon_buffered()  # its late replies must not mix into this answer
        if self._dealer is None:
            dealer = self._ctx.socket(self._zmq.DEALER)
            try:
                dealer.setsockopt(self._zmq.RCVHWM, 0)  # never drop replies on this side
                dealer.connect(self._replay_endpoint)
            except BaseException:  # kept unconnected, the next send would block with no peer to take it
                dealer.close(linger=0)
                raise
            self._dealer = dealer
        self._replayed = []
        self._last_reply_s = None
        self._dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        self._is_replay_pending = True
        return True

    def replies_stopped(self, now_s: float, idle_s: float) -> bool:
        """Whether the pending answer's replies began and then none came for `idle_s` (monotonic seconds).

        Why: the publisher's replay socket drops replies while its send queue to this
        subscriber is full, and the end marker is its last reply, so an answer of more
        than the queue holds can lose it; the replies then stop with no end to wait for.
        """
        return self._is_replay_pending and self._last_reply_s is not None and now_s - self._last_reply_s >= idle_s

    def collect_buffered(self) -> BufferedBatches | None:
        """Takes the replies received so far without blocking; the whole answer once its end marker came, else None."""
        zmq = self._zmq
        while self._dealer is not None:
            try:
                frames = self._dealer.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return None
            self._last_reply_s = time.monotonic()
            if len(frames) == 4 and frames[2] == END_SEQ_BYTES:
                answer, self._replayed = BufferedBatches(self._replayed, is_complete=True), []
                self._is_replay_pending = False
                return answer
            try:
                self._replayed.append(decode_event_message(frames[1:], self._decoder))
            except EventDecodeError:
                self.num_malformed_msgs += 1
        return None

    def abandon_buffered(self) -> BufferedBatches:
        """Gives up on the pending answer: returns what came, and discards the DEALER so late replies cannot
        leak into the next request."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        answer, self._replayed = BufferedBatches(self._replayed, is_complete=False), []
        self._is_replay_pending = False
        return answer

    def resubscribe(self) -> None:
        """Replaces the SUB socket with a new connection; whatever the old one had queued is dropped."""
        self._sub.close(linger=0)
        self._sub = self._new_sub()

    def close(self) -> None:
        """Closes the sockets without waiting for unsent messages; the context stays open."""
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
