"""A replica's first streamed chunk is not held for a batching interval; later ones are batched."""

from __future__ import annotations

import asyncio

import pytest

from serve_apps.stream_batches import eager_first_batches

LONG_S = 60.0  # an interval no test waits out: a batch that needs it fails the 5 s timeout
WAIT_S = 5.0


END = object()


class Source:
    """An engine stream the test drives: each `send` is a group of items produced together."""

    def __init__(self, first: list[str]) -> None:
        self.commands: asyncio.Queue = asyncio.Queue()
        self.commands.put_nowait(first)
        self.was_cancelled = False

    def send(self, command) -> None:
        """A list of items, an exception to raise, or END."""
        self.commands.put_nowait(command)

    async def __aiter__(self):
        try:
            while True:
                command = await self.commands.get()
                if command is END:
                    return
                if isinstance(command, Exception):
                    raise command
                for item in command:
                    yield item
        except asyncio.CancelledError:
            self.was_cancelled = True
            raise


async def _next(batches):
    return await asyncio.wait_for(anext(batches), WAIT_S)


def test_items_ready_together_leave_at_once_as_the_first_batch():
    async def run():
        source = Source(["role", "token-1"])
        batches = eager_first_batches(aiter(source), LONG_S)
        first = await _next(batches)
        await batches.aclose()
        return first

    assert asyncio.run(run()) == ["role", "token-1"]


def test_later_items_are_gathered_and_the_end_flushes_without_waiting_for_the_interval():
    async def run():
        source = Source(["role"])
        batches = eager_first_batches(aiter(source), LONG_S)
        got = [await _next(batches)]
        source.send(["a", "b", "c"])
        source.send(END)
        got.append(await _next(batches))
        with pytest.raises(StopAsyncIteration):
            await _next(batches)
        return got

    assert asyncio.run(run()) == [["role"], ["a", "b", "c"]]


def test_short_interval_sends_later_items_without_the_stream_ending():
    async def run():
        source = Source(["role"])
        batches = eager_first_batches(aiter(source), 0.01)
        got = [await _next(batches)]
        source.send(["a", "b"])
        got.append(await _next(batches))  # the stream is still open: the interval sent it
        await batches.aclose()
        return got, source.was_cancelled

    got, was_cancelled = asyncio.run(run())
    assert got == [["role"], ["a", "b"]]
    assert was_cancelled


def test_an_error_is_raised_after_the_items_before_it():
    async def run():
        source = Source(["role"])
        batches = eager_first_batches(aiter(source), LONG_S)
        got = [await _next(batches)]
        source.send(["a"])
        source.send(RuntimeError("engine died"))
        got.append(await _next(batches))
        with pytest.raises(RuntimeError, match="engine died"):
            await _next(batches)
        return got

    assert asyncio.run(run()) == [["role"], ["a"]]


def test_closing_the_batches_cancels_the_read_of_the_stream():
    async def run():
        source = Source(["role"])
        batches = eager_first_batches(aiter(source), LONG_S)
        await _next(batches)
        await batches.aclose()
        return source.was_cancelled

    assert asyncio.run(run())


def test_closing_the_batches_closes_the_stream_with_a_zero_interval_too():
    """Without a reader to cancel, the engine's stream was left to the garbage collector: a caller that left
    kept it decoding for as long as anything held it."""
    async def run():
        closed = []

        async def stream():
            try:
                for item in ("role", "a", "b"):
                    yield item
            finally:
                closed.append(True)

        engine = stream()  # still held: not closed by the collector
        batches = eager_first_batches(engine, 0)
        await _next(batches)
        await batches.aclose()
        return list(closed)  # as the close returned

    assert asyncio.run(run()) == [True]


def test_zero_interval_sends_every_item_alone():
    async def run():
        async def stream():
            for item in ("role", "a", "b"):
                yield item

        return [batch async for batch in eager_first_batches(stream(), 0)]

    assert asyncio.run(run()) == [["role"], ["a"], ["b"]]


def test_negative_interval_is_refused():
    async def run():
        async def stream():
            yield "x"

        return [b async for b in eager_first_batches(stream(), -1)]

    with pytest.raises(ValueError, match="interval_s"):
        asyncio.run(run())


def test_the_replica_overrides_the_hooks_ray_serve_llm_calls():
    """The replica replaces `LLMServer._batch_output_stream`; a Ray upgrade that renames it must fail here."""
    from ray.llm._internal.serve.core.server.llm_server import LLMServer

    from serve_apps.vllm_replica import WarmpathLLMServer

    assert callable(getattr(LLMServer, "_batch_output_stream", None))
    assert callable(getattr(LLMServer, "_get_batch_interval_ms", None))
    assert WarmpathLLMServer._batch_output_stream is not LLMServer._batch_output_stream
