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
