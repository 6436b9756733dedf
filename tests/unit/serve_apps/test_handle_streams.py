"""Streaming handle calls are cancelled where their reader stops before their end: the orchestrator's model
calls, the gRPC ingress's model and turn streams, the HTTP ingress's turn streams."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_apps.handle_streams import cancelled_if_left


class _Call:
    """A streaming handle call: `items`, then (with `endless`) nothing until cancelled."""

    def __init__(self, items, endless: bool = True) -> None:
        self.items = list(items)
        self.endless = endless
        self.num_cancels = 0

    def cancel(self) -> None:
        self.num_cancels += 1

    def __aiter__(self):
        return self._items()

    async def _items(self):
        for item in self.items:
            yield item
        if self.endless:
            await asyncio.Event().wait()


@pytest.mark.parametrize("leaving", [GeneratorExit, asyncio.CancelledError, RuntimeError])
def test_a_block_left_by_an_exception_cancels_the_call(leaving):
    call = _Call([])
    with pytest.raises(leaving):
        with cancelled_if_left(call):
            raise leaving()
    assert call.num_cancels == 1


def test_a_block_that_ends_leaves_the_call_be_and_a_failing_cancel_hides_nothing():
    call = _Call([])
    with cancelled_if_left(call):
        pass
    assert call.num_cancels == 0

    class Broken(_Call):
        def cancel(self) -> None:
            raise RuntimeError("the handle is gone")

    with pytest.raises(asyncio.CancelledError):  # what was going on, not the cancel's failure
        with cancelled_if_left(Broken([])):
            raise asyncio.CancelledError()


def _read_one_then_leave(stream_of_items, how: str):
    """Reads the first item of an async generator, then closes it or cancels the task reading it."""
    async def main():
        agen = stream_of_items
        await anext(agen)
        if how == "closed":
            await agen.aclose()
            return
        reading = asyncio.ensure_future(anext(agen))
        await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(main())


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_a_model_call_of_the_orchestrator_is_cancelled_when_its_turn_stops(how):
    from serve_apps.orchestrator import deployment

    frame = {"choices": [{"index": 0, "delta": {"content": "Once"}}]}
    call = _Call([f"data: {json.dumps(frame)}\n\n"])

    class Handle:
        def options(self, **kwargs):
            return self

        chat = property(lambda self: self)

        def remote(self, request, raw_request_info):
            return call

    client = deployment.HandleModelClient(Handle(), "m")
    _read_one_then_leave(client.chat("s1", [{"role": "user", "content": "hi"}], [], "auto", 4000).__aiter__(), how)
    assert call.num_cancels == 1


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_a_turn_stream_of_the_grpc_ingress_is_cancelled_when_its_caller_leaves(how):
    from serve_apps import ingress_grpc

    ingress = object.__new__(ingress_grpc.GrpcIngress)
    call = _Call([{"status": 200, "body": {}}, {"kind": "delta", "text": "Once"}])
    context = type("Context", (), {"set_trailing_metadata": lambda self, metadata: None})()
    _read_one_then_leave(ingress._turn_events(call, context, rpc=None), how)
    assert call.num_cancels == 1


@pytest.mark.parametrize("how", ["closed", "cancelled"])
def test_a_turn_stream_of_the_http_ingress_is_cancelled_when_its_client_leaves(how):
    from serve_apps import ingress_http

    call = _Call([{"kind": "delta", "text": "Once"}])
    frames = ingress_http._sse({"status": 200}, call.__aiter__(), stream=call)
    _read_one_then_leave(frames, how)
    assert call.num_cancels == 1


def test_a_turn_read_to_its_end_is_not_cancelled():
    from serve_apps import ingress_http

    call = _Call([{"kind": "delta", "text": "Once"}, {"kind": "final", "message": {}}], endless=False)

    async def read():
        return [frame async for frame in ingress_http._sse({"status": 200}, call.__aiter__(), stream=call)]

    assert len(asyncio.run(read())) == 3 and call.num_cancels == 0
