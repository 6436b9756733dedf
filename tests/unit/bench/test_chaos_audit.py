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
    monkeypatch.setattr(local, "stop_redis", lambda state, progress, timeout_s, data_dir: calls.append("stop") or stops)
    monkeypatch.setattr(local, "start_redis", lambda cfg, state, progress: calls.append("start"))
    monkeypatch.setattr(chaos, "audit", lambda client, fates, result: result)

    class _Client:
        def send_turn(self, fate, deadline_s=None, **kwargs):
            if failure is not None and "during" in fate.content:
                raise failure
            if "during" in fate.content:
                fate.last_error = "503: store_unavailable"
            else:
                fate.status = "completed"

    if failure is None:
        result = chaos.redis_restart(_Client(), cfg, progress=lambda msg: None)
        assert result.broken_promises == ["Redis did not stop, so no outage was tried"]
    else:
        with pytest.raises(KeyboardInterrupt):
            chaos.redis_restart(_Client(), cfg, progress=lambda msg: None)
    assert calls == ["stop", "start"]


class _ScriptedTurns:
    """A client whose turns end as `fate_of(fate)` says, timed by `seconds_of(fate)`."""

    def __init__(self, fate_of, seconds_of=lambda fate: 0.0):
        self._fate_of, self._seconds_of = fate_of, seconds_of
        self.now = 0.0

    def send_turn(self, fate, deadline_s=None, **kwargs):
        self.now += self._seconds_of(fate)
        fate.status, fate.last_error = self._fate_of(fate)


def _restart(tmp_path, monkeypatch, client):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    local.LocalState(redis_pid=4242, redis_port=6380).save(tmp_path)
    monkeypatch.setattr(chaos, "_fates", lambda client, cfg, num, label: [_fate(f"{label} {i}", "failed") for i in range(2)])
    monkeypatch.setattr(local, "stop_redis", lambda state, progress, timeout_s, data_dir: True)
    monkeypatch.setattr(local, "start_redis", lambda cfg, state, progress: None)
    monkeypatch.setattr(chaos, "audit", lambda client, fates, result: result)
    monkeypatch.setattr(chaos.time, "monotonic", lambda: client.now)
    return chaos.redis_restart(client, cfg, progress=lambda msg: None)


def _outage_fails(fate):
    return ("failed", "503: store_unavailable") if "during" in fate.content else ("completed", "")


@pytest.mark.parametrize("fate_of, seconds_of, broken", [
    (_outage_fails, lambda fate: 0.1, []),
    # Turns that never commit, before or after: nothing was seen to survive, and the cluster did not recover.
    (lambda fate: ("failed", "503: store_unavailable"), lambda fate: 0.1,
     ["no turn committed before the restart", "2 of 2 turns after the restart did not complete"]),
    # A 503 that took most of the client's timeout is no fast failure.
    (_outage_fails, lambda fate: 299.0 if "during" in fate.content else 0.1, ["took 299.0s to fail"]),
])
def test_a_redis_restart_passes_only_where_turns_survive_outage_calls_fail_fast_and_the_cluster_recovers(
    tmp_path, monkeypatch, fate_of, seconds_of, broken
):
    result = _restart(tmp_path, monkeypatch, _ScriptedTurns(fate_of, seconds_of))
    assert all(any(part in said for said in result.broken_promises) for part in broken), result.broken_promises
    assert bool(result.broken_promises) == bool(broken), result.broken_promises


class _StreamingClient(_ScriptedTurns):
    """`client_disconnect`'s client: every stream answers `status` with `lines`."""

    def __init__(self, status, lines, fate_of):
        super().__init__(fate_of)
        self.http = self
        self._status, self._lines = status, lines

    def stream(self, method, url, json):
        import contextlib

        response = httpx.Response(self._status, content="\n".join(self._lines).encode())
        return contextlib.nullcontext(response)

    def transcript(self, session_id):
        return []


@pytest.mark.parametrize("status, lines, follow_up, broken", [
    (200, ["event: delta", "data: {}"], ("completed", ""), []),
    # A refused turn streams no event: the client read it whole and never hung up.
    (409, ['{"error": {"code": "session_busy"}}'], ("completed", ""), ["streamed no event to hang up after (status 409)"]),
    # The hung-up turn kept the session's lock: the next turn never started.
    (200, ["event: delta", "data: {}"], ("failed", "409: busy"), ["3 of 3 turns after the hang-ups did not complete"]),
])
def test_a_client_disconnect_passes_only_where_the_client_hung_up_mid_turn_and_the_next_turn_ran(
    monkeypatch, status, lines, follow_up, broken
):
    cfg = load_config(environ={})
    monkeypatch.setattr(chaos, "_fates", lambda client, cfg, num, label, **kw: [
        _fate(f"{label} {i}", "failed", session_id=f"s{i}") for i in range(3)])
    monkeypatch.setattr(chaos, "audit", lambda client, fates, result: result)
    result = chaos.client_disconnect(_StreamingClient(status, lines, lambda fate: follow_up), cfg, lambda msg: None)
    assert all(any(part in said for said in result.broken_promises) for part in broken), result.broken_promises
    assert bool(result.broken_promises) == bool(broken), result.broken_promises


@pytest.mark.parametrize("turn_s, is_broken", [(5.0, False), (0.0, True)])
def test_a_kill_that_lands_after_every_turn_ended_is_a_broken_promise(monkeypatch, turn_s, is_broken):
    """The kill waits a fixed second: on a fast cluster every turn had ended, and an idle cluster's kill passed."""
    import threading

    import concurrent.futures

    release, submitted = threading.Event(), []

    class _Pool(concurrent.futures.ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            submitted.append(super().submit(*args, **kwargs))
            return submitted[-1]

    monkeypatch.setattr(chaos.concurrent.futures, "ThreadPoolExecutor", _Pool)
    cfg = load_config(environ={})
    monkeypatch.setattr(chaos, "_fates", lambda client, cfg, num, label, **create: [
        _fate(f"{label} {i}", "failed") for i in range(2)])
    monkeypatch.setattr(chaos, "_kill_serve_actor", lambda part: release.set() or "SERVE_REPLICA::app#Dep#r1")
    monkeypatch.setattr(chaos, "_wait_replaced", lambda cfg, killed: None)
    monkeypatch.setattr(local, "reap_orphaned_engines", lambda: [])
    monkeypatch.setattr(chaos, "audit", lambda client, fates, result: result)
    # The kill's wait ends once every turn ended (fast turns) or at once (turns still running).
    monkeypatch.setattr(chaos.time, "sleep", lambda seconds: None if turn_s else concurrent.futures.wait(submitted))

    class _Turns:
        def send_turn(self, fate, tool_choice="auto"):
            if turn_s:
                release.wait(10)
            fate.status = "completed"
            return fate

    result = chaos.replica_kill(_Turns(), cfg, lambda msg: None, num_sessions=2)
    assert bool(result.broken_promises) == is_broken, result.broken_promises
    assert f"with {0 if is_broken else 2} of 2 turns running" in result.notes[0]


def test_a_scenario_that_raises_is_a_broken_promise_and_the_others_run_and_are_written(monkeypatch):
    """A 4xx on session creation raised out of the whole run: the scenarios that finished were never written."""
    def fails(client, cfg, progress):
        raise httpx.HTTPStatusError("400 Bad Request", request=httpx.Request("POST", "http://x"),
                                    response=httpx.Response(400))

    monkeypatch.setitem(chaos.RUNNERS, "tool-faults", fails)
    monkeypatch.setitem(chaos.RUNNERS, "client-disconnect", lambda client, cfg, progress: ScenarioResult("client-disconnect", 3, 3))
    written = []
    results = chaos.run_chaos(load_config(environ={}), "http://x", None, ["tool-faults", "client-disconnect"],
                              lambda msg: None, on_result=lambda so_far: written.append([r.scenario for r in so_far]))
    assert results[0].broken_promises == ["the scenario failed: HTTPStatusError: 400 Bad Request"]
    assert results[1].num_completed == 3 and written == [["tool-faults"], ["tool-faults", "client-disconnect"]]
