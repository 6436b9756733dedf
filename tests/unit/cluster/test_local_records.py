"""`warmpath up` records exactly what it started or joined, and `down` stops exactly that: one cluster per
state directory, the Redis it was given, a head whose start failed, and whatever `down` could not stop."""

from __future__ import annotations

import json
import math
import os
import socket
import stat
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from cluster import local
from cluster.cli import app
from cluster.config import load_config
from cluster.local import BringUpError, LocalState
from cluster.writable import unwritable_file_problem

needs_redis = pytest.mark.skipif(local.shutil.which("redis-server") is None, reason="redis-server is not installed")


def _cfg(tmp_path, **overrides):
    return load_config(environ={}, overrides={"state_dir": str(tmp_path), **overrides})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def no_ray(monkeypatch):
    """Nothing may start, stop or ask a Ray head."""
    monkeypatch.setattr(local, "_ray_head_up", lambda: pytest.fail("asked for a Ray head"))
    monkeypatch.setattr(local.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))


def test_a_state_dir_of_a_local_head_refuses_to_join_another_cluster(tmp_path, monkeypatch, no_ray):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head.example:10001")
    state = LocalState(ray_started=True, ray_session="session_1", ray_address="auto")
    with pytest.raises(BringUpError, match=r"records the local Ray head .* `warmpath down` first"):
        local.start_ray(_cfg(tmp_path), state, progress=lambda msg: None)
    assert state.dashboard_url == local.LOCAL_DASHBOARD_URL  # `down` would still stop the local head


@pytest.mark.parametrize("address", [None, "ray://other.example:10001"])
def test_a_state_dir_of_a_joined_cluster_refuses_another_one(tmp_path, monkeypatch, no_ray, address):
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    state = LocalState(ray_address="ray://head.example:10001", dashboard_url="http://head.example:8265")
    with pytest.raises(BringUpError, match=r"deployed on the Ray cluster at ray://head.example:10001"):
        local.start_ray(_cfg(tmp_path), state, progress=lambda msg: None)
    assert state.ray_address == "ray://head.example:10001" and state.dashboard_url == "http://head.example:8265"


def test_the_joined_cluster_can_be_joined_again(tmp_path, monkeypatch, no_ray):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head.example:10001")
    state = LocalState(ray_address="ray://head.example:10001", dashboard_url="http://head.example:8265")
    assert local.start_ray(_cfg(tmp_path), state, progress=lambda msg: None) == "ray://head.example:10001"


def test_a_failed_ray_start_that_spawned_a_head_is_recorded_and_down_stops_its_processes(
        tmp_path, monkeypatch, ray_start):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: False)
    monkeypatch.setattr(local, "ports_in_use", lambda cfg: [])
    ray_start.result = (1, "the current node timed out during startup")
    with pytest.raises(BringUpError, match="timed out during startup"):
        local.start_ray(_cfg(tmp_path), LocalState(), progress=lambda msg: None)
    recorded = LocalState.load(tmp_path)
    assert recorded.ray_started and recorded.ray_session == ray_start.session

    # The head never answers `ray status`, but its processes run: `down` stops them.
    monkeypatch.setattr(local, "session_processes", lambda session: [4242] if session == ray_start.session else [])
    monkeypatch.setattr(local, "reap_orphaned_engines", lambda: [])
    ran = []
    monkeypatch.setattr(local.subprocess, "run", lambda cmd, **kw: ran.append(cmd[1:3]) or subprocess.CompletedProcess(cmd, 0))
    lines = []
    assert local.down(_cfg(tmp_path), lines.append)
    assert ran[-1] == ["stop", "--force"] and any("stopping its 1 processes" in line for line in lines), lines
    assert LocalState.load(tmp_path).is_empty()


def test_down_removes_the_sockets_of_the_replicas_that_ended_and_keeps_a_live_one(tmp_path, monkeypatch):
    """Each replica a head ran left its two KV-event socket files in the user's folder when it ended."""
    import socket

    folder = tmp_path / "kv"
    folder.mkdir()
    monkeypatch.setattr(local, "kv_events_dir", lambda: folder)
    for name in ("replica_a.pub", "replica_a.replay"):
        ended = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ended.bind(str(folder / name))
        ended.close()  # the file stays, and nothing listens on it
    (folder / "notes.txt").write_text("not a socket")
    state_dir = tmp_path / "state"
    _a_running_head_up_started(state_dir, monkeypatch, ray_stop=subprocess.CompletedProcess([], 0, "", ""))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(folder / "replica_b.pub"))
        live.listen()
        assert local.down(_cfg(state_dir), lambda line: None)
        assert sorted(path.name for path in folder.iterdir()) == ["notes.txt", "replica_b.pub"]


def test_a_failed_ray_start_that_spawned_nothing_records_nothing(tmp_path, monkeypatch, ray_start):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: False)
    monkeypatch.setattr(local, "ports_in_use", lambda cfg: [])
    ray_start.result, ray_start.spawns = (1, "bad flag"), False
    with pytest.raises(BringUpError, match="bad flag"):
        local.start_ray(_cfg(tmp_path), LocalState(), progress=lambda msg: None)
    assert LocalState.load(tmp_path).is_empty()


def test_down_keeps_a_joined_cluster_it_could_not_clean_recorded_and_fails(tmp_path, monkeypatch):
    LocalState(ray_address="ray://head.example:10001", dashboard_url="http://head.example:8265",
               http_url="http://head.example:8000").save(tmp_path)

    def unreachable(state, own, progress):
        raise ConnectionError("dashboard unreachable")

    monkeypatch.setattr(local, "remove_applications", unreachable)
    result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "dashboard unreachable" in result.output and "still records it" in result.output
    recorded = LocalState.load(tmp_path)
    assert recorded.ray_address == "ray://head.example:10001" and recorded.dashboard_url == "http://head.example:8265"


def _a_running_head_up_started(state_dir, monkeypatch, ray_stop: subprocess.CompletedProcess) -> None:
    """`state_dir` records a head `up` started, which runs; `ray stop` ends as `ray_stop` says."""
    LocalState(ray_started=True, ray_session="session_1", ray_address="auto").save(state_dir)
    monkeypatch.setattr(local, "_ray_head_up", lambda: True)
    monkeypatch.setattr(local, "head_session", lambda: "session_1")
    monkeypatch.setattr(local, "reap_orphaned_engines", lambda: [])
    monkeypatch.setattr(local, "_serve_client", lambda state: type("C", (), {"delete_applications": lambda self: None})())
    monkeypatch.setattr(local.subprocess, "run", lambda cmd, **kw: ray_stop)


def test_down_keeps_a_head_ray_stop_could_not_stop(tmp_path, monkeypatch):
    _a_running_head_up_started(tmp_path, monkeypatch, ray_stop=subprocess.CompletedProcess([], 1, "", "permission denied"))
    lines = []
    assert not local.down(_cfg(tmp_path), lines.append)
    assert any("`ray stop --force` failed (permission denied)" in line for line in lines), lines
    assert LocalState.load(tmp_path).ray_started


@needs_redis
def test_a_redis_started_in_this_process_stops_at_once_and_a_port_change_is_refused(tmp_path):
    """`up` and `down` in one process (the integration tests' fixture): the exited server is this process'
    child, so it is reaped, not waited on as if alive."""
    port = _free_port()
    state = LocalState()
    url = local.start_redis(_cfg(tmp_path, ports={"local_redis_port": port}), state, progress=lambda msg: None)
    state.save(tmp_path)
    server_pids = [state.redis_pid]
    try:
        assert url == f"redis://127.0.0.1:{port}/0" and state.redis_url == url
        assert (tmp_path / "redis").stat().st_mode & 0o777 == 0o700  # transcripts and key records: its owner's
        moved = _cfg(tmp_path, ports={"local_redis_port": _free_port()})
        with pytest.raises(BringUpError, match=rf"listens on port {port}, not .*`warmpath down` first"):
            local.start_redis(moved, state, progress=lambda msg: None)
        assert state.redis_url == url
        assert local._is_redis_process(state.redis_pid, port) and not local._is_redis_process(state.redis_pid, 6379)
        # Another state directory's Redis on the same port (a pid reused after a reboot) is not this one's.
        assert local._is_redis_process(state.redis_pid, port, tmp_path / "redis")
        assert not local._is_redis_process(state.redis_pid, port, tmp_path / "another-state-dir" / "redis")
        # Moved to a Redis of its own, the cluster still records the server it started, and `down` stops it.
        state.redis_url = "redis://redis.example:6379/0"
        state.save(tmp_path)
        started = time.monotonic()
        lines = []
        assert local.down(_cfg(tmp_path), lines.append)
        assert time.monotonic() - started < 5 and any("redis: stopped" in line for line in lines), lines
        assert LocalState.load(tmp_path).is_empty()
    finally:
        for pid in {*server_pids, state.redis_pid} - {None}:  # a second server, were one started
            if local._alive(pid):
                os.kill(pid, 9)


@needs_redis
def test_a_given_redis_is_recorded_and_one_that_refuses_is_said_at_once(tmp_path):
    port = _free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "s3cret"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        given = f"redis://:s3cret@127.0.0.1:{port}/0"
        assert local._redis_ping(given, 10)
        state = LocalState()
        assert local.start_redis(_cfg(tmp_path, redis_url=given), state, progress=lambda msg: None) == given
        assert state.redis_url == given and state.redis_pid is None
        state.save(tmp_path)  # `warmpath keys` finds the cluster's store in the record, without REDIS_URL
        created = CliRunner().invoke(app, ["keys", "create", "--name", "ci", "--state-dir", str(tmp_path)],
                                     env={"REDIS_URL": None})
        assert created.exit_code == 0, created.output
        listed = CliRunner().invoke(app, ["keys", "list", "--state-dir", str(tmp_path)], env={"REDIS_URL": None})
        assert listed.exit_code == 0 and "ci" in listed.output, listed.output
        started = time.monotonic()
        wrong = f"redis://:wrong@127.0.0.1:{port}/0"
        with pytest.raises(BringUpError, match=r"refused PING") as err:
            local.start_redis(_cfg(tmp_path, redis_url=wrong), LocalState(), progress=lambda msg: None)
        assert time.monotonic() - started < 3 and "wrong" not in str(err.value)  # the password is masked
    finally:
        server.kill()
        server.wait()


def test_a_redis_that_takes_no_writes_is_one_error_not_a_traceback(tmp_path, monkeypatch):
    from cluster import api_keys

    def read_only(url, work):
        raise api_keys.StoreUnavailable("Redis is a read-only replica")

    monkeypatch.setattr(api_keys, "run_with_store", read_only)
    with pytest.raises(BringUpError, match="could not register the admin API key.*read-only replica"):
        local.ensure_local_api_key(_cfg(tmp_path), "redis://:pw@127.0.0.1:1/0", progress=lambda msg: None)


@pytest.mark.parametrize("bound, dashboard, expected", [
    ("192.0.2.2", local.LOCAL_DASHBOARD_URL, "192.0.2.2"),
    ("0.0.0.0", local.LOCAL_DASHBOARD_URL, "127.0.0.1"),
    ("::", "http://head.example:8265", "head.example"),
    ("0.0.0.0", "http://head.example:8265", "head.example"),
])
def test_the_endpoint_is_where_the_proxies_listen(bound, dashboard, expected):
    details = {"http_options": {"host": bound, "port": 8000}}
    assert local.proxy_host(details, LocalState(dashboard_url=dashboard)) == expected


@pytest.mark.parametrize("content, match", [
    ("[]", "holds list"),
    ('{"redis_pid": "123"}', "redis_pid is '123'"),
    ('{"ray_started": "yes"}', "ray_started is 'yes'"),
])
def test_a_state_file_of_the_wrong_shape_is_one_error_naming_it(tmp_path, content, match):
    LocalState.path(tmp_path).write_text(content)
    with pytest.raises(BringUpError, match=match):
        LocalState.load(tmp_path)
    for command in (["down"], ["status"], ["chaos"], ["up"]):
        result = CliRunner().invoke(app, [*command, "--state-dir", str(tmp_path)] if command != ["chaos"] else command,
                                    env={"WARMPATH_STATE_DIR": str(tmp_path)})
        assert result.exit_code == 1 and "Traceback" not in result.output, (command, result.output)
        assert match in result.output, (command, result.output)


def test_the_state_file_is_private(tmp_path):
    LocalState(redis_url="redis://:pw@redis.example:6379/0").save(tmp_path)
    assert stat.S_IMODE(LocalState.path(tmp_path).stat().st_mode) == 0o600
    assert json.loads(LocalState.path(tmp_path).read_text())["redis_url"].startswith("redis://:pw@")


@pytest.mark.parametrize("value", ["nan", "0", "-1", "inf"])
def test_up_refuses_a_timeout_that_is_not_a_positive_number_before_starting(tmp_path, monkeypatch, value):
    monkeypatch.setattr(local, "up", lambda *a, **k: pytest.fail("started"))
    result = CliRunner().invoke(app, ["up", "--state-dir", str(tmp_path), "--timeout-s", value])
    assert result.exit_code == 2 and "--timeout-s must be a finite number of seconds > 0" in result.output
    assert math.isnan(float(value)) or value in result.output


def test_up_refuses_a_state_dir_it_cannot_write_before_starting(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "up", lambda *a, **k: pytest.fail("started"))
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(app, ["up", "--state-dir", str(tmp_path / "file" / "state")])
    assert result.exit_code == 2 and "state_dir" in result.output and "Traceback" not in result.output


def test_the_write_probe_leaves_a_symbolic_link_in_place(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "results" / "target.json")
    assert unwritable_file_problem(link) is None
    assert link.is_symlink() and not (tmp_path / "results" / "target.json").exists()


_DASHBOARD_HEADERS = """
import json, sys
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
from cluster import local

ServeSubmissionClient._check_connection_and_version_with_url = lambda self, **kwargs: None
state = local.LocalState(**json.loads(sys.argv[1]))
print(json.dumps(local._serve_client(state)._headers))
"""


@pytest.mark.parametrize("recorded, is_sent", [
    ({"ray_started": True, "ray_address": "auto"}, True),  # the head `up` started
    ({"ray_address": "auto"}, True),  # a local head joined deliberately
    ({"ray_address": "ray://head.example:10001", "dashboard_url": "http://head.example:8265"}, False),
])
def test_a_local_heads_dashboard_gets_the_machines_ray_token_as_rays_own_clients_send_it(tmp_path, recorded, is_sent):
    """With RAY_AUTH_MODE unset, a head started where a Ray token exists (any earlier `ray.init()` leaves
    one in ~/.ray) requires it: `serve deploy` failed "Missing authentication token". As in `ray.init`,
    an explicit address never turns token authentication on by itself. Run apart: Ray keeps the mode
    in process-wide state."""
    token = tmp_path / "auth_token"
    token.write_text("a" * 64)
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), RAY_AUTH_TOKEN_PATH=str(token), PYTHONPATH=os.getcwd())
    shown = subprocess.run([sys.executable, "-c", _DASHBOARD_HEADERS, json.dumps(recorded)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    headers = json.loads(shown.stdout.strip().splitlines()[-1])
    assert (headers.get("authorization") == f"Bearer {'a' * 64}") is is_sent, headers
