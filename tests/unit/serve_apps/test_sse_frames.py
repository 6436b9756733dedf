"""serve_apps.sse_frames: the data lines of a replica's streamed output, batched or not."""

from __future__ import annotations

import pytest

from serve_apps.sse_frames import data_objects, sse_payloads

BATCHED = 'data: {"id": 1}\n\ndata: {"id": 2, "usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n'


def test_every_object_of_a_batched_frame_in_order():
    assert sse_payloads(BATCHED) == [{"id": 1}, {"id": 2, "usage": {"prompt_tokens": 3}}]


def test_lines_that_are_not_json_objects_are_skipped_with_their_positions_kept():
    lines = ['data: {"id": 1}', "", "data: {not json", ": keep-alive", "data: [1, 2]", 'data: {"id": 3}']
    assert list(data_objects(lines)) == [(0, {"id": 1}), (5, {"id": 3})]


def test_an_engine_output_object_is_read_as_its_text():
    class Output:
        def __str__(self) -> str:
            return 'data: {"id": 7}\n\n'

    assert sse_payloads(Output()) == [{"id": 7}]


@pytest.mark.parametrize("line", ["data: {not json", "data: [1, 2]"])
def test_a_reader_that_rebuilds_the_reply_is_told_of_a_malformed_line(line):
    with pytest.raises(ValueError, match="not a JSON object"):
        sse_payloads(f'data: {{"id": 1}}\n\n{line}\n\n')


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x0b", "\x1c"])
def test_generated_text_holding_a_line_separator_other_than_the_streams_is_read_back_whole(char):
    """vLLM writes each chunk with pydantic's `model_dump_json`, which leaves these raw inside strings."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )

    chunk = ChatCompletionStreamResponse(id="chatcmpl-1", model="m", created=0, choices=[
        ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=f"a{char}b"))])
    frame = f"data: {chunk.model_dump_json(exclude_unset=True)}\n\ndata: [DONE]\r\n\r\n"
    (payload,) = sse_payloads(frame)
    assert payload["choices"][0]["delta"]["content"] == f"a{char}b"
