"""`warmpath chaos` audits each turn between its own user message and the next one, never counts a broken
promise as a pass, and gives the cluster its Redis back whatever a restart scenario met."""

from __future__ import annotations

import httpx
import pytest

from bench import chaos
from bench.chaos import ScenarioResult, TurnFate, audit
from cluster import local
from cluster.config import load_config


def _user(content):
    return {"role": "user", "content": content}


ANSWER = {"role": "assistant", "content": "done"}
CALL = {"role": "assistant", "tool_calls": [{"id": "c1", "name": "t", "arguments": "{}"}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "{}"}


class _Transcripts:
    def __init__(self, transcripts: dict[str, list[dict]]) -> None:
        self._transcripts = transcripts

    def transcript(self, session_id):
        if session_id not in self._transcripts:
            response = httpx.Response(404, request=httpx.Request("GET", f"http://x/v1/sessions/{session_id}"))
            raise httpx.HTTPStatusError("404", request=response.request, response=response)
        return self._transcripts[session_id]


def _fate(content, status="completed", session_id="s1"):
    return TurnFate(session_id, content, "key", status=status)


def test_a_half_written_turn_is_lost_even_when_a_later_turn_answered():
    client = _Transcripts({"s1": [_user("first"), _user("second"), ANSWER]})  # "first" has no answer of its own
    result = audit(client, [_fate("first"), _fate("second")], ScenarioResult("x"))
    assert (result.num_completed, result.num_lost) == (1, 1)


def test_whole_turns_complete_and_absent_failed_turns_failed_cleanly():
    client = _Transcripts({"s1": [_user("a"), CALL, RESULT, ANSWER, _user("b"), CALL]})  # b awaits client tools
    result = audit(client, [_fate("a"), _fate("b"), _fate("c", status="failed")], ScenarioResult("x"))
    assert (result.num_completed, result.num_failed_cleanly, result.num_lost) == (2, 1, 0)


def test_a_session_gone_loses_its_committed_turns_instead_of_ending_the_run():
    result = audit(_Transcripts({}), [_fate("a", session_id="gone"), _fate("b", "failed", "gone")], ScenarioResult("x"))
    assert (result.num_lost, result.num_failed_cleanly) == (1, 1)


@pytest.mark.parametrize("stops, failure", [(False, None), (True, KeyboardInterrupt())])
def test_a_redis_restart_that_did_not_happen_is_a_broken_promise_and_redis_comes_back(
    tmp_path, monkeypatch, stops, failure
):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    local.LocalState(redis_pid=4242, redis_port=6380).save(tmp_path)
    calls = []
    monkeypatch.setattr(chaos, "_fates", lambda client, cfg, num, label: [_fate(f"{label} {i}") for i in range(2)])
    monkeypatch.setattr(local, "stop_redis", lambda state, progress, timeout_s: calls.append("stop") or stops)
    monkeypatch.setattr(local, "start_redis", lambda cfg, state, progress: calls.append("start"))
    monkeypatch.setattr(chaos, "audit", lambda client, fates, result: result)

    class _Client:
        def send_turn(self, fate, deadline_s=None, **kwargs):
            if failure is not None and "during" in fate.content:
                raise failure
            fate.last_error = "503: store_unavailable"

    if failure is None:
        result = chaos.redis_restart(_Client(), cfg, progress=lambda msg: None)
        assert result.broken_promises == ["Redis did not stop, so no outage was tried"]
    else:
        with pytest.raises(KeyboardInterrupt):
            chaos.redis_restart(_Client(), cfg, progress=lambda msg: None)
    assert calls == ["stop", "start"]
