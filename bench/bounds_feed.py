"""Feeding a simulation's requests to the oracle bounds, in the same process or on another core.

Why a second process: the bounds replay every block of the run through caches
of their own (an infinite one, and one per replica under a greedy placement
and under the simulation's own), about a third of a warmpath simulation's
CPU. They depend only on the requests, where they were sent and the cached
responses, in send order, never on what the simulation does next, so another process can compute them while the simulation runs: on
a machine with a spare core, a warmpath cell then takes about two thirds of
the time, with the same figures.

Both feeds take requests by session: a session's responses are cached on the
replica the placement chose for its latest request (`SessionBounds`), and on
the one the simulation sent it to in the replay of its own placement.

What crosses the pipe (`BoundsProcess`): for each request or cached response,
only the blocks its session did not send last time (block hashes chain, so the
shared prefix is a count), as one 16-byte string per block joined into one
`bytes`, batched about a megabyte at a time. A long coding session re-sends
thousands of blocks per turn and adds a few hundred.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection
from typing import Protocol, Sequence

from bench.oracle import OracleBounds, StreamingBounds
from router.hashing import DIGEST_SIZE_BYTES, BlockHash

FLUSH_BYTES = 1 << 20
_OBSERVE, _CACHE, _END, _RESULT = range(4)


class BoundsFeed(Protocol):
    """What the simulation tells the bounds, in send order."""

    cpu_s: float  # CPU time the bounds took outside this process, known once `result` returned

    def observe(self, session_id: str, chain: Sequence[BlockHash], num_tokens: int, served_on: int | None = None) -> None:
        """A request was sent: its prompt's block hashes and token count, and the replica the run sent it to."""

    def cache(self, session_id: str, chain: Sequence[BlockHash]) -> None:
        """The session's latest request left `chain` cached (its response's blocks included)."""

    def end(self, session_id: str) -> None:
        """The session sends nothing more."""

    def result(self, num_requests: int | None = None) -> OracleBounds:
        """Both bounds over everything observed; the feed takes nothing after this."""

    def close(self) -> None:
        """Releases what the feed holds, whether or not `result` was reached."""


class SessionBounds:
    """`StreamingBounds` keyed by session, in this process."""

    cpu_s = 0.0  # all of it in this process

    def __init__(self, block_size_tokens: int, num_replicas: int, capacity_blocks: int) -> None:
        self._bounds = StreamingBounds(block_size_tokens, num_replicas, capacity_blocks)
        # session -> replica of its latest request: the greedy placement's, and the run's own
        self._placed: dict[str, tuple[int, int | None]] = {}

    def observe(self, session_id: str, chain: Sequence[BlockHash], num_tokens: int, served_on: int | None = None) -> None:
        self._placed[session_id] = (self._bounds.observe(chain, num_tokens, served_on), served_on)

    def cache(self, session_id: str, chain: Sequence[BlockHash]) -> None:
        self._bounds.cache(chain, *self._placed[session_id])

    def end(self, session_id: str) -> None:
        self._placed.pop(session_id, None)

    def result(self, num_requests: int | None = None) -> OracleBounds:
        return self._bounds.result(num_requests)

    def close(self) -> None:
        """Nothing to release."""


def shared_prefix(previous: Sequence[BlockHash], chain: Sequence[BlockHash]) -> int:
    """Leading blocks two chains share (binary search: equal hashes at i mean equal chains up to i)."""
    low, high = 0, min(len(previous), len(chain))  # the first `low` shared; none from `high` on
    while low < high:
        middle = (low + high) // 2
        if previous[middle] == chain[middle]:
            low = middle + 1
        else:
            high = middle
    return low


class BoundsProcess:
    """A `BoundsFeed` whose bounds are computed in a child process (module docstring).

    Use as a context manager, or call `close` when done: the child is stopped
    if `result` was never reached.
    """

    def __init__(self, block_size_tokens: int, num_replicas: int, capacity_blocks: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter, whatever threads run here
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_conn, block_size_tokens, num_replicas, capacity_blocks),
            name="warmpath-bounds",
        )
        self._process.start()
        child_conn.close()
        self._sent: dict[str, Sequence[BlockHash]] = {}  # session -> the chain it sent last
        self._batch: list[tuple] = []
        self._batch_bytes = 0
        self.cpu_s = 0.0  # the child's CPU time, known once `result` returned

    def observe(self, session_id: str, chain: Sequence[BlockHash], num_tokens: int, served_on: int | None = None) -> None:
        self._send_chain(_OBSERVE, session_id, chain, num_tokens, served_on)

    def cache(self, session_id: str, chain: Sequence[BlockHash]) -> None:
        self._send_chain(_CACHE, session_id, chain, 0)

    def end(self, session_id: str) -> None:
        if self._sent.pop(session_id, None) is not None:
            self._batch.append((_END, session_id))

    def result(self, num_requests: int | None = None) -> OracleBounds:
        self._batch.append((_RESULT, num_requests))
        self._flush()
        try:
            outcome = self._conn.recv()
        except EOFError:
            outcome = None
        self.close()
        if not isinstance(outcome, tuple):
            raise RuntimeError(f"the bounds process failed: {outcome or 'it exited without a result'}")
        bounds, self.cpu_s = outcome
        return bounds

    def _child_error(self) -> str | None:
        """What the child reported before it exited, if anything."""
        try:
            return self._conn.recv() if self._conn.poll(1.0) else None
        except (EOFError, OSError):
            return None

    def close(self) -> None:
        """Stops the child (at once if it has not answered `result`)."""
        if self._process.is_alive():
            self._process.terminate()
        self._process.join()
        self._conn.close()

    def __enter__(self) -> "BoundsProcess":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def _send_chain(self, kind: int, session_id: str, chain: Sequence[BlockHash], num_tokens: int,
                    served_on: int | None = None) -> None:
        previous = self._sent.get(session_id)
        shared = shared_prefix(previous, chain) if previous is not None else 0
        blob = b"".join(chain[shared:])
        self._sent[session_id] = chain
        self._batch.append((kind, session_id, shared, blob, num_tokens, served_on))
        self._batch_bytes += len(blob)
        if self._batch_bytes >= FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        try:
            self._conn.send(self._batch)
        except (BrokenPipeError, ConnectionResetError) as error:
            detail = self._child_error()
            self.close()
            raise RuntimeError(f"the bounds process failed: {detail or 'exit code %s' % self._process.exitcode}") \
                from error
        self._batch = []
        self._batch_bytes = 0


def _serve(conn: Connection, block_size_tokens: int, num_replicas: int, capacity_blocks: int) -> None:
    """The child: applies batches of requests to a `SessionBounds` until asked for the result.

    A terminal's Ctrl-C reaches the whole process group: the parent stops this process (`close`), which
    ignores it; a parent gone (interrupted, killed) ends it quietly, with nothing to report to.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.disable()  # millions of small acyclic objects, as in the simulation itself
    bounds = SessionBounds(block_size_tokens, num_replicas, capacity_blocks)
    chains: dict[str, list[BlockHash]] = {}
    size = DIGEST_SIZE_BYTES
    try:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                return
            for op in batch:
                kind = op[0]
                if kind == _END:
                    chains.pop(op[1], None)
                    bounds.end(op[1])
                    continue
                if kind == _RESULT:
                    conn.send((bounds.result(op[1]), time.process_time()))
                    return
                _, session_id, shared, blob, num_tokens, served_on = op
                chain = chains[session_id][:shared] if shared else []
                chain += [blob[i:i + size] for i in range(0, len(blob), size)]
                chains[session_id] = chain
                if kind == _OBSERVE:
                    bounds.observe(session_id, chain, num_tokens, served_on)
                else:
                    bounds.cache(session_id, chain)
    except Exception as error:  # reported to the parent, which raises it with this text
        with contextlib.suppress(OSError):  # unless it is gone
            conn.send(f"{type(error).__name__}: {error}")
    finally:
        conn.close()


__all__ = ["BoundsFeed", "BoundsProcess", "FLUSH_BYTES", "SessionBounds", "shared_prefix"]
