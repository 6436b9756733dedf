"""`gc_pause`: the collector is off while any pause runs, and back as it was after the last."""

from __future__ import annotations

import gc

from serve_apps.orchestrator.gc_pause import gc_paused


def test_pauses_of_the_collector_nest_and_keep_it_off_if_it_was():
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
