"""Groups a replica's streamed chunks without holding back the first one.

Ray Serve LLM sends a stream from the replica to the ingress in batches: it wakes every
`stream_batching_interval_ms` (50 ms by default) and forwards what has arrived, so fewer,
larger items cross the actor boundary. The first chunk waits for the first tick like every
other, which on a fully cached prompt is most of the time to first token (about 33 of 77 ms
on the CPU cluster). An agent waits for every turn's first token, so here the first batch
leaves as soon as anything is ready; later chunks are batched as before, and the last batch
leaves when the stream ends, not at the next tick.
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, AsyncIterator, TypeVar

T = TypeVar("T")


async def eager_first_batches(stream: AsyncIterator[T], interval_s: float) -> AsyncGenerator[list[T], None]:
    """Yields lists of `stream`'s items: the first as soon as one exists, then one per interval.

    Items that arrive together (vLLM's role chunk and first token) share the first batch.
    An error in `stream` is raised after the items before it are yielded; closing this
    generator (a client that went away) cancels the read of `stream`.

    Args:
        stream: the engine's output stream.
        interval_s: how long later items are gathered; 0 sends every item alone.
    """
    if interval_s < 0:
        raise ValueError(f"interval_s must be >= 0, got {interval_s}")
    if interval_s == 0:
        try:
            async for item in stream:
                yield [item]
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:  # closed with this generator, as the reader is cancelled below
                await close()
        return
    queue: list[T] = []
    ready = asyncio.Event()  # set when an item arrives or the stream ends
    ended = asyncio.Event()

    async def read() -> None:
        try:
            async for item in stream:
                queue.append(item)
                ready.set()
        finally:
            ended.set()
            ready.set()

    reader = asyncio.create_task(read())
    try:
        is_first = True
        while True:
            if is_first:
                await ready.wait()
            elif not ended.is_set():
                try:
                    await asyncio.wait_for(ended.wait(), timeout=interval_s)
                except asyncio.TimeoutError:
                    pass
            ready.clear()
            if queue:
                batch = queue[:]
                queue.clear()
                is_first = False
                yield batch
            if ended.is_set() and not queue:
                await reader  # re-raises the stream's error, if any
                return
    finally:
        if not reader.done():
            reader.cancel()
            await asyncio.wait([reader])  # the engine sees the abort before the close returns
        elif not reader.cancelled():
            reader.exception()  # a stream that failed after its reader left: retrieved, not logged as lost
