"""The schema check's budget is the checking thread's CPU time: time the thread waits does not count.

Why: the check runs on the orchestrator's event loop, which waits whenever another thread holds the GIL
(a tool reply's JSON parsed beside it: 0.1-0.3 s for 8 MB) or the host is busy; on a wall clock, a valid
call's check of microseconds ran past the 0.1 s budget and the call was refused as a schema violation.
"""

from __future__ import annotations

import time

import pytest
from jsonschema import Draft202012Validator, validators

from serve_apps.orchestrator.check_deadline import CheckTimeout, check_deadline, deadline_checked


def _validator(keyword):
    """A deadline-checked validator with one extra keyword, `x-step`, running `keyword` before `type`."""
    extended = validators.extend(Draft202012Validator, {"x-step": lambda validator, value, instance, schema: keyword()})
    return deadline_checked(extended)({"x-step": True, "allOf": [{"type": "object"}, {"required": []}]})


def test_time_the_checking_thread_waits_is_not_spent_from_the_budget():
    waiting = _validator(lambda: time.sleep(0.15))  # waits (the GIL, the host): no CPU of this thread
    with check_deadline(0.1):
        assert list(waiting.iter_errors({})) == []


def test_cpu_the_checking_thread_spends_is():
    def spin():
        start = time.thread_time()
        while time.thread_time() - start < 0.15:
            pass

    spinning = _validator(spin)
    with pytest.raises(CheckTimeout), check_deadline(0.1):
        list(spinning.iter_errors({}))
