"""`gc_paused`: no cyclic garbage collection while a check thread builds and drops a large parsed reply.

Why: a tool's reply (up to 8 MiB of JSON) parses into millions of lists and dicts, each allocation counting
toward the collector's thresholds; the full collections that follow walk every live object while holding
Python's lock, so the event loop of the replica stalled for a second and more (measured: 0.9 s to parse
8 MiB of `[[],[],...]` with collections, 0.14 s without). The parsed value is dropped before the pause
ends, so what the collector would have walked is gone by then; nothing it frees is cyclic.

Pauses nest across threads: the collector is enabled again when the last pause ends, and only if it was
enabled when the first began.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()
_num_paused = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disables the cyclic collector for the block (see the module docstring)."""
    global _num_paused, _was_enabled
    with _LOCK:
        if _num_paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _num_paused += 1
    try:
        yield
    finally:
        with _LOCK:
            _num_paused -= 1
            if _num_paused == 0 and _was_enabled:
                gc.enable()
