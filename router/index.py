"""`PrefixIndex`: which replica holds which KV block, exactly, from vLLM's KV events.

Why exact: every replica publishes `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` (vLLM `distributed/kv_events.py`). Replaying them gives the
router the engines' prefix caches instead of a guess. Events are re-hashed from
their token ids with `router.hashing`, so engines need no shared hash seed.

Data layout (chosen for bytes per block, see bench/router_decision.py):
- `_owners`: our BlockHash -> bitmask of replica slots holding it (one int per
  block, not a set).
- per replica, `blocks`: engine key -> our BlockHash, in the order stored (a
  plain dict keeps insertion order at a quarter less memory than an
  OrderedDict; a re-store moves the key to the end).
  The engine key is the low 64 bits of vLLM's hash: `BlockRemoved` names blocks
  only by engine hash, and `BlockStored.parent_block_hash` is an engine hash.
- per replica, `extra_copies`: engine key -> number of additional physical
  copies (vLLM does not de-duplicate blocks; each copy is stored and removed
  separately). Sparse: only keys stored more than once appear.
- pending placements: `_pending_owners` (BlockHash -> bitmask) plus, per
  replica, BlockHash -> expiry time, and a heap of expiries. A placement is
  recorded at checkpoint blocks only: every one of the first
  PENDING_DENSE_BLOCKS blocks, then every PENDING_STRIDE_BLOCKS-th, and the
  last. Block hashes chain, so a request that shares a checkpoint shares every
  block before it; a lookup credits the furthest shared checkpoint. That keeps
  recording and expiring an 8k-token placement to about 32 entries instead of
  256, at the price of rounding a partial match of a pending placement down
  to the checkpoint before it (never more than PENDING_STRIDE_BLOCKS - 1).
  The checkpoints other than a placement's last lie on one grid of positions
  (`_is_grid`), and a placement whose last is off the grid is also recorded at
  the grid checkpoint before it, even where the replica holds that block. So a
  lookup reads the grid (about one block in PENDING_STRIDE_BLOCKS) and then
  one stride of blocks after each replica's furthest shared grid checkpoint
  and after each indexed count: the only places a shared last checkpoint can
  be. The one case it misses: a placement's last checkpoint still pending
  after the replica dropped the block of the grid checkpoint before it
  (indexed, then removed); it is credited only as far as the replica's indexed
  prefix, which can be any number of blocks short (never more than it holds),
  until that entry expires. A pending entry on a block the
  replica drops goes with the block: one on a block it held gets no event
  to confirm it, and would credit the replica with the prefix it dropped.

Lookups bisect (`leading_runs`). Along a request's chain, a replica's bit can
only drop, never come back, because vLLM frees a request's blocks tail first,
so it evicts a block only after the blocks that extend it, and every stored
block extends one the index holds. A lookup then costs a few dict reads per
replica that holds part of the chain instead of one per prompt block (a
32k-token prompt is 2,048 blocks at block size 16). Event streams vLLM does
not produce, removing a block before its extensions, would make a lookup step
over the gap: the one way a lookup can credit a block the replica does not
hold.

Invariants:
- Bit s of `_owners[h]` is set only if the replica in slot s has an entry in
  `blocks` whose value is h, and it is set for every such entry except when two
  engine keys of one replica map to the same h (engine-side keys the router
  does not model) and one of them was removed. Masks are never 0 (the key is
  deleted instead).
- `len(blocks) <= max(max_blocks_per_replica, the replica's KV capacity)`
  (`set_replica_capacity`); beyond it the least recently stored block is
  forgotten. This is a safety bound, not a model of the engine: the engine's
  `BlockRemoved` is the normal way blocks leave, and in vLLM's default report
  mode a cache hit announces nothing, so "recent" means recently stored, not
  recently used. Below the engine's number of KV blocks the bound would forget
  blocks the engine holds, the oldest first, which are the hottest of a long
  run (a shared system prompt is stored once and hit ever after), so a replica
  that reports a larger cache raises its own bound to its size. The engine
  evicts a block (`BlockRemoved`) before it stores the one that takes its
  place, so the index never holds more of a replica than its capacity unless
  a removal was lost.
  A block the bound forgets in the middle of a chain does not hide the
  blocks after it from a lookup (the engine, which evicts extensions first,
  still holds it unless a removal was lost); a forgotten first block does.
- Bit s of `_pending_owners[h]` is set iff replica s has a pending entry for h
  that has not been confirmed by a `BlockStored` and not expired (expiry is
  applied by `expire_pending`, which the router's event thread calls, and by
  the next `longest_prefix`, `add_pending` or `snapshot` if anything is due).
- Whatever goes wrong (unknown parent, lost events, unsupported extra keys),
  the index forgets blocks rather than invents them: it may under-predict a
  replica's cache, never over-predict it, except for pending entries (bounded
  by their TTL), the one case noted under `apply`, the out-of-order
  removals noted under the lookup, and an adoption matched to the wrong chain
  (below).

Adoption: a router that joins after a replica cached a prefix (a shared system
prompt is stored once, and the replay buffer keeps only its last batches) gets
every block extending it as an orphan, and would stay blind to that prefix for
as long as the engine holds it. The prompts this router placed are remembered
(`note_placed_prompt`: the last PLACED_PROMPTS_KEPT, rooted in the served model
alone, since a salt or LoRA name is in the engine's first block only; forgotten
where Serve sent them elsewhere). An orphan event of at least
ADOPTION_MIN_BLOCKS blocks (a decode step's one block costs nothing) is matched
against the replica's newest ADOPTION_PROMPTS_SCANNED of them placed within
ADOPTION_WINDOW_S: where its blocks continue exactly one parent, at a block
position of a prompt, for as far as both go, that prompt's block before them is
the parent, which the engine held, and so every block before it (vLLM evicts a
chain from its end). The parent is indexed under its engine key, the blocks
before it under stand-in keys (negative: engine keys never are), shared between
the parents adopted with them (`anchors`, `adopted`, `stand_in_of`; a stand-in
whose block becomes an adopted parent gives way to its engine key) and forgotten
with the last of those parents, when its last copy's removal comes or the bound
forgets it: the engine may still hold them, and the index forgets rather than
invents. The prompt that explained an orphan is not asked again. The orphan
carries no position: another request's blocks, equal to a remembered prompt's
from some block to where one of them ends, adopt that prompt's chain before
them, which the replica may not hold (a document after two other role prompts,
each ending there). That over-prediction lasts until the replica is sent one
request of that chain and caches it, or the adopted parent goes.

Tracked: the engine's own pool only (`medium` None or "GPU", which vLLM uses
on every backend, CPU included), one KV cache group, the index's block size.
The group is the first whose `BlockStored` names a kind that caches whole
prefixes (`full_attention`, `mla_attention`), else group 0 where events name
no kinds: vLLM numbers a hybrid model's groups by their first layer's kind,
so Gemma's group 0 is its sliding-window one, whose blocks leave from the
front of a chain as the window moves (tracked, the index saw every chain cut
at its root and credited nothing). One block hash names a block in every
group, so another group's removals must not reach the tracked one. Not
modelled: a sliding-window group's own hit rule (vLLM also needs the window's
blocks before the hit), so on such a model a lookup can credit more than the
engine reuses where those blocks were evicted first.
Not thread-safe. Events are matched by class name, so this module imports
without vLLM (whose import pulls in torch: about 600 MB and several seconds).
"""

from __future__ import annotations

import heapq
import itertools
import sys
from array import array
from collections import deque
from dataclasses import dataclass
from itertools import compress, islice, repeat
from operator import not_
from typing import Callable, Iterable, Sequence

from router.hashing import BlockHash, RequestBlockHashes, chain_block_hashes, encode_tokens, root_hash
from router.types import ReplicaId

_TRACKED_MEDIA = frozenset({None, "GPU"})
# The event types `PrefixIndex.apply` applies; others it skips and counts.
APPLIED_EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
# KV cache kinds whose blocks stand for a whole prefix: the group the index follows is of one of these.
_PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})
# Adoption (module docstring): prompts remembered, across replicas, and the blocks an orphan must match.
PLACED_PROMPTS_KEPT = 256
ADOPTION_MIN_BLOCKS = 2
ADOPTION_WINDOW_S = 30.0
# The replica's newest placed prompts an orphan is matched against (each a byte search under the routing lock:
# 32 of 32k tokens, about a millisecond); a prefill's orphan follows its placement closely.
ADOPTION_PROMPTS_SCANNED = 32
PENDING_DENSE_BLOCKS = 16
PENDING_STRIDE_BLOCKS = 16
_FIRST_SPARSE = PENDING_DENSE_BLOCKS + PENDING_STRIDE_BLOCKS - 1  # the first grid position past the dense head
_MASK64 = (1 << 64) - 1
_WORD_BYTES = array("Q").itemsize


def _engine_key(block_hash: bytes | int) -> int:
    """Low 64 bits of a vLLM block hash (bytes by default, int when the engine is told so)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash[-8:], "big")


def _engine_keys(block_hashes: Sequence[bytes | int]) -> list[int]:
    """`_engine_key` of each hash; one event's hashes share a type, so it is checked once.

    Hashes of one length, a multiple of 8 (vLLM's are 32 bytes), are read as one
    array of 64-bit words, taking each hash's last word: a few C calls per event
    instead of a slice and an int per block, on every block stored or removed.
    """
    if not block_hashes:
        return []
    first = block_hashes[0]
    if isinstance(first, int):
        return [block_hash & _MASK64 for block_hash in block_hashes]
    size = len(first)
    if size and size % 8 == 0 and _WORD_BYTES == 8 and set(map(len, block_hashes)) == {size}:
        words = array("Q", b"".join(block_hashes))
        if sys.byteorder == "little":
            words.byteswap()  # the hash's bytes are big-endian
        return words[size // 8 - 1:: size // 8].tolist()
    from_bytes = int.from_bytes
    return [from_bytes(block_hash[-8:], "big") for block_hash in block_hashes]


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What one `apply` call did, for metrics and for the event stream's logs."""

    num_stored_blocks: int = 0
    num_removed_blocks: int = 0
    num_skipped_blocks: int = 0
    num_skipped_events: int = 0
    is_cleared: bool = False
    # Of the skipped blocks, those whose parent this replica's index does not know.
    num_orphaned_blocks: int = 0


@dataclass(frozen=True, slots=True)
class IndexSnapshot:
    """Counts only; safe to export as metrics or assert on in tests."""

    num_unique_blocks: int
    num_blocks_by_replica: dict[ReplicaId, int]
    num_pending_blocks_by_replica: dict[ReplicaId, int]
    num_evicted_blocks_by_replica: dict[ReplicaId, int]


class _ReplicaState:
    __slots__ = ("replica_id", "slot", "bit", "max_blocks", "blocks", "extra_copies", "skipped", "pending",
                 "num_evicted_blocks", "anchors", "adopted", "stand_in_of", "group_kinds", "tracked_group")

    def __init__(self, replica_id: ReplicaId, slot: int, max_blocks: int) -> None:
        self.replica_id = replica_id
        self.slot = slot
        self.bit = 1 << slot
        self.max_blocks = max_blocks
        self.blocks: dict[int, BlockHash] = {}
        self.extra_copies: dict[int, int] = {}
        # Engine keys of blocks skipped on purpose (multimodal keys, a salt the router cannot reproduce)
        # and of the blocks extending them: their children are skipped too, not counted as orphans.
        self.skipped: dict[int, None] = {}
        self.pending: dict[BlockHash, float] = {}
        self.num_evicted_blocks = 0
        # Adoption (module docstring): engine key of an adopted parent -> the stand-in keys of the
        # ancestors adopted with it; stand-in key -> [its hash, how many anchors hold it].
        self.anchors: dict[int, list[int]] = {}
        self.adopted: dict[int, list] = {}
        self.stand_in_of: dict[BlockHash, int] = {}
        # The kind of each KV cache group its stores named, and the group followed (`tracks_group`): 0 until
        # a store names kinds, then the first that caches whole prefixes (None: no such group).
        self.group_kinds: dict[int, str] = {}
        self.tracked_group: int | None = 0

    def tracks_group(self, group_idx: int | None, kind: str | None = None) -> bool:
        """Whether events of KV cache group `group_idx` (None: a vLLM that names no group) are the tracked
        group's; a store's `kind` is learnt first (`PrefixIndex` docstring)."""
        if group_idx is None:
            return True
        if kind is not None and group_idx not in self.group_kinds:
            self.group_kinds[group_idx] = kind
            prefix_groups = [group for group, seen in self.group_kinds.items() if seen in _PREFIX_KINDS]
            self.tracked_group = min(prefix_groups) if prefix_groups else None
        return group_idx == self.tracked_group


class PrefixIndex:
    """Exact per-replica index of cached KV blocks plus optimistic pending placements."""

    def __init__(self, block_size_tokens: int, max_blocks_per_replica: int, model_id: str) -> None:
        """Args:
        block_size_tokens: the engines' KV block size; other sizes are skipped.
        max_blocks_per_replica: LRU bound per replica, raised to a replica's KV capacity where that is larger.
        model_id: root of block chains without a LoRA name (see `root_hash`).
        """
        if block_size_tokens < 1 or max_blocks_per_replica < 1:
            raise ValueError(f"block_size_tokens={block_size_tokens}, max_blocks_per_replica="
                             f"{max_blocks_per_replica}: both must be >= 1")
        self._block_size_tokens = block_size_tokens
        self._max_blocks = max_blocks_per_replica
        self._model_id = model_id
        self._owners: dict[BlockHash, int] = {}
        self._pending_owners: dict[BlockHash, int] = {}
        self._replicas: dict[ReplicaId, _ReplicaState] = {}
        self._slot_ids: list[ReplicaId | None] = []
        self._expiries: list[tuple[float, int, _ReplicaState, tuple[BlockHash, ...]]] = []
        self._expiry_seq = itertools.count()
        # Prompts recently placed, newest last: (replica, their block hashes, when), for adopting orphans.
        self._placed_prompts: deque[tuple[ReplicaId, RequestBlockHashes, float]] = deque(maxlen=PLACED_PROMPTS_KEPT)
        self._stand_in_keys = itertools.count(-1, -1)  # engine keys are never negative
        self._model_root = root_hash(model_id, None)

    def apply(self, replica_id: ReplicaId, events: Iterable[object], now_s: float | None = None) -> ApplyResult:
        """Applies one replica's KV events, in order.

        Skipped, never guessed: blocks of another medium, group or block size;
        blocks whose parent this replica's index does not know (stored before
        the router connected, or forgotten: counted as orphans); blocks with
        multimodal or prompt-embedding extra keys or a salt no request can
        name (requests cannot reproduce them), and the blocks extending those
        (remembered as `skipped`, so they are not orphans); events of unknown
        types. A re-store of a known block counts as another physical
        copy (vLLM's default "incremental" report mode); the "full" report mode,
        which re-announces reused blocks, would over-count copies.

        Args:
            replica_id: the replica that published the events.
            events: `BlockStored`, `BlockRemoved`, `AllBlocksCleared` structs.
            now_s: current time, on the placements' clock: only prompts placed within ADOPTION_WINDOW_S
                of it explain an orphan. None: of the newest placement (a replay of recorded events).

        Returns:
            Counts of what was applied and skipped.
        """
        state = self._state(replica_id)
        num_stored = num_removed = num_skipped_blocks = num_skipped_events = num_orphaned = 0
        is_cleared = False
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                stored, skipped, orphaned = self._store(state, event, now_s)
                num_stored += stored
                num_skipped_blocks += skipped
                num_orphaned += orphaned
            elif kind == "BlockRemoved":
                if event.medium in _TRACKED_MEDIA and state.tracks_group(event.group_idx):
                    num_removed += self._remove(state, event.block_hashes)
                else:
                    num_skipped_blocks += len(event.block_hashes)
            elif kind == "AllBlocksCleared":
                self._clear_blocks(state)
                is_cleared = True
            else:
                num_skipped_events += 1
        return ApplyResult(num_stored, num_removed, num_skipped_blocks, num_skipped_events, is_cleared, num_orphaned)

    def longest_prefix(self, block_hashes: Sequence[BlockHash], now_s: float) -> dict[ReplicaId, int]:
        """Number of leading request blocks each replica holds, indexed or pending.

        Args:
            block_hashes: the request's block hashes, in order.
            now_s: current time, to expire pending entries.

        Returns:
            Replica -> leading blocks held; replicas holding none are absent.
        """
        self._expire(now_s)
        result: dict[ReplicaId, int] = {}
        for mask, num_blocks in leading_runs(self._owners.get, block_hashes):
            self._credit(result, mask, num_blocks)
        if self._pending_owners:
            self._credit_pending(result, block_hashes)
        return result

    def _credit_pending(self, result: dict[ReplicaId, int], block_hashes: Sequence[BlockHash]) -> None:
        """Raises each replica's count to its furthest pending checkpoint the request shares.

        Reads the checkpoint grid, then a stride of blocks after each replica's
        furthest shared grid checkpoint and after each indexed count in
        `result` (module docstring: where a shared last checkpoint can be).
        """
        num_blocks = len(block_hashes)
        pending_get, at = self._pending_owners.get, block_hashes.__getitem__
        positions = _grid_positions(num_blocks)
        masks = list(map(pending_get, map(at, positions), repeat(0)))
        found = list(compress(zip(positions, masks), masks))  # (position, mask) where a checkpoint is
        starts = set(result.values())
        seen = 0
        for position, mask in reversed(found):
            if mask & ~seen:
                seen |= mask
                starts.add(position + 1)  # the furthest shared grid checkpoint of the replicas new here
        windows = set().union(*(range(start, min(start + PENDING_STRIDE_BLOCKS, num_blocks)) for start in starts))
        between = sorted(windows.difference(positions))
        if between:
            masks = list(map(pending_get, map(at, between), repeat(0)))
            found += compress(zip(between, masks), masks)
            found.sort()
        remaining = 0
        for _, mask in found:
            remaining |= mask
        slot_ids = self._slot_ids
        for position, mask in reversed(found):
            mask &= remaining
            if not mask:
                continue
            remaining &= ~mask
            while mask:
                low = mask & -mask
                replica_id = slot_ids[low.bit_length() - 1]
                if replica_id is not None and result.get(replica_id, 0) <= position:
                    result[replica_id] = position + 1
                mask ^= low
            if not remaining:
                return

    def add_pending(
        self,
        replica_id: ReplicaId,
        block_hashes: Sequence[BlockHash],
        now_s: float,
        ttl_s: float,
        num_held_blocks: int = 0,
    ) -> int:
        """Counts `block_hashes` as held by `replica_id` until confirmed or `now_s + ttl_s`.

        Why: events arrive after prefill, so without this a burst of requests
        sharing a new prefix would scatter before the first one is cached.

        Recorded at checkpoint blocks (module docstring). Checkpoints within
        the leading blocks the replica has indexed are skipped, unless they are
        pending there, which extends them.

        Args:
            replica_id: the replica the request went to.
            block_hashes: the request's block hashes, in order.
            now_s: current time.
            ttl_s: how long the entries count without a confirming event.
            num_held_blocks: leading blocks `longest_prefix` found on the replica
                (indexed or pending), so they need no walk; 0 walks from the start.

        Returns:
            Number of checkpoint entries made or kept pending.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._expire(now_s)
        num_blocks = len(block_hashes)
        if not num_blocks:
            return 0
        state = self._state(replica_id)
        bit, owners_get, pending = state.bit, self._owners.get, state.pending
        start = min(max(num_held_blocks, 0), num_blocks)
        for block_hash in block_hashes[start:]:
            if not owners_get(block_hash, 0) & bit:
                break
            start += 1
        checkpoints = _checkpoints(block_hashes)
        kept = [(position, block_hash) for position, block_hash in checkpoints if position >= start or block_hash in pending]
        last = num_blocks - 1
        if kept and kept[-1][0] == last and not _is_grid(last) and (len(kept) == 1 or kept[-2] != checkpoints[-2]):
            kept.insert(-1, checkpoints[-2])  # the grid checkpoint before an off-grid last (module docstring)
        if not kept:
            return 0
        entries = [block_hash for _, block_hash in kept]
        expiry_s = now_s + ttl_s
        pending_owners = self._pending_owners
        for block_hash in entries:
            pending[block_hash] = expiry_s
            pending_owners[block_hash] = pending_owners.get(block_hash, 0) | bit
        heapq.heappush(self._expiries, (expiry_s, next(self._expiry_seq), state, tuple(entries)))
        return len(entries)

    def withdraw_pending(self, replica_id: ReplicaId, block_hashes: Sequence[BlockHash]) -> int:
        """Drops the replica's pending entries at the checkpoints of `block_hashes`.

        Why: a request the engine refused before prefill (a prompt over the
        window) never caches its blocks, so its placement would otherwise count
        them as held until it expires. An entry another request placed at the
        same block is dropped too: the index then under-predicts, never over.

        Returns:
            Number of pending entries dropped.
        """
        state = self._replicas.get(replica_id)
        if state is None or not state.pending or not block_hashes:
            return 0
        return self._drop_pending(state, [block_hash for _, block_hash in _checkpoints(block_hashes)])

    def _drop_pending(self, state: _ReplicaState, block_hashes: Iterable[BlockHash]) -> int:
        """Drops the replica's pending entries at `block_hashes`; returns how many it had."""
        pending = state.pending
        dropped = [block_hash for block_hash in block_hashes if pending.pop(block_hash, None) is not None]
        drop_owner_bit(self._pending_owners, dropped, state.bit)
        return len(dropped)

    def set_replica_capacity(self, replica_id: ReplicaId, num_blocks: int) -> None:
        """Bounds the replica's indexed blocks by its KV cache's size where that is over `max_blocks_per_replica`.

        Lowering it later does not forget blocks at once: the next store does.
        """
        self._state(replica_id).max_blocks = max(self._max_blocks, num_blocks)

    def clear_replica(self, replica_id: ReplicaId) -> None:
        """Forgets every indexed block of the replica (resync); pending entries on blocks it does not hold
        stay until they expire (a placed request's prefill may still store them)."""
        state = self._replicas.get(replica_id)
        if state is not None:
            self._clear_blocks(state)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        """Forgets the replica entirely (it died or left) and frees its slot."""
        state = self._replicas.pop(replica_id, None)
        if state is None:
            return
        self._clear_blocks(state)
        for block_hash in state.pending:
            self._drop_bit(self._pending_owners, block_hash, state.bit)
        state.pending.clear()
        self._slot_ids[state.slot] = None

    def replica_ids(self) -> set[ReplicaId]:
        """The replicas the index holds anything of (blocks, pending entries or an empty slot's state)."""
        return set(self._replicas)

    def snapshot(self, now_s: float | None = None) -> IndexSnapshot:
        """Counts per replica; expires pending entries first when `now_s` is given."""
        if now_s is not None:
            self._expire(now_s)
        states = self._replicas.values()
        return IndexSnapshot(
            num_unique_blocks=len(self._owners),
            num_blocks_by_replica={s.replica_id: len(s.blocks) for s in states},
            num_pending_blocks_by_replica={s.replica_id: len(s.pending) for s in states},
            num_evicted_blocks_by_replica={s.replica_id: s.num_evicted_blocks for s in states},
        )

    def note_placed_prompt(self, replica_id: ReplicaId, blocks: RequestBlockHashes, now_s: float) -> None:
        """Remembers a prompt placed on `replica_id`, so that the blocks its prefill stores may be adopted.

        Only prompts rooted in the served model alone: a cache salt or LoRA name is in the engine's first
        block only, so another tenant's orphan would match a salted prompt's tokens as well as its own.
        """
        if blocks.num_blocks > ADOPTION_MIN_BLOCKS and blocks.root == self._model_root:
            self._placed_prompts.append((replica_id, blocks, now_s))

    def forget_placed_prompt(self, replica_id: ReplicaId, blocks: RequestBlockHashes) -> None:
        """Forgets a prompt noted on a replica that will not prefill it (Serve sent it elsewhere, the engine
        refused it): an orphan there matching it would be another request's."""
        kept = [entry for entry in self._placed_prompts if entry[0] != replica_id or entry[1] is not blocks]
        if len(kept) != len(self._placed_prompts):
            self._placed_prompts = deque(kept, maxlen=PLACED_PROMPTS_KEPT)

    def _adopt(self, state: _ReplicaState, parent_key: int, event, now_s: float | None) -> BlockHash | None:
        """The hash of an orphan's parent, taken from a prompt placed on the replica, else None.

        The orphan's first ADOPTION_MIN_BLOCKS blocks, and every block of it the prompt goes on to, must
        continue exactly one prompt placed there within ADOPTION_WINDOW_S (one position, one parent):
        their parent is then that prompt's block before them, which the engine held, and so every block
        before it (vLLM evicts a chain from its end). The parent joins the index under its engine key, the
        blocks before it under stand-in keys no removal names, released when the last parent adopted with
        them goes (module docstring: adoption). A prompt that explains an orphan is not asked again.
        """
        step = 4 * self._block_size_tokens
        if len(event.block_hashes) < ADOPTION_MIN_BLOCKS or not self._placed_prompts:
            return None  # a decode step's one block (every step, on a blind replica) costs nothing here
        data = encode_tokens(event.token_ids)
        head = data[: ADOPTION_MIN_BLOCKS * step]
        # Within the window of now: measured from the newest placement, a router idle for an hour (the ingress's,
        # while the orchestrator's routes) matched orphans with hour-old prompts.
        horizon = (self._placed_prompts[-1][2] if now_s is None else now_s) - ADOPTION_WINDOW_S
        found: dict[BlockHash, tuple[RequestBlockHashes, int]] = {}
        num_scanned = 0
        for replica_id, prompt, placed_s in reversed(self._placed_prompts):
            if placed_s < horizon or num_scanned == ADOPTION_PROMPTS_SCANNED:
                break
            if replica_id != state.replica_id:
                continue
            num_scanned += 1
            prompt_data = prompt.token_bytes
            offset = prompt_data.find(head, step)
            while offset != -1:
                matched = min(len(data), len(prompt_data) - offset) // step
                if offset % step == 0 and prompt_data.startswith(data[: matched * step], offset):
                    found[prompt.hashes()[offset // step - 1]] = (prompt, offset // step)
                offset = prompt_data.find(head, offset + 1)
            if len(found) > 1:
                break
        if len(found) != 1:  # none, or ambiguous: the index forgets rather than invents
            return None
        ((parent, (prompt, position)),) = found.items()
        self.forget_placed_prompt(state.replica_id, prompt)
        bit, owners, stand_ins = state.bit, self._owners, []
        adopted, stand_in_of = state.adopted, state.stand_in_of
        for block_hash in prompt.hashes()[: position - 1]:
            key = stand_in_of.get(block_hash)
            if key is None:
                if owners.get(block_hash, 0) & bit:  # indexed under its engine key
                    continue
                key = stand_in_of[block_hash] = next(self._stand_in_keys)
                state.blocks[key] = block_hash
                adopted[key] = [block_hash, 0]
                owners[block_hash] = owners.get(block_hash, 0) | bit
            adopted[key][1] += 1
            stand_ins.append(key)
        if (held_as := stand_in_of.pop(parent, None)) is not None:  # now backed by its engine key: no stand-in
            del adopted[held_as], state.blocks[held_as]
        state.anchors[parent_key] = stand_ins
        state.blocks[parent_key] = parent
        owners[parent] = owners.get(parent, 0) | bit
        if state.pending:  # confirmed, as a store confirms its blocks
            self._drop_pending(state, [*prompt.hashes()[: position - 1], parent])
        return parent

    def _release_anchors(self, state: _ReplicaState, keys: Iterable[int]) -> None:
        """Drops the stand-ins of the adopted parents among `keys` that no other adopted parent holds."""
        released = []
        for key in keys:
            for stand_in in state.anchors.pop(key, ()):
                entry = state.adopted.get(stand_in)
                if entry is None:  # forgotten by the bound, or replaced by its engine key
                    continue
                entry[1] -= 1
                if not entry[1]:
                    del state.adopted[stand_in]
                    del state.stand_in_of[entry[0]]
                    if state.blocks.pop(stand_in, None) is not None:
                        released.append(entry[0])
        drop_owner_bit(self._owners, released, state.bit)
        if state.pending:  # as in `_remove`: a pending entry goes with the block
            self._drop_pending(state, released)

    def _state(self, replica_id: ReplicaId) -> _ReplicaState:
        state = self._replicas.get(replica_id)
        if state is None:
            try:
                slot = self._slot_ids.index(None)
                self._slot_ids[slot] = replica_id
            except ValueError:
                slot = len(self._slot_ids)
                self._slot_ids.append(replica_id)
            state = self._replicas[replica_id] = _ReplicaState(replica_id, slot, self._max_blocks)
        return state

    def _credit(self, result: dict[ReplicaId, int], mask: int, num_blocks: int) -> None:
        slot_ids = self._slot_ids
        while mask:
            low = mask & -mask
            replica_id = slot_ids[low.bit_length() - 1]
            if replica_id is not None:
                result[replica_id] = num_blocks
            mask ^= low

    @staticmethod
    def _drop_bit(masks: dict[BlockHash, int], block_hash: BlockHash, bit: int) -> None:
        mask = masks.get(block_hash, 0) & ~bit
        if mask:
            masks[block_hash] = mask
        else:
            masks.pop(block_hash, None)

    def _store(self, state: _ReplicaState, event, now_s: float | None) -> tuple[int, int, int]:
        """Returns (blocks stored, blocks skipped, of those with an unknown parent) for one `BlockStored`."""
        num_blocks = len(event.block_hashes)
        block_size = self._block_size_tokens
        if (
            event.medium not in _TRACKED_MEDIA
            or not state.tracks_group(event.group_idx, getattr(event, "kv_cache_spec_kind", None))
            or event.block_size != block_size
            or len(event.token_ids) != num_blocks * block_size
        ):
            return 0, num_blocks, 0
        extra_keys = event.extra_keys or ()
        lora_name = event.lora_name
        first = 0
        if event.parent_block_hash is None:
            salt = _root_salt(extra_keys[0] if extra_keys else None, lora_name)
            if salt is False:
                self._skip(state, event.block_hashes)
                return 0, num_blocks, 0
            parent = root_hash(lora_name or self._model_id, salt)
            first = 1
        else:
            parent_key = _engine_key(event.parent_block_hash)
            parent = state.blocks.get(parent_key)
            if parent is None:
                if parent_key in state.skipped:  # extends a block skipped on purpose: no orphan
                    self._skip(state, event.block_hashes)
                    return 0, num_blocks, 0
                if any(extra_keys) or lora_name is not None or (parent := self._adopt(state, parent_key, event, now_s)) is None:
                    return 0, num_blocks, num_blocks
        usable = num_blocks
        for offset, block_keys in enumerate(extra_keys[first:num_blocks], start=first):
            if block_keys and any(key != lora_name for key in block_keys):
                usable = offset
                self._skip(state, event.block_hashes[usable:])
                break
        token_bytes = encode_tokens(event.token_ids[: usable * block_size])
        hashes = chain_block_hashes(parent, token_bytes, block_size)
        keys = _engine_keys(event.block_hashes[:usable])
        blocks = state.blocks
        if blocks.keys().isdisjoint(keys) and len(set(keys)) == len(keys):  # a key twice: copies, one by one
            self._store_new(state, keys, hashes)
        else:
            self._store_blockwise(state, keys, hashes)
        extra_copies = state.extra_copies
        for old_key in list(islice(blocks, max(len(blocks) - state.max_blocks, 0))):  # the least recently stored
            old_hash = blocks.pop(old_key, None)
            if old_hash is None:  # a stand-in released with its anchor, earlier in this loop
                continue
            extra_copies.pop(old_key, None)
            self._drop_bit(self._owners, old_hash, state.bit)
            state.num_evicted_blocks += 1
            if state.anchors:
                if (entry := state.adopted.pop(old_key, None)) is not None:
                    del state.stand_in_of[entry[0]]
                self._release_anchors(state, (old_key,))
        return usable, num_blocks - usable, 0

    def _store_new(self, state: _ReplicaState, keys: list[int], hashes: list[BlockHash]) -> None:
        """Indexes blocks none of which the replica holds (the usual event): `_store_blockwise` with the loops in C."""
        pending = state.pending
        state.blocks.update(zip(keys, hashes))
        add_owner_bit(self._owners, hashes, state.bit)
        if pending:
            confirmed = list(pending.keys() & hashes)
            deque(map(pending.__delitem__, confirmed), maxlen=0)
            drop_owner_bit(self._pending_owners, confirmed, state.bit)

    def _store_blockwise(self, state: _ReplicaState, keys: list[int], hashes: list[BlockHash]) -> None:
        """Indexes blocks one by one; those the replica holds already count as another copy."""
        blocks, extra_copies, pending = state.blocks, state.extra_copies, state.pending
        owners, bit = self._owners, state.bit
        for engine_key, block_hash in zip(keys, hashes):
            if engine_key in blocks:
                blocks[engine_key] = blocks.pop(engine_key)  # to the end: stored most recently
                extra_copies[engine_key] = extra_copies.get(engine_key, 0) + 1
                continue
            blocks[engine_key] = block_hash
            owners[block_hash] = owners.get(block_hash, 0) | bit
            if pending and pending.pop(block_hash, None) is not None:
                self._drop_bit(self._pending_owners, block_hash, bit)

    def _skip(self, state: _ReplicaState, engine_hashes: Sequence[bytes | int]) -> None:
        """Remembers blocks skipped on purpose, the most recent `max_blocks` of them."""
        skipped = state.skipped
        skipped.update(dict.fromkeys(_engine_keys(engine_hashes)))
        for old_key in list(islice(skipped, max(len(skipped) - state.max_blocks, 0))):
            del skipped[old_key]

    def _remove(self, state: _ReplicaState, engine_hashes: Sequence[bytes | int]) -> int:
        keys = _engine_keys(engine_hashes)
        if state.skipped:
            deque(map(state.skipped.pop, keys, repeat(None)), maxlen=0)
        if state.anchors and not state.anchors.keys().isdisjoint(keys):
            removed = self._remove_keys(state, keys)
            self._release_anchors(state, [key for key in keys if key in state.anchors and key not in state.blocks])
            return removed
        return self._remove_keys(state, keys)

    def _remove_keys(self, state: _ReplicaState, keys: list[int]) -> int:
        if state.extra_copies and not state.extra_copies.keys().isdisjoint(keys):
            return self._remove_blockwise(state, keys)
        # No copies involved (the usual event): `_remove_blockwise` with the loops in C.
        gone = list(filter(None, map(state.blocks.pop, keys, repeat(None))))
        drop_owner_bit(self._owners, gone, state.bit)
        if state.pending:
            # A pending entry on a block the replica held (the grid checkpoint before an off-grid
            # last) gets no event to confirm it: gone with the block, it would credit the replica.
            self._drop_pending(state, gone)
        return len(gone)

    def _remove_blockwise(self, state: _ReplicaState, keys: list[int]) -> int:
        """Removes blocks one by one; a block held in several copies loses one copy."""
        blocks, extra_copies = state.blocks, state.extra_copies
        num_removed = 0
        for engine_key in keys:
            copies = extra_copies.get(engine_key)
            if copies:
                if copies == 1:
                    del extra_copies[engine_key]
                else:
                    extra_copies[engine_key] = copies - 1
                continue
            block_hash = blocks.pop(engine_key, None)
            if block_hash is not None:
                self._drop_bit(self._owners, block_hash, state.bit)
                if state.pending:
                    self._drop_pending(state, (block_hash,))
                num_removed += 1
        return num_removed

    def _clear_blocks(self, state: _ReplicaState) -> None:
        held = list(state.blocks.values())
        drop_owner_bit(self._owners, held, state.bit)
        if state.pending:  # as in `_remove`: one on a held block gets no event to confirm it
            self._drop_pending(state, held)
        state.blocks.clear()
        state.extra_copies.clear()
        state.skipped.clear()
        state.anchors.clear()
        state.adopted.clear()
        state.stand_in_of.clear()

    def expire_pending(self, now_s: float) -> None:
        """Drops pending entries that expired by `now_s`.

        Lookups and `add_pending` expire what is due themselves, so results never
        depend on calling this; the router calls it from its event thread so that
        this per-block work is rarely left to a routing decision.
        """
        self._expire(now_s)

    def _expire(self, now_s: float) -> None:
        expiries = self._expiries
        while expiries and expiries[0][0] <= now_s:
            _, _, state, block_hashes = heapq.heappop(expiries)
            if self._replicas.get(state.replica_id) is not state:
                continue  # replica removed since; its bits are already gone
            pending, pending_owners, keep = state.pending, self._pending_owners, ~state.bit
            for block_hash in block_hashes:
                expiry_s = pending.get(block_hash)
                # A later add_pending may have extended this entry: keep it then.
                if expiry_s is not None and expiry_s <= now_s:
                    del pending[block_hash]
                    mask = pending_owners[block_hash] & keep
                    if mask:
                        pending_owners[block_hash] = mask
                    else:
                        del pending_owners[block_hash]


def leading_runs(mask_of: Callable[[BlockHash, int], int], chain: Sequence[BlockHash]) -> list[tuple[int, int]]:
    """(mask, n) pairs, n increasing: the owners in `mask` hold exactly the first n blocks of `chain`.

    `mask_of(block, 0)` is the bitmask of owners holding a block. Owners must
    be prefix-closed along the chain (every owner of a block owns its
    parent), so masks only lose bits along it and each owner's run ends where
    its bit first drops: bisecting between probed positions whose masks differ
    finds every such drop with a few lookups per owner instead of one lookup
    per block.
    """
    last = len(chain) - 1
    if last < 0:
        return []
    alive = mask_of(chain[0], 0)
    if not alive:
        return []
    runs: list[tuple[int, int]] = []
    # Spans (low, its mask, high, its mask), left to right: the masks between are sandwiched by the two.
    spans = [(0, alive, last, mask_of(chain[last], 0))]
    while spans:
        low, low_mask, high, high_mask = spans.pop()
        if not (low_mask ^ high_mask) & alive:
            continue
        if high - low == 1:
            dropped = alive & ~high_mask
            runs.append((dropped, high))
            alive &= high_mask
            if not alive:
                return runs
            continue
        middle = (low + high) // 2
        middle_mask = mask_of(chain[middle], 0)
        spans.append((middle, middle_mask, high, high_mask))
        spans.append((low, low_mask, middle, middle_mask))
    runs.append((alive, last + 1))
    return runs


def add_owner_bit(masks: dict[BlockHash, int], block_hashes: Sequence[BlockHash], bit: int) -> None:
    """Sets `bit` in the owner mask of each block, adding the blocks not there (the loops in C).

    When none of the blocks is there (a session's new blocks, the usual case), each gets `bit`
    itself: the blocks one replica alone holds then share one int object instead of 28 bytes or
    more each, and a removal reads a mask already in cache.
    """
    if not any(map(masks.get, block_hashes)):
        masks.update(zip(block_hashes, repeat(bit)))
        return
    masks.update(zip(block_hashes, list(map(bit.__or__, map(masks.get, block_hashes, repeat(0))))))


def drop_owner_bit(masks: dict[BlockHash, int], block_hashes: Sequence[BlockHash], bit: int) -> None:
    """Clears `bit` from the owner mask of each block; a block left with no owner is deleted (the loops in C)."""
    left = list(map((~bit).__and__, map(masks.get, block_hashes, repeat(0))))
    masks.update(compress(zip(block_hashes, left), left))
    deque(map(masks.pop, compress(block_hashes, map(not_, left)), repeat(None)), maxlen=0)


def _is_grid(position: int) -> bool:
    """Whether a checkpoint sits at `position` in every placement that long: the dense head, then every stride."""
    return position < PENDING_DENSE_BLOCKS or (position - _FIRST_SPARSE) % PENDING_STRIDE_BLOCKS == 0


def _grid_positions(num_blocks: int) -> list[int]:
    """The grid positions (`_is_grid`) below `num_blocks`, in order."""
    return [*range(min(PENDING_DENSE_BLOCKS, num_blocks)), *range(_FIRST_SPARSE, num_blocks, PENDING_STRIDE_BLOCKS)]


def _checkpoints(block_hashes: Sequence[BlockHash]) -> list[tuple[int, BlockHash]]:
    """(position, hash) of the blocks a pending placement is recorded at: the grid, and the last."""
    last = len(block_hashes) - 1
    positions = _grid_positions(last + 1)
    if positions[-1] != last:
        positions.append(last)
    return list(zip(positions, map(block_hashes.__getitem__, positions)))


def _root_salt(keys: tuple | None, lora_name: str | None) -> str | None | bool:
    """Cache salt of a chain's first block from its published extra keys.

    vLLM publishes block 0's keys untagged, in the order LoRA name, multimodal
    (identifier, offset) pairs, cache salt, prompt-embedding digests. Returns
    the salt (or None), or False when the keys hold anything a request cannot
    reproduce.
    """
    salt: str | None = None
    for key in keys or ():
        if key == lora_name:
            continue
        if not isinstance(key, str) or salt is not None:
            return False
        salt = key
    return salt
