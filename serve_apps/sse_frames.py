"""Reading the `data: {...}` lines of vLLM's streamed chat output.

Why one reader: the orchestrator, the gRPC ingress and the HTTP ingress all
look inside the same server-sent-event text (chunks, usage, errors), and a
replica may batch several chunks into one frame, `data: [DONE]` included.
"""

from __future__ import annotations

import json
import re
from typing import Iterator, Sequence

DATA_PREFIX = "data: "
DONE_LINE = "data: [DONE]"
_LINE_END = re.compile(r"\r\n|\r|\n")


def data_objects(lines: Sequence[str], *, is_strict: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, parsed object) of each `data:` line but `[DONE]`.

    A data line that is not a JSON object is skipped, or with `is_strict`
    raises ValueError: a reader that rebuilds the reply from the chunks must
    not lose one silently, while one that passes frames on untouched need not care.
    """
    for position, line in enumerate(lines):
        if not line.startswith(DATA_PREFIX) or line == DONE_LINE:
            continue
        try:
            payload = json.loads(line[len(DATA_PREFIX):])
        except ValueError:
            payload = None
        if isinstance(payload, dict):
            yield position, payload
        elif is_strict:
            raise ValueError(f"a streamed output line is not a JSON object: {line[:200]!r}")


def sse_lines(frame: str) -> list[str]:
    """The lines of event-stream text, split where the stream ends its lines: CR LF, LF or CR.

    Not `str.splitlines`, which also splits at U+2028, U+2029, U+0085 and the like: JSON
    strings may hold those raw (vLLM writes generated text as it is), and a chunk cut there
    is no JSON.
    """
    return _LINE_END.split(frame)


def has_done_line(frame: str) -> bool:
    """Whether `frame` holds the stream's `data: [DONE]` line; not that text inside a chunk (`echo` of a
    prompt holding it, or a model that writes it), which a substring test took for the stream's end."""
    return DONE_LINE in frame and DONE_LINE in sse_lines(frame)


def sse_payloads(frame: str) -> list[dict]:
    """The JSON objects of one streamed engine output, in order; raises ValueError on a malformed data line."""
    return [payload for _, payload in data_objects(sse_lines(str(frame)), is_strict=True)]


def frame_errors(frame: str) -> list[dict]:
    """The `error` object of each data chunk in one frame of streamed output (an engine's failure mid-stream)."""
    if '"error"' not in frame:
        return []
    errors = (payload.get("error") for _, payload in data_objects(sse_lines(frame)))
    return [error for error in errors if isinstance(error, dict)]


def stream_leading_error(chunk: object) -> dict | None:
    """The `error` of a stream whose first data chunk is an error (vLLM refused it after the stream began)."""
    if not isinstance(chunk, str) or '"error"' not in chunk:
        return None
    for _, payload in data_objects(sse_lines(chunk)):
        error = payload.get("error")
        return error if isinstance(error, dict) else None
    return None
