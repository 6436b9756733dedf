"""Fault scenarios of `warmpath chaos` on the real cluster: parts die, no committed turn is lost.

Each test runs one scenario of `bench.chaos` (the code `warmpath chaos` runs)
and asserts on the fate of every turn. The scenarios that kill replicas or
restart Redis run after the other tests (`disrupts_replicas`) and wait until
the cluster is whole again before they return.
"""

from __future__ import annotations

import uuid

import pytest

from bench import chaos

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(cluster):
    return chaos.ChaosClient(cluster.base_url, cluster.api_key)


def _quiet(msg: str) -> None:
    print(f"[chaos] {msg}", flush=True)


def test_a_retried_turn_with_the_same_idempotency_key_is_replayed_not_rerun(cluster, client):
    sid = client.create_session(cluster.model_id)
    key = str(uuid.uuid4())
    first = cluster.client.post(f"/v1/sessions/{sid}/messages", json={"content": "once only"}, headers={"idempotency-key": key})
    again = cluster.client.post(f"/v1/sessions/{sid}/messages", json={"content": "once only"}, headers={"idempotency-key": key})
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert "x-warmpath-idempotent-replay" not in first.headers
    assert again.headers["x-warmpath-idempotent-replay"] == "true"
    assert again.json()["message"] == first.json()["message"]
    # The replay carries every event the turn produced, text deltas included.
    assert again.json()["events"] == first.json()["events"]
    assert [m["role"] for m in client.transcript(sid)] == ["user", "assistant"]


def test_an_idempotency_key_reused_with_another_request_is_refused(cluster, client):
    sid = client.create_session(cluster.model_id)
    key = str(uuid.uuid4())
    first = cluster.client.post(f"/v1/sessions/{sid}/messages", json={"content": "once only"}, headers={"idempotency-key": key})
    assert first.status_code == 200, first.text
    for body in ({"content": "something else"}, {"content": "once only", "tool_choice": "none"}):
        other = cluster.client.post(f"/v1/sessions/{sid}/messages", json=body, headers={"idempotency-key": key})
        assert other.status_code == 422, other.text
        assert other.json()["error"]["code"] == "idempotency_key_reused"
    # Streaming or not is the same request: still a replay.
    again = cluster.client.post(
        f"/v1/sessions/{sid}/messages", json={"content": "once only", "stream": True}, headers={"idempotency-key": key}
    )
    assert again.status_code == 200 and again.headers["x-warmpath-idempotent-replay"] == "true"
    assert [m["role"] for m in client.transcript(sid)] == ["user", "assistant"]


def test_faulty_tools_become_errors_the_model_sees_within_the_deadline(cluster, client):
    result = chaos.tool_faults(client, cluster.cfg, _quiet)
    assert (result.num_attempted, result.num_completed, result.num_lost) == (3, 3, 0), chaos.report([result])
    assert all("the model saw an error result" in note for note in result.notes), chaos.report([result])


def test_a_client_that_hangs_up_mid_stream_leaves_no_half_turn(cluster, client):
    result = chaos.client_disconnect(client, cluster.cfg, _quiet)
    assert result.num_lost == 0 and not result.broken_promises, chaos.report([result])
    assert result.num_completed == result.num_attempted == 3, chaos.report([result])


@pytest.mark.disrupts_replicas
def test_killing_a_replica_mid_turn_loses_no_turn(cluster, client):
    result = chaos.replica_kill(client, cluster.cfg, _quiet, num_sessions=20)
    report = chaos.report([result])
    assert result.num_attempted == 20 and result.num_lost == 0 and not result.broken_promises, report
    assert result.num_completed == 20, report  # a failed model call is retried on the surviving replica


@pytest.mark.disrupts_replicas
def test_a_replica_whose_engine_dies_leaves_and_no_turn_needs_sending_again(cluster, client):
    """Alive with a dead engine, a replica failed every call at once for the 20-30 s Serve took to notice, and the
    orchestrator's retry went back to it: turns failed 502 and clients had to send them again."""
    result = chaos.engine_kill(client, cluster.cfg, _quiet, num_sessions=8)
    report = chaos.report([result])
    assert result.num_attempted == 16 and result.num_lost == 0 and not result.broken_promises, report
    assert result.num_completed == 16, report


@pytest.mark.disrupts_replicas
def test_killing_the_orchestrator_mid_turn_loses_no_turn(cluster, client):
    result = chaos.orchestrator_kill(client, cluster.cfg, _quiet, num_sessions=6)
    report = chaos.report([result])
    assert result.num_attempted == 6 and result.num_lost == 0 and not result.broken_promises, report
    assert result.num_completed + result.num_failed_cleanly == 6, report


@pytest.mark.disrupts_replicas
def test_redis_restart_keeps_committed_turns_and_outages_fail_fast(cluster, client):
    result = chaos.redis_restart(client, cluster.cfg, _quiet, num_sessions=3)
    report = chaos.report([result])
    assert result.num_lost == 0 and not result.broken_promises, report
    # 3 before the restart and 3 after complete; the 3 sent while Redis was down fail with 503.
    assert (result.num_attempted, result.num_completed, result.num_failed_cleanly) == (9, 6, 3), report
    outage_notes = [n for n in result.notes if n.startswith("during outage")]
    assert len(outage_notes) == 3 and all("503" in n for n in outage_notes), report
    assert not any("expected 503" in n for n in result.notes), report
    # Each call during the outage failed fast: one waiting on Redis would run into the client's 300 s timeout.
    outage_seconds = [float(note.rsplit(" in ", 1)[1].rstrip("s")) for note in outage_notes]
    assert max(outage_seconds) < 60, report
