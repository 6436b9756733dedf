"""`PrefixKVRouter`: the prefix-aware policy as a Ray Serve request router.

The only module of `router/` that imports `ray.serve`. Ray Serve creates one
router per deployment handle in the caller's process (the OpenAI ingress, the
orchestrator), so each such process keeps its own exact index, fed by every
replica's KV events.

Threads and ordering:
- A daemon thread (`_EventPump`) owns the ZMQ sockets: it subscribes to each
  replica as soon as the replica advertises its endpoints in its routing stats
  (loading what the replica's replay buffer still holds), drains events into
  the `PrefixIndex`, probes subscriptions that went quiet while their replica
  served requests, reloads a replica whose blocks keep arriving as orphans,
  expires pending placements (so that work stays off the decision path), and
  drops a replica's sockets and index entries when the replica leaves the
  running set (index entries too of replicas it never subscribed to: a
  placement recorded before the replica advertised its endpoints). It never
  waits on one replica: a request to a replay buffer (history, a gap to fill,
  a probe) is answered on a later pass, and until then that replica's live
  batches stay queued in its socket, in order. It applies events a slice of
  about `LOCK_HOLD_BLOCKS` blocks per hold of the routing lock.
- A second daemon thread loads the tokenizer (`PromptTokenizer.start_loading`);
  until it is loaded, requests are routed by load.
- `choose_replicas` runs on Serve's event loop. It tokenizes the request with
  the engine's tokenizer and chat template, and the rendering settings the
  replicas advertise (`router.prompt_tokens.EngineRendering`), hands those
  ids to the engine with the request (`router.prompt_tokens.ForwardedTokenIds`,
  a chat request the engine would render alike only, when the config
  allows; a request placed again has its earlier ids taken back first), then
  decides under the same lock the pump takes to apply events, so a decision
  never sees half a batch. It makes no blocking remote calls.
- Serve hands each request the replica chosen for it: the router takes no
  `FIFOMixin`, which would give the first replica found to the oldest
  waiting request whatever its prefix (Ray's own prefix-aware router takes
  none either). Routing tasks still start in arrival order.
- Each decision is kept in `router.decision_log.DECISIONS` under the request
  id and Serve's internal request id, where the HTTP ingress (same process)
  reads it to set `x-warmpath-route` and `x-warmpath-predicted-cached-tokens`.

Ray Serve ships the router class to every handle by pickling this module by
value, so module-level state here must be picklable: anything shared with
other code (the decision log) lives in other modules, imported by reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import threading
import time
from collections import OrderedDict
from typing import Any, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from cluster.config import RouterConfig
from router import decision_log
from router.events import DEFAULT_MAX_REPLAY_BATCHES, BufferedBatches, ReplicaEventStream, ZmqEventSource
from router.index import PrefixIndex
from router.inflight import InflightRequests
from router.policy import PrefixAwarePolicy
from router.prompt_tokens import (
    EngineRendering,
    ForwardedTokenIds,
    PromptTokenizer,
    is_forwardable,
    load_pretrained,
    prompt_chars,
    session_of,
)
from router.stream_watch import UNREACHABLE_PROBES_BEFORE_CLEARING, EventStreamWatch
from router.types import Decision, ReplicaId, ReplicaLoad, RoutingRequest

from ray.util.metrics import Counter
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

logger = logging.getLogger("ray.serve")

MAX_SESSIONS = 100_000
# Characters per token past which a prompt cannot fit the engines' window (text runs about four; only long
# runs of one character come near this), so it is not rendered for routing.
MAX_CHARS_PER_TOKEN = 16
# The replica methods whose requests prefill a prompt (LLMServer.chat, .completions).
PREFIX_ROUTED_METHODS = frozenset({"chat", "completions"})
MAX_DECISIONS = 4096
# Blocks of KV events (stored or removed) applied per hold of the routing lock, so that a backlog of
# batches never holds up routing for long (a few ms); a batch is never split.
LOCK_HOLD_BLOCKS = 8192
# A batch published this recently may still be on its way to the subscription.
IN_FLIGHT_S = 1.0
# How long a new subscription waits for the replica's replay buffer (up to 10 000 batches)
# before starting from live events; the pump serves the other replicas meanwhile.
HISTORY_TIMEOUT_S = 5.0
# How long filling a gap or probing a quiet subscription waits for the replay buffer.
REPLAY_TIMEOUT_S = 0.5
# A history answer whose replies stopped this long ago lost its end marker (`ZmqEventSource.replies_stopped`):
# it is used as far as it goes and asked for again from there.
REPLY_IDLE_S = 0.5


class RouterArgs(BaseModel):
    """`request_router_kwargs` of the LLM deployment, validated once per router."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    router: RouterConfig = Field(description="Policy, weights and bounds.")
    model_id: str = Field(description="Model name; roots the block hash chains.")
    model_source: str = Field(description="Folder or hub id whose tokenizer and chat template the engines use.")
    tokenizer_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="`from_pretrained` arguments of that tokenizer (`ClusterConfig.tokenizer_kwargs`)."
    )
    block_size_tokens: int = Field(description="The engines' KV block size.", ge=1)
    max_model_len_tokens: Optional[int] = Field(
        None, ge=1, description="The engines' context window: a prompt far longer is routed by load, untokenized."
    )


class _RecentIds:
    """The last `capacity` ids added, for counting a request once however often Serve asks to place it."""

    def __init__(self, capacity: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def add(self, request_id: str) -> bool:
        """Adds `request_id`; False when it was there already."""
        if request_id in self._ids:
            return False
        self._ids[request_id] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)
        return True


class _BoundedSessions(OrderedDict):
    """Session id -> last replica, least recently routed sessions forgotten first."""

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > MAX_SESSIONS:
            self.popitem(last=False)


@dataclasses.dataclass
class _Fetch:
    """A request to one replica's replay buffer that `_EventPump._drain` has yet to answer.

    `history` loads the buffer on subscribing or reloading, `gap` fills the batches missing before
    `held` (the live batches received after the gap), `probe` checks a subscription gone quiet; a probe
    asked again from a hole in its answer keeps what it recovered so far and whether it saw a stall.
    """

    kind: Literal["history", "gap", "probe", "reload"]
    deadline: float
    held: list = dataclasses.field(default_factory=list)
    num_recovered: int = 0
    is_stalled: bool = False
    is_retry: bool = False  # a history asked for again as the replica's events came back (`_history_wanted`)


def _num_blocks(batch: Any) -> int:
    """What applying a batch costs: the blocks its events name (an event naming none counts one)."""
    return sum(len(getattr(event, "block_hashes", ())) or 1 for event in batch.events)


def _slices_by_blocks(batches: list) -> list[list]:
    """`batches` in consecutive slices of about `LOCK_HOLD_BLOCKS` blocks each (at least one batch each)."""
    slices: list[list] = []
    budget = 0
    for item in batches:
        if budget <= 0:
            slices.append([])
            budget = LOCK_HOLD_BLOCKS
        slices[-1].append(item)
        budget -= _num_blocks(item[1])
    return slices


class _EventPump(threading.Thread):
    """Keeps one ZMQ subscription per advertised replica and applies its events.

    A new subscription first loads the replica's replay buffer (what it cached
    before this router existed); a subscription that goes quiet while its
    replica serves requests is probed through the same buffer, and a replica
    whose stored blocks keep arriving as orphans is reloaded from it
    (`router.stream_watch`). A gap in a stream is filled from the buffer too.
    """

    def __init__(self, router: "PrefixKVRouter") -> None:
        super().__init__(name="warmpath-kv-events", daemon=True)
        self._router = router
        self._sources: dict[ReplicaId, tuple[str, ZmqEventSource, ReplicaEventStream]] = {}
        # Replicas waiting for an answer from their replay buffer; their live batches wait in the SUB socket.
        self._fetches: dict[ReplicaId, _Fetch] = {}
        # Replicas whose history did not answer in time: asked for once more when their events come back.
        self._history_wanted: set[ReplicaId] = set()
        self.watch = EventStreamWatch()
        # The KV capacity each replica reported, as last given to the index (`PrefixIndex.set_replica_capacity`).
        self._capacities: dict[ReplicaId, int] = {}
        # Replicas whose advertised (endpoint, replay endpoint) ZMQ refused, until they advertise others.
        self._refused: dict[ReplicaId, tuple[str, str | None]] = {}
        self._checks = Counter(
            "warmpath_kv_event_checks", "Checks of KV-event subscriptions by outcome: a probe of a quiet one "
            "(quiet, stalled, unreachable) or a reload of a blind one (blind).", tag_keys=("replica", "outcome"),
        )
        self.is_stopped = False

    def run(self) -> None:
        while not self.is_stopped:
            try:
                self._sync_subscriptions()
                busy = self._drain()
                self._probe_quiet_streams()
                with self._router.lock:
                    self._router.index.expire_pending(time.monotonic())
            except Exception:  # never let one bad replica stop the pump
                logger.exception("kv event pump iteration failed")
                busy = False
            if not busy:
                time.sleep(0.005)

    def _sync_subscriptions(self) -> None:
        router = self._router
        replicas = list(router.curr_replicas.values())
        self._forget_departed({ReplicaId(replica.replica_id.unique_id) for replica in replicas})
        advertised: dict[ReplicaId, tuple[str, str | None]] = {}
        capacities: dict[ReplicaId, int] = {}
        block_sizes: set[int] = set()
        for replica in replicas:
            stats = replica.routing_stats or {}
            endpoint = stats.get("kv_events_endpoint")
            if endpoint:
                advertised[ReplicaId(replica.replica_id.unique_id)] = (endpoint, stats.get("kv_events_replay_endpoint"))
            capacity = stats.get("kv_capacity_blocks")
            if isinstance(capacity, int) and capacity > 0:
                capacities[ReplicaId(replica.replica_id.unique_id)] = capacity
            block_size = stats.get("block_size")
            if isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0:
                block_sizes.add(block_size)
        if len(block_sizes) == 1 and (engine_size := next(iter(block_sizes))) != router.block_size_tokens:
            # vLLM chose another block size than the configured one (hybrid models, some CPU attention
            # backends): indexed in the configured size, every stored block would be skipped as another
            # size, and the router would be blind to every replica without a word.
            logger.warning("the replicas' engines use %d-token KV blocks, not the %d configured: the router "
                           "hashes in %d-token blocks from now on", engine_size, router.block_size_tokens, engine_size)
            for replica_id in list(self._sources):
                self._unsubscribe(replica_id)
            self._capacities.clear()  # set again on the new index below
            with router.lock:
                router.use_block_size(engine_size)
        for replica_id in [r for r in self._sources if r not in advertised or advertised[r][0] != self._sources[r][0]]:
            self._unsubscribe(replica_id)
            with router.lock:
                router.index.remove_replica(replica_id)
        for replica_id, capacity in capacities.items():
            if self._capacities.get(replica_id) != capacity:
                self._capacities[replica_id] = capacity
                with router.lock:
                    router.index.set_replica_capacity(replica_id, capacity)
        for replica_id in self._refused.keys() - advertised.keys():
            del self._refused[replica_id]
        for replica_id, endpoints in advertised.items():
            if replica_id in self._sources or self._refused.get(replica_id) == endpoints:
                continue
            self._subscribe(replica_id, *endpoints)

    def _unsubscribe(self, replica_id: ReplicaId) -> None:
        """Closes a replica's subscription and forgets what was fetched and heard from it."""
        _, source, _ = self._sources.pop(replica_id)
        source.close()
        self.watch.forget(replica_id)
        self._fetches.pop(replica_id, None)
        self._history_wanted.discard(replica_id)
        self._capacities.pop(replica_id, None)

    def _subscribe(self, replica_id: ReplicaId, endpoint: str, replay_endpoint: str | None) -> None:
        """Subscribes to one replica; endpoints ZMQ refuses leave it routed by load, said once, tried again
        only when the replica advertises others (the other replicas' events go on)."""
        source = None
        try:
            source = ZmqEventSource(endpoint, replay_endpoint=replay_endpoint)
            self._request_history(replica_id, source)
        except Exception as err:
            if source is not None:
                source.close()
            self._refused[replica_id] = (endpoint, replay_endpoint)
            logger.warning(
                "cannot subscribe to KV events of replica %s at %s (replay %s): %s; it is routed without its cache "
                "contents until it advertises other endpoints", replica_id, endpoint, replay_endpoint, err,
            )
            return
        stream = ReplicaEventStream(replica_id, self._router.index, DEFAULT_MAX_REPLAY_BATCHES if replay_endpoint else 0)
        self._sources[replica_id] = (endpoint, source, stream)
        self.watch.subscribed(replica_id)
        logger.info("subscribed to KV events of replica %s at %s", replica_id, endpoint)

    def _forget_departed(self, running: set[ReplicaId]) -> None:
        """Drops the index entries of replicas Serve no longer runs, subscribed or not.

        A replica can be in the index without a subscription: a placement recorded on it before it
        advertised its endpoints (its first routing stats come seconds after it starts), or after the
        pump dropped it (a fallback Serve reported late).
        """
        for replica_id in self._capacities.keys() - running:
            del self._capacities[replica_id]
        with self._router.lock:
            for replica_id in self._router.index.replica_ids() - running:
                self._router.index.remove_replica(replica_id)

    def _request_history(self, replica_id: ReplicaId, source: ZmqEventSource, is_retry: bool = False) -> None:
        """Asks for the replica's whole replay buffer; `_drain` holds its live batches until `_load_history` is done."""
        if source.request_buffered(0):
            self._fetches[replica_id] = _Fetch("history", time.monotonic() + HISTORY_TIMEOUT_S, is_retry=is_retry)

    def _load_history(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream,
                      fetch: _Fetch, answer: BufferedBatches) -> None:
        """Applies the replica's replay buffer if it came whole; asks again from a hole in it.

        Live batches wait in the SUB socket meanwhile, so they follow the history in order. An answer cut
        off by the deadline is not applied (it would end at an old state, blocks evicted since); one with a
        hole (replies the publisher dropped), or whose replies stopped before its end marker came (dropped
        the same way), is applied up to the hole and asked for again from there. If
        the deadline passes between the two, the first live batch is a gap, which `_drain` fills from the
        buffer or resolves by clearing the replica: the index may under-predict, never over-predict.
        A whole answer also tells the stream where it starts (`ReplicaEventStream.start_at`), so a first
        live batch past it is a gap too, even after an empty buffer.
        """
        if not answer.is_complete and time.monotonic() >= fetch.deadline:
            if fetch.is_retry:
                logger.warning("replay buffer of replica %s did not answer in time again; going on from live events",
                               replica_id)
            else:
                # Asked once more when the replica's events come back (`_drain`): after an outage its buffer
                # holds the replica's whole cache, which live events alone would never rebuild.
                self._history_wanted.add(replica_id)
                logger.warning("replay buffer of replica %s did not answer in time; asking again when its events "
                               "come back", replica_id)
            return
        self._history_wanted.discard(replica_id)
        run = answer.leading_run()
        self._apply_replayed(stream, run)
        if (len(run) < len(answer.batches) or not answer.is_complete) and time.monotonic() < fetch.deadline:
            # The publisher dropped replies past its send queue's limit, maybe its end marker too:
            # ask again from the first one missing.
            self._ask_again_from_the_hole(replica_id, source, stream, fetch)
            return
        stream.start_at(stream.next_seq())
        last_seq = stream.snapshot().last_seq
        logger.info("KV events of replica %s: %s", replica_id, "replay buffer empty" if last_seq is None
                    else f"loaded batches 0-{last_seq} from its replay buffer")

    def _apply_replayed(self, stream: ReplicaEventStream, batches: list) -> int:
        """Applies fetched batches in seq order a slice at a time, so routing never waits on a long history."""
        num_applied = 0
        for batch_slice in _slices_by_blocks(sorted(batches, key=lambda item: item[0])):
            with self._router.lock:
                num_applied += stream.accept_replayed(batch_slice)
        return num_applied

    def _drain(self) -> bool:
        """One pass over the subscriptions: answers that arrived, then live batches; never waits on a replica."""
        busy = False
        for replica_id, (_, source, stream) in list(self._sources.items()):
            fetch = self._fetches.get(replica_id)
            if fetch is not None:
                answer = source.collect_buffered()
                if answer is None and time.monotonic() < fetch.deadline and not self._lost_its_end(fetch, source):
                    continue
                busy = True
                self._finish_fetch(
                    replica_id, source, stream, fetch, answer if answer is not None else source.abandon_buffered()
                )
                if replica_id in self._fetches:
                    continue
            batches = source.poll_batches(256)
            if not batches:
                continue
            busy = True
            if replica_id in self._history_wanted:
                # Its events are back, and its replay buffer with them: load the whole state, these batches
                # included (the buffer holds them), rather than join from them with the rest unknown.
                self._history_wanted.discard(replica_id)
                with self._router.lock:
                    stream.reset()
                self._request_history(replica_id, source, is_retry=True)
                continue
            self.watch.batch_received(replica_id, time.monotonic())
            self.watch.publisher_clock_read(replica_id, max(batch.ts for _, batch in batches), time.time())
            self._apply_live(replica_id, source, stream, batches)
        return busy

    @staticmethod
    def _lost_its_end(fetch: _Fetch, source: ZmqEventSource) -> bool:
        """A history answer whose replies stopped without the end marker (`REPLY_IDLE_S`).

        Only histories and reloads (a history asked for again): they are the answers longer than the
        publisher's send queue (a full buffer is 10 000 batches), and they wait seconds; a gap or a
        probe has its short deadline.
        """
        return fetch.kind in ("history", "reload") and source.replies_stopped(time.monotonic(), REPLY_IDLE_S)

    def _finish_fetch(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream,
                      fetch: _Fetch, answer: BufferedBatches) -> None:
        """Uses a replay answer, whole or cut off by its deadline, for what it was asked for."""
        del self._fetches[replica_id]
        if fetch.kind == "history":
            self._load_history(replica_id, source, stream, fetch, answer)
            return
        if fetch.kind == "probe":
            self._end_probe(replica_id, source, stream, fetch, answer)
            return
        if fetch.kind == "reload":
            self._end_reload(replica_id, source, stream, fetch, answer)
            return
        if not self._fill_gap_in_slices(replica_id, source, stream, fetch, answer):
            self._apply_live(replica_id, source, stream, fetch.held, answer.batches)

    def _fill_gap_in_slices(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream,
                            fetch: _Fetch, answer: BufferedBatches) -> bool:
        """Fills a gap from an answer a slice of the routing lock at a time: whole, then the held batches; or
        its front from an answer with a hole in it, asking again from the hole.

        Why slices: a gap's batches (up to the 1000 the publisher's send queue holds, hundreds of blocks
        each) applied in one hold of the lock stopped every routing decision of the process for
        hundreds of milliseconds. The last slice fills the gap before the first held batch, which counts
        it as filled (`ReplicaEventStream.accept`). An answer to a gap longer than the send queue holds its
        first batches only. False when the answer neither fills the gap nor is such a front (it does not
        start where the gap does, or came too late): `_apply_live` then resynchronises.
        """
        first_held = fetch.held[0][0]
        run = [item for item in answer.leading_run() if item[0] < first_held]
        if not run or run[0][0] != stream.next_seq():
            return False
        if run[-1][0] == first_held - 1:
            *front, last = _slices_by_blocks(run)
            self._apply_replayed(stream, [item for batch_slice in front for item in batch_slice])
            self._apply_live(replica_id, source, stream, fetch.held, last)
            return True
        if not answer.is_complete or time.monotonic() >= fetch.deadline:
            return False
        self._apply_replayed(stream, run)
        self._ask_again_from_the_hole(replica_id, source, stream, fetch)
        return True

    def _ask_again_from_the_hole(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream,
                                 fetch: _Fetch) -> None:
        """Asks the replay buffer again for what `fetch` wanted, from the first batch the stream lacks, by the
        same deadline."""
        source.request_buffered(stream.next_seq())
        self._fetches[replica_id] = fetch

    def _apply_live(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream,
                    batches: list, replayed: list | None = None) -> None:
        """Applies batches in order under the routing lock, then reloads the replica if it looks blind.

        At a gap the replica's replay buffer may fill, it asks the buffer for the missing batches and holds
        the rest in a `_Fetch` instead; `_finish_fetch` brings them back here with the answer as `replayed`,
        which fills the gap before the first of them, or, if batches are missing from it, `accept`
        resynchronises.
        """
        num_applied = self._apply_in_order(stream, batches, replayed)
        if num_applied < len(batches):
            held = batches[num_applied:]
            if source.request_buffered(stream.next_seq()):
                self._fetches[replica_id] = _Fetch("gap", time.monotonic() + REPLAY_TIMEOUT_S, held)
            else:  # no replay socket after all: resynchronise at once
                self._apply_live(replica_id, source, stream, held, [])
            return
        snapshot = stream.snapshot()
        if self.watch.looks_blind(
            replica_id, snapshot.num_stored_blocks, snapshot.num_orphaned_blocks, time.monotonic()
        ):
            self._reload(replica_id, source, stream)

    def _apply_in_order(self, stream: ReplicaEventStream, batches: list, replayed: list | None) -> int:
        """Applies `batches` (`replayed` filling a gap before the first) up to the first gap the replay buffer
        may fill, holding the routing lock for about `LOCK_HOLD_BLOCKS` blocks at a time; returns how many."""
        num_applied = 0
        for batch_slice in _slices_by_blocks(batches):
            with self._router.lock:
                for seq, batch in batch_slice:
                    if replayed is None and stream.fillable_gap_before(seq):
                        return num_applied
                    stream.accept(seq, batch, replayed or ())
                    replayed, num_applied = None, num_applied + 1
        return num_applied

    def _reload(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream) -> None:
        """Asks a replica's replay buffer for its whole state, to load it in place of what the index holds
        if the buffer reaches back further (`_end_reload`); live batches wait meanwhile, as for a history."""
        logger.warning(
            "KV events of replica %s: blocks keep arriving whose parents the router never saw; asking its "
            "replay buffer for its state", replica_id,
        )
        if source.request_buffered(0):
            self._fetches[replica_id] = _Fetch("reload", time.monotonic() + HISTORY_TIMEOUT_S)
        self._checks.inc(tags={"replica": replica_id, "outcome": "blind"})

    def _end_reload(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream,
                    fetch: _Fetch, answer: BufferedBatches) -> None:
        """Loads the replay buffer's state in place of the index's where the buffer starts before the run the
        index holds (`ReplicaEventStream.known_from`); else keeps the index as it is: reset, it would lose
        every block learned before the buffer's oldest batch, and the buffer holds none the index lacks."""
        if not answer.is_complete and time.monotonic() >= fetch.deadline:
            logger.info("KV events of replica %s: its replay buffer did not answer in time: kept as it is", replica_id)
            return
        oldest = min((seq for seq, _ in answer.batches), default=None)
        known_from = stream.known_from
        if oldest is None or (known_from is not None and oldest >= known_from):
            logger.info("KV events of replica %s: its replay buffer starts at batch %s, no earlier than the batches "
                        "the router holds (from %s): kept as it is", replica_id, oldest, known_from)
            return
        with self._router.lock:
            stream.reset()
        self._load_history(replica_id, source, stream, dataclasses.replace(fetch, kind="history"), answer)
        snapshot = stream.snapshot()
        self.watch.start_window(replica_id, snapshot.num_stored_blocks, snapshot.num_orphaned_blocks)

    def _probe_quiet_streams(self) -> None:
        """Asks each replica that went quiet while serving for the batches after the last one received.

        `_drain` takes the answer (`_end_probe`); a replica without a replay endpoint is unreachable at once.
        """
        for replica_id in self.watch.due_for_probe(time.monotonic()):
            if replica_id not in self._sources or replica_id in self._fetches:
                continue
            _, source, stream = self._sources[replica_id]
            fetch = _Fetch("probe", time.monotonic() + REPLAY_TIMEOUT_S)
            if source.request_buffered(stream.next_seq()):
                self._fetches[replica_id] = fetch
            else:
                self._end_probe(replica_id, source, stream, fetch, BufferedBatches([], is_complete=False))

    def _end_probe(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream,
                   fetch: _Fetch, answer: BufferedBatches) -> None:
        """Applies what the probe recovered and names the outcome: stalled, quiet or unreachable.

        An answer with a hole (replies the publisher dropped) is applied up to the hole and asked for
        again from there, by the same deadline, as a history is.
        """
        run = answer.leading_run()
        fetch.num_recovered += self._apply_replayed(stream, run)
        # A batch published as the probe ran may still be on its way; only older ones prove a stall.
        published_before_s = self.watch.on_publisher_clock(replica_id, time.time() - IN_FLIGHT_S)
        fetch.is_stalled = fetch.is_stalled or any(batch.ts < published_before_s for _, batch in answer.batches)
        if answer.is_complete and len(run) < len(answer.batches) and time.monotonic() < fetch.deadline:
            self._ask_again_from_the_hole(replica_id, source, stream, fetch)
            return
        num_recovered = fetch.num_recovered
        if fetch.is_stalled:
            outcome = "stalled"
            logger.warning(
                "KV events of replica %s stopped arriving: recovered %d missed batches from its replay "
                "buffer and resubscribed", replica_id, num_recovered,
            )
            source.resubscribe()
        elif answer.is_complete:
            outcome = "quiet"
        else:
            outcome = "unreachable"
            logger.warning(
                "KV events of replica %s: no batch since its last requests and its replay buffer does not "
                "answer; resubscribing", replica_id,
            )
            source.resubscribe()
        num_in_a_row = self.watch.probed(replica_id, outcome, num_recovered, time.monotonic())
        self._checks.inc(tags={"replica": replica_id, "outcome": outcome})
        if num_in_a_row == UNREACHABLE_PROBES_BEFORE_CLEARING and source.has_replay:
            self._forget_unreachable(replica_id, source, stream)

    def _forget_unreachable(self, replica_id: ReplicaId, source: ZmqEventSource, stream: ReplicaEventStream) -> None:
        """Stops crediting a replica whose events and replay buffer stay away with the blocks indexed for it.

        Why: its engine goes on evicting unseen, so every prediction for it would grow staler for as long
        as the outage lasts; the index may under-predict, never over-predict. Its state is asked for again
        from its replay buffer, which restores it once the publisher answers (or its live events rebuild it).
        """
        logger.warning(
            "KV events of replica %s: its replay buffer did not answer %d probes in a row; the router forgets "
            "what it held there until its events come back", replica_id, UNREACHABLE_PROBES_BEFORE_CLEARING,
        )
        with self._router.lock:
            stream.reset()
        self._request_history(replica_id, source)

    def subscribed_replicas(self) -> list[str]:
        return sorted(self._sources)

    def stream_states(self) -> dict[str, dict[str, Any]]:
        """Per replica: stream position and gaps (pump thread's view) and subscription health."""
        health = self.watch.health(time.monotonic())
        states: dict[str, dict[str, Any]] = {}
        for replica_id, (_, source, stream) in list(self._sources.items()):
            state = dataclasses.asdict(stream.snapshot())
            state["num_malformed_msgs"] = source.num_malformed_msgs
            if replica_id in health:
                state.update(dataclasses.asdict(health[replica_id]))
            states[replica_id] = state
        return states


def _advertised_renderings(replicas: List[RunningReplica]) -> list[Optional[EngineRendering]]:
    """How each replica renders chat prompts, as its routing stats say (None: not yet said)."""
    return [EngineRendering.from_routing_stats(replica.routing_stats) for replica in replicas]


def _shared_rendering(renderings: List[Optional[EngineRendering]]) -> Optional[EngineRendering]:
    """How every candidate renders chat prompts, or None unless all of them advertised the same.

    Why all: the ids forwarded with a request go to whichever candidate Serve ends up sending it to (the
    chosen one may be full), and an engine that gets ids skips its own rendering. During a rolling update
    that changes how replicas render (a server-side template, other template defaults), old and new
    replicas are candidates together; a replica whose first routing stats are still to come has not said.
    """
    first = renderings[0] if renderings else None
    return first if first is not None and all(rendering == first for rendering in renderings) else None


class PrefixKVRouter(RequestRouter):
    """Ranks replicas by exact cached prefix, load and session affinity."""

    def initialize_state(self, **kwargs: Any) -> None:
        args = RouterArgs.model_validate(kwargs)
        self.args = args
        self.lock = threading.Lock()
        self.use_block_size(args.block_size_tokens)
        self.sessions: _BoundedSessions = _BoundedSessions()
        # Requests counted as routed by load, each once: Serve asks again while every replica is full, and
        # retries a rejected attempt, whose completion has ended its placement by then.
        self._counted_by_load = _RecentIds(4096)
        self.tokenizer = PromptTokenizer(args.model_source, functools.partial(load_pretrained, **args.tokenizer_kwargs))
        self.tokenizer.start_loading()
        self._decisions: OrderedDict[str, Decision] = OrderedDict()
        self._inflight = InflightRequests()
        self._forwarded = ForwardedTokenIds()
        self._tie_breaks = random.Random()
        self._pump = _EventPump(self)
        self._pump.start()
        decision_log.LIVE_ROUTERS.add(self)

    def use_block_size(self, block_size_tokens: int) -> None:
        """Indexes and scores in `block_size_tokens`-token blocks, starting from an empty index (under `lock`).

        The configured size at first; the engines' own where vLLM chose another (`_EventPump`
        then subscribes again, so the replicas' caches are replayed into the new index).
        """
        self.block_size_tokens = block_size_tokens
        self.index = PrefixIndex(block_size_tokens, self.args.router.max_blocks_per_replica, self.args.model_id)
        self.policy = PrefixAwarePolicy(self.args.router, block_size_tokens)

    def _loads(self, candidates: List[RunningReplica], pending_request: Optional[PendingRequest] = None
               ) -> dict[ReplicaId, ReplicaLoad]:
        cache = self.replica_queue_len_cache
        deciding = pending_request.metadata.internal_request_id if pending_request is not None else None
        placed = self._inflight.counts(time.monotonic(), deciding)
        loads = {}
        for replica in candidates:
            replica_id = ReplicaId(replica.replica_id.unique_id)
            # Serve's count covers every handle's requests but lags; ours is current but local.
            ongoing = max(int(cache.get(replica.replica_id) or 0), placed.get(replica_id, 0))
            stats = replica.routing_stats or {}
            usage = stats.get("kv_cache_usage")
            loads[replica_id] = ReplicaLoad(
                num_ongoing_requests=ongoing,
                kv_cache_usage=float(usage) if isinstance(usage, (int, float)) and 0 <= usage <= 1 else 0.0,
            )
        return loads

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every candidate is in the tiers returned: when all of them are full, Serve should wait before
            # asking again. Only its locality and multiplex mixins set this; without it Serve asked again at
            # once, re-rendering the prompt and probing every replica in a loop that held its event loop.
            pending_request.routing_context.should_backoff = True
        try:
            return self._choose(candidate_replicas, pending_request)
        except Exception:
            # A routing fault must cost cache hits, never the request: fall back to least loaded.
            logger.exception("prefix-aware routing failed; routing by load for this request")
            return self._least_loaded_first(candidate_replicas, self._loads(candidate_replicas, pending_request),
                                            pending_request, "router-error")

    def _least_loaded_first(
        self, candidates: List[RunningReplica], loads: dict[ReplicaId, ReplicaLoad],
        pending_request: Optional[PendingRequest], cause: Optional[str] = None,
    ) -> List[List[RunningReplica]]:
        """Replicas by load, ties in random order, the request counted in flight on the first.

        Why both: requests routed by load (no tokenizer yet, a prompt that does not render or is
        over the window) read Serve's lagging counts, and a burst of them, all seeing the same
        counts, went to whichever replica Serve listed first. A chat or completion request is
        counted once by `cause` (`decision_log.LOAD_ROUTED_CAUSES`; None for the methods that
        prefill nothing): `/v1/router` shows how many bypassed the prefix, and why.
        """
        ranked = sorted(candidates, key=lambda r: (loads[ReplicaId(r.replica_id.unique_id)].num_requests,
                                                   self._tie_breaks.random()))
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            if cause is not None and pending_request.metadata.call_method in PREFIX_ROUTED_METHODS \
                    and self._counted_by_load.add(request_id):  # asked again (backoff, a rejection): counted once
                decision_log.STATS.count_routed_by_load(cause)
            first = ReplicaId(ranked[0].replica_id.unique_id)
            self._inflight.place(request_id, first, time.monotonic(), False)
        return [[r] for r in ranked]

    def _choose(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest]
    ) -> List[List[RunningReplica]]:
        start_ns = time.time_ns()
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if request is not None:
            self._forwarded.take_back(request)  # an earlier attempt's ids: this one decides afresh
        if pending_request is not None and pending_request.metadata.call_method not in PREFIX_ROUTED_METHODS:
            request = None  # /tokenize and the like prefill nothing: no prefix to match, no placement to record
        window = self.args.max_model_len_tokens
        cause = "no-tokenizer" if not self.tokenizer.is_loaded else "no-prefix"
        if request is not None and window is not None and prompt_chars(request) > window * MAX_CHARS_PER_TOKEN:
            # The engine refuses it (over the window), and rendering megabytes would hold up every other
            # request this router places for seconds.
            request, cause = None, "over-window"
        renderings = _advertised_renderings(candidate_replicas)
        # Rendered as the first replica that said how (one deployment's replicas share their settings).
        rendering = next((r for r in renderings if r is not None), None)
        token_ids = self.tokenizer.token_ids(request, rendering) if request is not None else None
        loads = self._loads(candidate_replicas, pending_request)
        if token_ids is None:
            # Nothing to match on (not a chat/completion call, it does not render, or no tokenizer yet).
            return self._least_loaded_first(candidate_replicas, loads, pending_request, cause)
        if self.args.router.forward_prompt_token_ids and is_forwardable(request, _shared_rendering(renderings)):
            self._forwarded.forward(request, token_ids)
        routing_request = RoutingRequest(
            token_ids, self.args.model_id, session_of(pending_request, request), getattr(request, "cache_salt", None)
        )
        by_id = {ReplicaId(r.replica_id.unique_id): r for r in candidate_replicas}
        previous = self._decisions.get(pending_request.metadata.internal_request_id)
        if previous is not None:
            # Serve asks again (every replica refused it): its own earlier placement must not draw it back.
            self.withdraw(previous)
        with self.lock:
            if previous is not None:  # nor its own earlier choice pass for its session's replica
                self.policy.unrecord_session(previous, self.sessions)
            decision = self.policy.choose(
                routing_request, list(by_id), loads, self.index, self.sessions, time.monotonic()
            )
        logged = decision_log.LoggedDecision(decision, start_ns, time.time_ns())
        metadata = pending_request.metadata
        decision_log.DECISIONS.put(metadata.request_id, metadata.internal_request_id, logged)
        if previous is None:  # Serve's backoff asks again for a request while every replica is full: one count each,
            decision_log.STATS.count_decision(decision.reason)
        elif previous.reason != decision.reason:  # as its latest decision, which a fallback then counts against
            decision_log.STATS.recount(previous.reason, decision.reason)
        self._decisions[pending_request.metadata.internal_request_id] = decision
        self._inflight.place(pending_request.metadata.internal_request_id, decision.replica_id, time.monotonic(), False)
        while len(self._decisions) > MAX_DECISIONS:
            self._decisions.popitem(last=False)
        return [[by_id[r] for r in tier] for tier in decision.ranked_tiers]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        decision = self._decisions.pop(request_id, None)
        self._count_dispatch(request_id, ReplicaId(replica_id.unique_id), result)
        if decision is None or decision.replica_id == replica_id.unique_id:
            return
        # Serve fell back to another replica (the chosen one was full): the placement moves where the request
        # really went. Left on the chosen one, it would credit that replica with blocks it never computes, and
        # every decision it drew there would renew it.
        decision_log.STATS.count_fallback(decision.reason)
        self.withdraw(decision)
        with self.lock:
            self.policy.record(decision, ReplicaId(replica_id.unique_id), self.index, self.sessions, time.monotonic())

    def _count_dispatch(self, request_id: str, replica_id: ReplicaId, result) -> None:
        """Counts the request in flight on the replica Serve sent it to, until `result` is done.

        Why the result: Serve's completions come by request id alone, and a replica that rejected an
        earlier attempt (full) reports that one complete after the retry was placed, maybe sent to the
        same replica (`InflightRequests`). Serve calls the result's callbacks from another thread.
        """
        add_done_callback = getattr(result, "add_done_callback", None)
        serial = self._inflight.dispatch(request_id, replica_id, time.monotonic(),
                                         is_self_ending=add_done_callback is not None)
        if add_done_callback is not None:
            loop = asyncio.get_running_loop()
            add_done_callback(lambda _: loop.call_soon_threadsafe(self._inflight.end_dispatched, request_id, serial))

    def withdraw(self, decision: Decision, replica_id: Optional[str] = None) -> None:
        """Forgets the placement of a decision (`PrefixIndex.withdraw_pending`) whose request the engine refused,
        Serve sent elsewhere, or Serve asks to place again."""
        blocks = decision.request_blocks
        if blocks is None or not blocks.num_blocks:
            return
        with self.lock:
            self.index.withdraw_pending(ReplicaId(replica_id or decision.replica_id), blocks.hashes())
            self.index.forget_placed_prompt(ReplicaId(replica_id or decision.replica_id), blocks)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        # A rejected attempt's completion can come after its retry was placed elsewhere: that one still runs.
        if self._inflight.complete(internal_request_id, ReplicaId(replica_id.unique_id)):
            self._pump.watch.request_completed(ReplicaId(replica_id.unique_id), time.monotonic())

    def snapshot(self) -> dict[str, Any]:
        """State for operators, tests and the bench: replicas (with their KV caches' size and usage as they
        report them), subscriptions and index counts."""
        replica_ids = {replica.unique_id for replica in list(self.curr_replicas)}  # copied whole: the loop may change it
        with self.lock:
            now_s = time.monotonic()
            index = self.index.snapshot(now_s)
            # Of the replicas serving now: a replica gone keeps its sessions' activity until they idle
            active_sessions = {r: n for r, n in self.policy.active_sessions(now_s).items() if r in replica_ids}
        kv_cache, renders_like_router = {}, {}
        for replica in list(self.curr_replicas.values()):
            stats = replica.routing_stats or {}
            replica_id = replica.replica_id.unique_id
            kv_cache[replica_id] = {
                "capacity_blocks": stats.get("kv_capacity_blocks"), "usage": stats.get("kv_cache_usage"),
            }
            # Whether the router may hand it prompt token ids (None until its routing stats say).
            rendering = EngineRendering.from_routing_stats(stats)
            renders_like_router[replica_id] = None if rendering is None else rendering.renders_like_router
        return {
            "policy": self.args.router.policy,
            "replicas": sorted(replica_ids),
            "kv_cache": kv_cache,
            "renders_like_router": renders_like_router,
            "subscribed_replicas": self._pump.subscribed_replicas(),
            "event_streams": self._pump.stream_states(),
            # Sessions with a request within `router.session_idle_s`, by the replica of their last one; and every
            # session whose last replica is remembered (up to MAX_SESSIONS), the idle ones too.
            "num_active_sessions": sum(active_sessions.values()),
            "active_sessions_by_replica": {str(replica): n for replica, n in active_sessions.items()},
            "num_remembered_sessions": len(self.sessions),
            "index": {
                "num_unique_blocks": index.num_unique_blocks,
                "num_blocks_by_replica": dict(index.num_blocks_by_replica),
                "num_pending_blocks_by_replica": dict(index.num_pending_blocks_by_replica),
                "num_evicted_blocks_by_replica": dict(index.num_evicted_blocks_by_replica),
            },
        }

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        with self.lock:
            self.index.remove_replica(ReplicaId(replica_id.unique_id))
