"""The HTTP ingress records a streamed response's usage once, before `[DONE]` reaches the client."""

from __future__ import annotations

import asyncio
import json

import pytest

from serve_apps import ingress_http, sse_frames


def _chunk(usage=None) -> str:
    return "data: " + json.dumps({"choices": [] if usage else [{"delta": {"content": "x"}}], "usage": usage}) + "\n\n"


USAGE = {"prompt_tokens": 640, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 608}}


@pytest.mark.parametrize(
    "frames",
    [
        [_chunk(), _chunk(USAGE), "data: [DONE]\n\n"],
        [_chunk(), _chunk(USAGE) + "data: [DONE]\n\n"],  # batched into one frame
    ],
    ids=["separate", "batched"],
)
def test_usage_is_recorded_before_done_is_sent(monkeypatch, frames):
    events = []
    monkeypatch.setattr(
        ingress_http, "_record_usage",
        lambda logged, served_by, usage: events.append(
            ("record", usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
        ),
    )

    async def source():
        for frame in frames:
            yield frame

    async def consume():
        async for frame in ingress_http._recording_usage(source(), None, None):
            events.append(("sent", "[DONE]" in frame))

    asyncio.run(consume())
    assert events.count(("record", 640, 608)) == 1 and len([e for e in events if e[0] == "record"]) == 1
    assert events.index(("record", 640, 608)) < events.index(("sent", True))


def test_a_stream_that_breaks_off_is_still_recorded_and_ends_as_a_failed_stream_does(monkeypatch):
    """The 200 went out: an error frame then [DONE] end it, as vLLM ends a failed stream (a bare close reads
    as a transport error to OpenAI's clients), and the replica's text stays in the log."""
    recorded = []
    monkeypatch.setattr(ingress_http, "_record_usage", lambda logged, served_by, usage: recorded.append(usage))

    async def source():
        yield _chunk()
        raise RuntimeError("replica died at /app/secret.py line 12")

    async def consume():
        return [frame async for frame in ingress_http._recording_usage(source(), None, None)]

    frames = asyncio.run(consume())
    assert recorded == [None]
    error_frame, done = frames[-1].split("\n\n")[:2]
    assert done == "data: [DONE]"
    error = json.loads(error_frame[len("data: "):])["error"]
    assert error["type"] == "InternalServerError" and "secret" not in error["message"]


def test_a_client_that_did_not_ask_for_usage_gets_no_usage_chunk(monkeypatch):
    """The ingress asks the engine for usage (the router's counters); the client did not, so it never sees it."""
    recorded = []
    monkeypatch.setattr(ingress_http, "_record_usage", lambda logged, served_by, usage: recorded.append(usage))
    frames = [_chunk(), _chunk(USAGE), _chunk() + _chunk(USAGE) + "data: [DONE]\n\n"]

    async def source():
        for frame in frames:
            yield frame

    async def consume(is_usage_asked):
        return [frame async for frame in ingress_http._recording_usage(source(), None, None, is_usage_asked)]

    sent = asyncio.run(consume(False))
    assert sent == [_chunk(), _chunk() + "data: [DONE]\n\n"]
    assert recorded == [USAGE]
    assert asyncio.run(consume(True)) == frames


@pytest.mark.parametrize("options, is_asked", [(None, False), ({"include_usage": False}, False), ({"include_usage": True}, True)])
def test_usage_is_asked_for_only_by_include_usage(options, is_asked):
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    if options is not None:
        body["stream_options"] = options
    assert ingress_http.asks_for_usage(ChatCompletionRequest.model_validate(body)) is is_asked


def test_a_stream_refused_before_its_first_token_is_an_error_status():
    error = {"message": "Failed to transform json schema into a grammar", "type": "BadRequestError", "code": 400}
    assert sse_frames.stream_leading_error("data: " + json.dumps({"error": error}) + "\n\n") == error
    assert sse_frames.stream_leading_error(_chunk() + "data: " + json.dumps({"error": error}) + "\n\n") is None
    assert sse_frames.stream_leading_error(_chunk()) is None
    assert sse_frames.stream_leading_error(["not a frame"]) is None


def test_a_stream_dropped_before_it_started_is_recorded_once_when_collected(monkeypatch):
    """Starlette drops the body of a response whose client left before it began, never iterating it."""
    import gc

    recorded = []
    monkeypatch.setattr(ingress_http, "_record_usage", lambda logged, served_by, usage: recorded.append(usage))

    async def source():
        yield _chunk(USAGE)
        yield "data: [DONE]\n\n"

    dropped = ingress_http._recording_usage(source(), None, None)
    del dropped
    gc.collect()
    assert recorded == [None]

    async def consume():
        return [frame async for frame in ingress_http._recording_usage(source(), None, None)]

    asyncio.run(consume())
    gc.collect()
    assert recorded == [None, USAGE]  # a stream that ran records its own usage, and only that


def _finishing(fingerprint=None) -> str:
    chunk = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    if fingerprint is not None:
        chunk["system_fingerprint"] = fingerprint
    return "data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n"


def _usage_only(fingerprint: str) -> str:
    return "data: " + json.dumps({"choices": [], "usage": USAGE, "system_fingerprint": fingerprint}) + "\n\n"


@pytest.mark.parametrize(
    "frames",
    [
        [_chunk(), _finishing(), _usage_only("vllm-0.32-ab12cd34"), "data: [DONE]\n\n"],
        [_chunk(), _finishing() + _usage_only("vllm-0.32-ab12cd34") + "data: [DONE]\n\n"],  # batched
        [_chunk(), _finishing(), _usage_only("vllm-0.32-ab12cd34") + "data: [DONE]\n\n"],
    ],
    ids=["separate", "batched", "usage-with-done"],
)
def test_a_client_that_did_not_ask_for_usage_gets_the_fingerprint_on_its_finishing_chunk(monkeypatch, frames):
    """As vLLM sends it without usage: the ingress asked for usage, so vLLM put it on the chunk the client never sees."""
    monkeypatch.setattr(ingress_http, "_record_usage", lambda logged, served_by, usage: None)

    async def source():
        for frame in frames:
            yield frame

    async def consume():
        return [frame async for frame in ingress_http._recording_usage(source(), None, None, False)]

    sent = "".join(asyncio.run(consume()))
    chunks = [json.loads(line[len("data: "):]) for line in sent.split("\n") if line.startswith("data: {")]
    assert [chunk.get("system_fingerprint") for chunk in chunks] == [None, "vllm-0.32-ab12cd34"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and sent.endswith("data: [DONE]\n\n")


def test_a_finishing_chunk_kept_back_for_its_fingerprint_still_goes_out_when_the_stream_breaks_off(monkeypatch):
    monkeypatch.setattr(ingress_http, "_record_usage", lambda logged, served_by, usage: None)

    async def source():
        yield _finishing()
        raise RuntimeError("replica died")

    async def consume():
        return [frame async for frame in ingress_http._recording_usage(source(), None, None, False)]

    sent = "".join(asyncio.run(consume()))
    assert sent.startswith(_finishing()) and sent.endswith("data: [DONE]\n\n") and '"error"' in sent


def test_a_chunk_given_the_fingerprint_keeps_its_text_as_written():
    finishing = 'data: {"choices":[{"index":0,"delta":{"content":"h\u00e9llo"},"finish_reason":"stop"}]}\n\n'
    stamped = ingress_http.with_fingerprint(finishing, "fp-1")
    assert stamped == 'data: {"choices":[{"index":0,"delta":{"content":"h\u00e9llo"},"finish_reason":"stop"}],' \
                      '"system_fingerprint":"fp-1"}\n\n'


def test_the_text_data_done_inside_a_chunk_is_not_the_end_of_the_stream(monkeypatch):
    """An echoed prompt, or a model, writing `data: [DONE]`: the call was recorded there (with no usage), then
    again at the real end."""
    recorded = []
    monkeypatch.setattr(ingress_http, "_record_usage", lambda logged, served_by, usage: recorded.append(usage))
    text = "data: " + json.dumps({"choices": [{"delta": {"content": "say data: [DONE] now"}}]}) + "\n\n"

    async def source():
        for frame in (text, _chunk(USAGE), "data: [DONE]\n\n"):
            yield frame

    async def consume():
        return [frame async for frame in ingress_http._recording_usage(source(), None, None, is_usage_asked=False)]

    frames = asyncio.run(consume())
    assert recorded == [USAGE]
    assert frames[0] == text and frames[-1] == "data: [DONE]\n\n"
