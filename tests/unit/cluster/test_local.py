"""`warmpath up` never deploys into a Ray head it did not start unless told to; `warmpath down` stops vLLM
engine processes orphaned by killed replicas, and only those."""

import contextlib
import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import local
from cluster.config import ConfigError, load_config
from cluster.local import BringUpError, LocalState, reap_orphaned_engines

ORPHAN = """
import os, sys, time, setproctitle
if os.fork():
    os._exit(0)  # the parent exits: the child is re-parented, like an engine whose replica was killed
setproctitle.setproctitle(sys.argv[1])
print(os.getpid(), flush=True)
time.sleep(120)
"""


def _spawn_orphan(title: str) -> int:
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN, title], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())  # the orphan keeps the pipe open: read its line, not to EOF
    proc.wait(timeout=30)
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0] != title.encode():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return pid


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_orphaned_engines_are_reaped_and_other_processes_are_not():
    engine = _spawn_orphan("VLLM::EngineCore")
    bystander = _spawn_orphan("some-other-daemon")
    try:
        if _ppid(engine) != 1:
            pytest.skip("orphans are re-parented to a subreaper here, not to init")
        reaped = reap_orphaned_engines()
        assert engine in reaped and bystander not in reaped
        deadline = time.monotonic() + 10
        while _alive(engine):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _alive(bystander)
    finally:
        for pid in (engine, bystander):
            try:
                os.kill(pid, 9)
            except OSError:
                pass


# Under a subreaper (as under `systemd --user`), three engines' families, each printing `<name> <pid>` lines:
# a replica (its group's leader, as Ray makes each worker) that died, leaving an engine core and its worker;
# an engine whose launcher died but whose process group's leader runs; an engine whose group's leader died
# while its parent, the group's frontend, runs.
UNDER_SUBREAPER = """
import ctypes, os, sys, time, setproctitle
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

def become(title, name):
    setproctitle.setproctitle(title)
    os.write(1, f"{name} {os.getpid()}\\n".encode())  # one write: the families print at once

def family(name, own_group, frontend):
    if os.fork():
        return
    if own_group:
        os.setpgrp()
    if os.fork():
        os._exit(0)  # the group's leader (the replica) dies: what it started is adopted by this subreaper
    if frontend:
        if not os.fork():
            become("VLLM::EngineCore", name)
            time.sleep(120)
        become("vllm-frontend", name + "-frontend")
        time.sleep(120)
    if not os.fork():
        become("VLLM::Worker", name + "-worker")
        time.sleep(120)
    become("VLLM::EngineCore", name)
    time.sleep(120)

def shared_group():
    # Ray's workers in one group (its per-worker groups off), whose leader (`ray start`) is gone: one replica
    # died and its engine was adopted; the other replica runs, with its engine.
    if os.fork():
        return
    os.setpgrp()
    if not os.fork():
        if not os.fork():
            become("VLLM::EngineCore", "shared-adopted")
            time.sleep(120)
        os._exit(0)  # the replica that died
    if not os.fork():
        if not os.fork():
            become("VLLM::EngineCore", "shared-owned")
            time.sleep(120)
        become("ray::ServeReplica", "shared-replica")
        time.sleep(120)
    os._exit(0)  # the group's leader

family("replica-gone", own_group=True, frontend=False)
family("group-lives", own_group=False, frontend=False)
family("frontend-runs", own_group=True, frontend=True)
shared_group()
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.05)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_engines_adopted_by_a_subreaper_are_reaped_where_their_replica_is_gone():
    reaper = subprocess.Popen([sys.executable, "-c", UNDER_SUBREAPER], stdout=subprocess.PIPE, text=True)
    pids = {}
    try:
        while len(pids) < 9:
            line = reaper.stdout.readline()
            name, pid = line.split()
            pids[name] = int(pid)
        deadline = time.monotonic() + 10
        while any(_ppid(pids[name]) != reaper.pid for name in ("replica-gone", "group-lives", "shared-adopted")):
            assert time.monotonic() < deadline
            time.sleep(0.01)

        reaped = reap_orphaned_engines()

        assert pids["replica-gone"] in reaped and pids["replica-gone-worker"] in reaped
        for name in ("group-lives", "group-lives-worker", "frontend-runs", "frontend-runs-frontend",
                     "shared-adopted", "shared-owned"):  # a live replica's group: its engine may not go
            assert pids[name] not in reaped
            assert _alive(pids[name]), name
    finally:
        reaper.kill()
        for pid in pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, 9)


@pytest.fixture
def head_up(monkeypatch):
    """A Ray head answers `ray status` on this machine; `ray start` must not be run."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: True)
    monkeypatch.setattr(local.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))


def test_a_head_this_state_dir_did_not_start_is_refused(tmp_path, head_up):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    state = LocalState()
    with pytest.raises(BringUpError, match=r"already running.*RAY_ADDRESS=auto") as err:
        local.start_ray(cfg, state, progress=lambda msg: None)
    assert str(tmp_path) in str(err.value)
    assert state.ray_address is None  # so `down` deletes no application there


def test_the_head_this_state_dir_started_is_used_again(tmp_path, head_up):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    state = LocalState(ray_started=True)
    assert local.start_ray(cfg, state, progress=lambda msg: None) == "auto"
    assert state.ray_address == "auto" and state.ray_started


def test_ray_address_joins_any_cluster_deliberately(tmp_path, head_up, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    state = LocalState()
    assert local.start_ray(cfg, state, progress=lambda msg: None) == "auto"
    assert state.ray_address == "auto" and not state.ray_started  # `down` leaves that head running


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_down_never_signals_a_recorded_pid_that_is_not_redis(tmp_path):
    """After a reboot the recorded pid can name anything: `down` must leave it alone."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        LocalState(redis_pid=bystander.pid, redis_url="redis://127.0.0.1:1/0").save(tmp_path)
        lines = []
        local.down(load_config(environ={}, overrides={"state_dir": str(tmp_path)}), lines.append)
        with pytest.raises(subprocess.TimeoutExpired):  # a signal is delivered a moment after it is sent
            bystander.wait(timeout=1)
        assert any("no longer the redis-server" in line for line in lines), lines
        assert LocalState.load(tmp_path).is_empty()
    finally:
        bystander.kill()
        bystander.wait()


def test_down_with_nothing_recorded_says_so_and_writes_nothing(tmp_path):
    lines = []
    local.down(load_config(environ={}, overrides={"state_dir": str(tmp_path / "never-up")}), lines.append)
    assert lines and lines[0].startswith("nothing to stop") and not (tmp_path / "never-up").exists()


def test_an_unreadable_state_file_is_one_error_naming_it(tmp_path, monkeypatch):
    """Another user's state file (`sudo warmpath up` writes it 0600) gave `status` and `down` a traceback."""
    LocalState.path(tmp_path).write_text("{}")

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refused)
    with pytest.raises(BringUpError, match=r"local\.json cannot be read \(Permission denied\): run as the user"):
        LocalState.load(tmp_path)


def test_the_api_key_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """Written in place, a full disk left it empty, and the next `up` minted another admin key."""
    key_file = tmp_path / "api-key"
    local.replace_private(key_file, "wp_old\n")
    real_fdopen = os.fdopen

    class _Full:
        def __init__(self, fd, mode):
            self._out = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._out.close()

        def fileno(self):
            return self._out.fileno()

        def write(self, text):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(local.os, "fdopen", _Full)
    with pytest.raises(OSError, match="No space left"):
        local.replace_private(key_file, "wp_new\n")
    monkeypatch.undo()
    assert key_file.read_text() == "wp_old\n" and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["api-key"]


def test_a_broken_state_file_is_one_error_naming_it(tmp_path):
    LocalState.path(tmp_path).write_text('{"redis_pid": 12')
    with pytest.raises(BringUpError, match="local.json is not valid JSON"):
        LocalState.load(tmp_path)
    LocalState(redis_pid=5).save(tmp_path)  # written whole, by rename
    assert LocalState.load(tmp_path).redis_pid == 5 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.skipif(local.shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_redis_port_another_server_holds_is_refused_not_adopted(tmp_path):
    port = _free_port()
    other = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert local._redis_ping(f"redis://127.0.0.1:{port}/0", 10)
        cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path / "state"),
                                                 "ports": {"local_redis_port": port}})
        state = LocalState()
        with pytest.raises(BringUpError, match=re.escape(f"port {port} (ports.local_redis_port) is in use by another")):
            local.start_redis(cfg, state, progress=lambda msg: None)
        assert state.redis_pid is None and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_redis_port_a_process_of_another_kind_holds_is_named_before_starting_redis(tmp_path):
    """An HTTP server on the port: `up` started redis-server, waited 10 s for a PING nothing answered, and
    pointed at redis.log."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path / "state"),
                                                 "ports": {"local_redis_port": port}})
        with pytest.raises(BringUpError, match=re.escape(f"port {port} (ports.local_redis_port) is in use by another")):
            local.start_redis(cfg, LocalState(), progress=lambda msg: None)
    assert not local.redis_dir_of(cfg).exists()  # no redis-server was started


def test_status_lists_the_http_and_the_grpc_application(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cluster.cli import app

    details = {"applications": {
        "warmpath": {"status": "RUNNING", "deployments": {
            "OpenAiIngress": {"status": "HEALTHY", "replicas": [{"state": "RUNNING"}]}}},
        "warmpath-grpc": {"status": "RUNNING", "deployments": {
            "GrpcIngress": {"status": "HEALTHY", "replicas": [{"state": "RUNNING"}]}}},
    }}
    monkeypatch.setattr(local, "serve_details", lambda state: details)
    monkeypatch.setattr(local, "head_session", lambda: "session_1")  # the head it started answers
    LocalState(ray_started=True, ray_session="session_1", ray_address="auto").save(tmp_path)
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "application warmpath: RUNNING" in result.output
    assert "application warmpath-grpc: RUNNING" in result.output and "GrpcIngress: HEALTHY (1 RUNNING)" in result.output


def test_status_with_nothing_recorded_shows_what_runs_but_exits_1(tmp_path, monkeypatch):
    """In the wrong folder, while another checkout's cluster (or the tests') ran on the same ports, `status` said
    RUNNING and exited 0: a probe took someone else's cluster for its own."""
    from typer.testing import CliRunner

    from cluster.cli import app

    details = {"applications": {"warmpath": {"status": "RUNNING", "deployments": {}},
                                "warmpath-grpc": {"status": "RUNNING", "deployments": {}}}}
    monkeypatch.setattr(local, "serve_details", lambda state: details)
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "no local cluster is recorded" in result.output and "application warmpath: RUNNING" in result.output


def test_after_down_status_and_keys_say_the_cluster_was_stopped_not_that_the_folder_may_be_wrong(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cluster.cli import app

    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(local, "serve_details", lambda state: {"applications": {}})
    (tmp_path / "redis").mkdir()  # `up` ran here: its Redis data stays after `down`
    for command in (["status"], ["keys", "list"]):
        result = CliRunner().invoke(app, [*command, "--state-dir", str(tmp_path)])
        assert result.exit_code in (1, 2), result.output
        assert f"nothing `warmpath up` started from {tmp_path} is running: `warmpath down` stopped it" in result.output
        assert "relative to where" not in result.output


def test_status_without_the_config_reads_the_application_up_recorded(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cluster.cli import app

    details = {"applications": {"agents": {"status": "RUNNING", "deployments": {}},
                                "agents-grpc": {"status": "RUNNING", "deployments": {}}}}
    monkeypatch.setattr(local, "serve_details", lambda state: details)
    monkeypatch.setattr(local, "head_session", lambda: "session_1")  # the head it started answers
    LocalState(ray_started=True, ray_session="session_1", ray_address="auto", app_name="agents").save(tmp_path)
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "application agents: RUNNING" in result.output and "application agents-grpc: RUNNING" in result.output


@pytest.mark.parametrize("grpc_status, redis_url, says", [
    ("DEPLOY_FAILED", None, "application warmpath-grpc: DEPLOY_FAILED"),
    ("RUNNING", "redis://:pw@127.0.0.1:1/0", "redis: redis://:***@127.0.0.1:1/0 (not answering (ConnectionError))"),
])
def test_status_exits_1_unless_both_applications_run_and_redis_answers(tmp_path, monkeypatch, grpc_status, redis_url,
                                                                      says):
    from typer.testing import CliRunner

    from cluster.cli import app

    details = {"applications": {
        "warmpath": {"status": "RUNNING", "deployments": {}}, "warmpath-grpc": {"status": grpc_status, "deployments": {}},
    }}
    monkeypatch.setattr(local, "serve_details", lambda state: details)
    LocalState(redis_url=redis_url).save(tmp_path)
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and says in result.output, result.output


@pytest.mark.parametrize("spawns", [True, False])
def test_an_interrupted_ray_start_is_recorded_so_down_stops_it_and_only_its_own_head(
        tmp_path, monkeypatch, ray_start, spawns):
    """By `session_latest` alone, an interrupted start recorded the newest head, which another `up` (of another
    state directory, started at the same time) could have started: this one's `down` then stopped that."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: False)
    monkeypatch.setattr(local, "ports_in_use", lambda cfg: [])  # the test session's own cluster holds them
    another = ray_start.ray_tmp / "ray" / "session_2026-12-07_10-00-01_000000_4242"  # another `up`'s, newer
    another.mkdir(parents=True)
    (ray_start.ray_tmp / "ray" / "session_latest").symlink_to(another)
    ray_start.spawns, ray_start.raises = spawns, KeyboardInterrupt()
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    with pytest.raises(KeyboardInterrupt):
        local.start_ray(cfg, LocalState(), progress=lambda msg: None)
    recorded = LocalState.load(tmp_path)
    if spawns:
        assert recorded.ray_started and recorded.ray_session == ray_start.session
    else:
        assert recorded.is_empty()


@pytest.mark.parametrize("command", ["up", "down"])
def test_up_and_down_refuse_a_state_directory_another_up_or_down_holds(tmp_path, monkeypatch, command):
    """Two at once raced for its Redis and its record: the loser took the winner's Redis for another process's,
    then named it as left running by itself."""
    import fcntl

    from typer.testing import CliRunner

    from cluster.cli import app

    monkeypatch.setattr(local, "up", lambda *a, **k: pytest.fail("up ran"))
    monkeypatch.setattr(local, "down", lambda *a, **k: pytest.fail("down ran"))
    with open(tmp_path / "lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another `up` running there
        result = CliRunner().invoke(app, [command, "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"another `warmpath up` or `warmpath down` is running on {tmp_path}" in result.output


def test_a_failed_up_on_a_joined_cluster_says_warmpaths_applications_stay_there(tmp_path, monkeypatch):
    """With RAY_ADDRESS and a Redis of the user's, a failed or interrupted `up` said nothing was left: its
    applications stayed deployed there, replicas loading their models."""
    from typer.testing import CliRunner

    from cluster.cli import app

    def failing_up(cfg, progress, **kwargs):
        LocalState(ray_address="ray://head:10001", dashboard_url="http://head:8265", app_name="warmpath").save(
            local.state_dir_of(cfg))
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "up", failing_up)
    result = CliRunner().invoke(app, ["up", "--state-dir", str(tmp_path)])
    assert result.exit_code == 130, result.output
    assert (f"left running: warmpath's applications on ray://head:10001; `warmpath down --state-dir {tmp_path}` "
            "stops them") in result.output


@pytest.mark.parametrize("failure, exit_code", [
    (BringUpError("deploy failed"), 1), (KeyboardInterrupt(), 130),
    (OSError(28, "No space left on device", "/srv/.warmpath/serve_config.yaml"), 1),
])
def test_a_failed_up_says_what_it_left_running(tmp_path, monkeypatch, failure, exit_code):
    from typer.testing import CliRunner

    from cluster.cli import app

    def failing_up(cfg, progress, **kwargs):
        LocalState(redis_pid=4242, ray_started=True).save(local.state_dir_of(cfg))
        raise failure

    monkeypatch.setattr(local, "up", failing_up)
    result = CliRunner().invoke(app, ["up", "--state-dir", str(tmp_path)])
    assert result.exit_code == exit_code and isinstance(result.exception, SystemExit)  # not a traceback
    if isinstance(failure, OSError):
        assert "error: No space left on device: /srv/.warmpath/serve_config.yaml" in result.output
    # A plain `down` would look in ./.warmpath, say "nothing to stop" and leave them running.
    assert (f"left running: redis-server (pid 4242), the Ray head; `warmpath down --state-dir {tmp_path}` stops them"
            in result.output)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["up"])
    assert "left running: redis-server (pid 4242), the Ray head; `warmpath down` stops them" in result.output


@pytest.mark.parametrize("address", ["auto", "local", "127.0.0.1:6379", "localhost:6379", "ray://[::1]:10001",
                                     f"{socket.gethostname()}:6379"])
def test_addresses_of_this_machine_are_not_remote(address):
    assert not local.is_remote_address(address)


def test_a_malformed_ray_address_is_one_error_naming_it():
    """`urlsplit`'s ValueError (an unclosed IPv6 bracket) came out of `up` as a traceback."""
    with pytest.raises(BringUpError, match=r"RAY_ADDRESS 'ray://\[head-1:10001' is not an address"):
        local.is_remote_address("ray://[head-1:10001")


def test_a_join_of_another_machines_cluster_needs_a_model_and_a_redis_it_can_reach(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "is_remote_address", lambda address: address == "ray://head.example:10001")
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    with pytest.raises(BringUpError) as err:
        local.check_remote_join(cfg, "ray://head.example:10001")
    assert "model.source is unset" in str(err.value) and "redis_url is unset" in str(err.value)
    only_redis = cfg.model_copy(update={"model": cfg.model.model_copy(update={"source": "Qwen/Qwen2.5-7B-Instruct"})})
    with pytest.raises(BringUpError, match="redis_url is unset") as err:
        local.check_remote_join(only_redis, "ray://head.example:10001")
    assert "model.source" not in str(err.value)
    ready = only_redis.model_copy(update={"redis_url": "redis://redis.example:6379/1"})
    local.check_remote_join(ready, "ray://head.example:10001")
    local.check_remote_join(cfg, "auto")
    local.check_remote_join(cfg, None)


@pytest.mark.parametrize("host, problem", [("192.0.2.7", "is not an address of this machine"),
                                           ("no-such-host.invalid", "does not resolve to an address")])
def test_up_refuses_a_proxy_host_this_machine_cannot_listen_on_before_starting_anything(tmp_path, monkeypatch,
                                                                                      host, problem):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = []
    monkeypatch.setattr(local, "ensure_model", lambda *a: started.append("model"))
    monkeypatch.setattr(local, "start_redis", lambda *a: started.append("redis"))
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {"host": host}})
    with pytest.raises(BringUpError, match=f"ports.host '{host}'.* {problem}"):
        local.up(cfg, progress=lambda msg: None)
    assert started == []


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", "localhost", socket.gethostname()])
def test_a_proxy_host_of_this_machine_passes(tmp_path, host):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {"host": host}})
    local.check_proxy_host(cfg, None)


def test_a_proxy_host_is_not_checked_here_for_a_cluster_on_other_machines(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "is_remote_address", lambda address: True)
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {"host": "192.0.2.7"}})
    local.check_proxy_host(cfg, "ray://head.example:10001")


def test_up_refuses_a_remote_join_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "ray://head.example:10001")
    monkeypatch.setattr(local, "is_remote_address", lambda address: True)
    started = []
    monkeypatch.setattr(local, "ensure_model", lambda *a: started.append("model"))
    monkeypatch.setattr(local, "start_redis", lambda *a: started.append("redis"))
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    with pytest.raises(BringUpError, match="cluster on other machines"):
        local.up(cfg, progress=lambda msg: None)
    assert started == []


def _gpu_config(tmp_path, **replicas):
    return load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "replicas": {"accelerator": "gpu", "num_gpus": 1, "block_size_tokens": 16,
                                                 **replicas}})


def test_replicas_the_head_cannot_place_are_refused_naming_what_is_missing(tmp_path):
    cfg = _gpu_config(tmp_path, num_replicas=2)
    assert local.resource_shortfall(cfg, {"CPU": 8.0, "GPU": 2.0}) is None
    no_gpu = local.resource_shortfall(cfg, {"CPU": 8.0})
    assert no_gpu.startswith("2 replicas need 2 GPU (the head has 0): Ray found too few GPUs")
    assert no_gpu.endswith("replicas.accelerator: cpu")
    assert local.resource_shortfall(cfg, {"GPU": 1.0}).endswith("replicas.num_replicas lower")  # one fits
    slots = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "replicas": {"ray_resources": {"warmpath_replica_slot": 1}}})
    assert local.replicas_need(slots) == {"warmpath_replica_slot": 2.0}
    assert local.resource_shortfall(slots, {"CPU": 8.0, "GPU": 1.0}).startswith(
        "2 replicas need 2 warmpath_replica_slot (the head has 0): a local head offers replicas.ray_resources")
    assert local.resource_shortfall(load_config(environ={}, overrides={"state_dir": str(tmp_path)}), {"CPU": 6.0}) is None


def test_cpu_replicas_a_running_head_has_too_few_cpus_for_are_refused(tmp_path):
    """`up --replicas 8` after a 2-replica `up` reused its head (6 CPUs): replicas stayed pending and `up`
    waited out its timeout."""
    eight = load_config(environ={}, overrides={"state_dir": str(tmp_path), "replicas": {"num_replicas": 8}})
    shortfall = local.resource_shortfall(eight, {"CPU": 6.0})
    assert shortfall.startswith("8 replicas need 9 CPU (the head has 6): the running head was started for fewer")
    assert local.resource_shortfall(eight, {"CPU": 12.0}) is None  # what `up` starts a head with for them


def test_up_stops_before_deploying_replicas_a_local_head_cannot_place(tmp_path, monkeypatch):
    import ray.util.state

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    node = type("Node", (), {"state": "ALIVE", "resources_total": {"CPU": 6.0, "memory": 1e9}})
    monkeypatch.setattr(ray.util.state, "list_nodes", lambda address: [node])
    with pytest.raises(BringUpError, match="the replica needs 1 GPU"):
        local.check_local_head_resources(_gpu_config(tmp_path, num_replicas=1), LocalState(), lambda msg: None)
    monkeypatch.setenv("RAY_ADDRESS", "ray://gpu-cluster:10001")  # its autoscaler may add GPU nodes
    local.check_local_head_resources(_gpu_config(tmp_path, num_replicas=1), LocalState(), lambda msg: None)


def test_a_local_head_offers_every_replicas_custom_resources(tmp_path, monkeypatch, ray_start):
    monkeypatch.setattr(local, "kv_events_dir", _KV_EVENTS_DIR)  # the real one's name (nothing is made here)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: False)
    monkeypatch.setattr(local, "ports_in_use", lambda cfg: [])  # the test session's own cluster holds them
    cfg = load_config(environ={}, overrides={
        "state_dir": str(tmp_path), "replicas": {"num_replicas": 3, "ray_resources": {"warmpath_replica_slot": 1}}})
    state = LocalState()
    local.start_ray(cfg, state, progress=lambda msg: None)
    assert state.ray_session == ray_start.session
    (resources,) = [arg.split("=", 1)[1] for arg in ray_start.commands[0] if arg.startswith("--resources=")]
    assert json.loads(resources) == {"warmpath_replica_slot": 3}
    # Its workers inherit it: the replicas publish their KV events (every prompt's tokens) on sockets in a
    # folder of this user's only.
    assert ray_start.environments[0]["WARMPATH_KV_EVENTS_IPC_DIR"].endswith(f"warmpath-kv-events-{os.getuid()}")


# `cluster.local.kv_events_dir` itself, as imported (the tests' fixture puts a folder of their own in its place).
_KV_EVENTS_DIR = local.kv_events_dir


def _serve_says_twice_then_runs(monkeypatch, message: str) -> None:
    """Serve's status: both applications deploying with `message` on one deployment, twice; then running."""
    deploying = {"applications": {app: {"status": "DEPLOYING", "deployments": {
        "D": {"status": "UPDATING", "message": message, "replicas": [{"state": "STARTING"}]}}}
        for app in ("warmpath", "warmpath-grpc")}}
    running = {"applications": {app: {"status": "RUNNING", "deployments": {}} for app in ("warmpath", "warmpath-grpc")}}
    answers = iter([deploying, deploying, running])
    monkeypatch.setattr(local, "serve_details", lambda state: next(answers))
    monkeypatch.setattr(local.time, "sleep", lambda s: None)


def test_bring_up_shows_serves_own_word_on_a_pending_deployment_once(tmp_path, monkeypatch):
    message = ("Deployment 'D' has 1 replicas that have taken more than 30s to be scheduled.\n"
               "Resources required for each replica: [{\"GPU\": 1.0, \"CPU\": 1.0}], total resources available: {}.")
    _serve_says_twice_then_runs(monkeypatch, message)
    said = []
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    local.wait_running(cfg, LocalState(), said.append, timeout_s=60)
    serve_says = [line for line in said if "serve says:" in line]
    assert len(serve_says) == 1  # two deployments, two polls: one message, once
    assert serve_says[0].endswith(" ".join(message.split()))
    assert not any("logs are in" in line for line in said)  # a joined cluster's logs are not on this machine


def test_a_replica_failing_to_start_on_the_local_head_points_at_its_logs(tmp_path, monkeypatch):
    """vLLM's "Engine core initialization failed. See root cause above": the cause is in no message, only in the
    engines' output, which the operator had to find in Ray's session folder."""
    message = ("A replica failed to start with exception. Retrying 4 more time(s). Error:\n"
               "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    _serve_says_twice_then_runs(monkeypatch, message)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    logs = tmp_path / "ray" / "session_1" / "logs"
    logs.mkdir(parents=True)
    said = []
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path / "state")})
    local.wait_running(cfg, LocalState(ray_started=True, ray_session="session_1"), said.append, timeout_s=60)
    pointers = [line for line in said if "logs are in" in line]
    assert len(pointers) == 1
    assert pointers[0].endswith(f"the replicas' logs are in {logs / 'serve'}, their engines' output in "
                                f"{logs}/worker-*.out and worker-*.err")


@pytest.fixture
def no_ray_start(monkeypatch):
    """A machine with no Ray head running, where `ray start` must not be reached."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: False)
    monkeypatch.setattr(local.subprocess, "run", lambda *args, **kwargs: pytest.fail("ray ran"))
    monkeypatch.setattr(local.subprocess, "Popen", lambda *args, **kwargs: pytest.fail("ray start ran"))


@contextlib.contextmanager
def held_port():
    """A loopback port another process (this one) listens on for the block."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_new_head_is_not_started_while_another_process_holds_its_ports(tmp_path, no_ray_start):
    with held_port() as port:
        cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {
            "host": "127.0.0.1", "http_port": port}})
        assert local.ports_in_use(cfg)[0] == f"port {port} (ports.http_port)"
        with pytest.raises(BringUpError, match=f"port {port} \\(ports.http_port\\)"):
            local.start_ray(cfg, LocalState(), progress=lambda msg: None)
    assert not any(str(port) in taken for taken in local.ports_in_use(cfg))  # closed: free again


def test_a_process_on_rays_gcs_port_stops_a_new_head_before_ray_start(tmp_path, monkeypatch, no_ray_start):
    """A system redis-server on 6379 made `ray start` fail with a dump of its output; the refusal says how
    to free the port, and offers no config field for it (there is none)."""
    with held_port() as port:
        monkeypatch.setattr(local, "GCS_PORT", port)
        cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
        assert f"port {local.GCS_PORT} (Ray's GCS)" in local.ports_in_use(cfg)
        real_bind_error = local._bind_error
        # The other ports free, whatever else this machine runs.
        monkeypatch.setattr(local, "_bind_error", lambda host, port: real_bind_error(host, port)
                            if port == local.GCS_PORT else None)
        with pytest.raises(BringUpError) as refused:
            local.start_ray(cfg, LocalState(), progress=lambda msg: None)
    assert "systemctl disable --now redis-server" in str(refused.value)
    assert "ports.*" not in str(refused.value)


def test_a_port_this_user_may_not_listen_on_stops_a_new_head_before_ray_start(tmp_path, monkeypatch, no_ray_start):
    """Only "address in use" counted: as a user without root, `http_port: 80` passed, the proxy failed to
    bind, and `up` waited out its timeout."""
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {"http_port": 80}})
    refused_by_kernel = {(cfg.ports.host, 80): errno.EACCES}
    monkeypatch.setattr(local, "_bind_error", lambda host, port: refused_by_kernel.get((host, port)))
    assert local.privileged_ports(cfg) == ["ports.http_port 80"] and local.ports_in_use(cfg) == []
    with pytest.raises(BringUpError, match="ports.http_port 80: only root may listen on ports below 1024"):
        local.start_ray(cfg, LocalState(), progress=lambda msg: None)


def test_a_port_below_1024_is_one_this_user_may_not_listen_on(tmp_path, as_unprivileged):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {"http_port": 80}})

    def check():
        assert local.privileged_ports(cfg) == ["ports.http_port 80"]

    as_unprivileged(check)


def test_a_redis_on_a_port_that_only_starts_with_the_recorded_one_is_not_ours(monkeypatch):
    """`down` matched `:6380` inside `redis-server 127.0.0.1:63801`, another server, and stopped it."""
    monkeypatch.setattr(local, "_alive", lambda pid: True)
    monkeypatch.setattr(local.Path, "read_bytes", lambda self: b"redis-server 127.0.0.1:63801\x00")
    assert not local._is_redis_process(12345, 6380)
    monkeypatch.setattr(local.Path, "read_bytes", lambda self: b"redis-server 127.0.0.1:6380\x00")
    assert local._is_redis_process(12345, 6380)


def test_a_failing_replicas_message_shows_what_happened_and_the_exception():
    traceback = "\n".join([
        "A replica failed to start with exception. Retrying 2 more time(s). Error:",
        "ray::ServeReplica:warmpath:WarmpathLLMServer.initialize_and_get_metadata() (pid=1)",
        '  File "llm_server.py", line 315, in _start_engine',
        "    await self.engine.start()",
        "RuntimeError: Failed to create vLLM engine config: 1 validation error for ModelConfig",
        "  Value error, Invalid repository ID or local directory specified: '/tmp/empty'.",
        "Please verify the following requirements:",
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ])
    assert local.message_line(traceback) == (
        "A replica failed to start with exception. Retrying 2 more time(s). Error: ... RuntimeError: Failed to "
        "create vLLM engine config: 1 validation error for ModelConfig Value error, Invalid repository ID or "
        "local directory specified: '/tmp/empty'.")
    two = "Deployment 'D' has 2 replicas that have taken more than 30s to initialize.\nThis may be caused by a slow __init__."
    assert local.message_line(two) == " ".join(two.split())
    assert local.message_line("one\ntwo\nthree") == "one ... three"  # no exception line: the last one


def test_a_local_model_folder_that_is_not_there_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    missing = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"source": "/no/such/model"}})
    with pytest.raises(BringUpError, match="model.source /no/such/model: no such file or folder on this machine"):
        local.ensure_model(missing, progress=lambda msg: None)
    for source in ("Qwen/Qwen2.5-7B-Instruct", str(tmp_path)):  # a hub id; a folder that is there
        local.ensure_model(load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"source": source}}),
                           progress=lambda msg: None)
    monkeypatch.setattr(local, "is_remote_address", lambda address: True)
    monkeypatch.setenv("RAY_ADDRESS", "ray://gpu-cluster:10001")  # the path is on the cluster's nodes
    local.ensure_model(missing, progress=lambda msg: None)


def test_the_default_model_is_never_built_over_a_folder_of_someone_elses(tmp_path):
    """`warmpath build-model` refused such a folder, and `up` built into it: a model of the user's, where a
    model id names one, had its weights, config and tokenizer rewritten."""
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"model_id": "org/mine"}})
    theirs = Path(cfg.model_source())
    theirs.mkdir(parents=True)
    (theirs / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}')
    with pytest.raises(BringUpError, match="holds files no build of warmpath wrote"):
        local.ensure_model(cfg, progress=lambda msg: None)
    assert [p.name for p in theirs.iterdir()] == ["config.json"]


@pytest.mark.parametrize("model_id", ["/models/llama", "..", "../other", "org/../../x", "./m", "org//m", "org/"])
def test_a_model_id_that_would_put_the_built_model_outside_its_folder_is_refused(tmp_path, model_id):
    with pytest.raises(ConfigError, match="names a folder outside the state directory"):
        load_config(environ={}, overrides={"state_dir": str(tmp_path), "model": {"model_id": model_id}})
    with_source = load_config(environ={}, overrides={"model": {"model_id": model_id, "source": "/models/llama"}})
    assert with_source.model.model_id == model_id  # with a source the id is only a name


def test_a_hub_id_that_is_also_a_folder_here_is_pointed_out(tmp_path, monkeypatch):
    """`models/my-model` without `./` is a Hugging Face id: the replicas failed minutes later in Ray's workers."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    said = []
    local.ensure_model(load_config(environ={}, overrides={"model": {"source": "models/my-model"}}), said.append)
    assert len(said) == 1 and "write ./models/my-model" in said[0], said
    said.clear()
    local.ensure_model(load_config(environ={}, overrides={"model": {"source": "Qwen/Qwen2.5-7B-Instruct"}}), said.append)
    assert said == []


def test_the_rendered_serve_config_is_private_to_its_owner(tmp_path, monkeypatch):
    """It holds the Redis URL with its password, as `local.json` does (0600)."""
    monkeypatch.setattr(local, "deploy_document", lambda state, doc, progress: None)
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "redis_url": "redis://:pw@127.0.0.1:6390/0"})
    local.deploy(cfg, LocalState(), progress=lambda msg: None)
    written = tmp_path / "serve_config.yaml"
    assert "redis://:pw@" in written.read_text() and stat.S_IMODE(written.stat().st_mode) == 0o600


def test_a_dashboard_that_accepts_and_never_answers_times_out(monkeypatch):
    """Ray's SDK sets no timeout: `status` and `down` hung for good on such a dashboard."""
    monkeypatch.setattr(local, "DASHBOARD_CALL_TIMEOUT_S", 0.5)
    monkeypatch.setattr(local, "_local_token_auth", lambda state: None)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        state = LocalState(dashboard_url=f"http://127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(OSError):
            local.serve_details(state)
    assert time.monotonic() - started < 10


def test_bring_up_asks_a_dashboard_that_dropped_again_and_gives_up_with_a_message(monkeypatch):
    cfg = load_config(environ={})
    running = {"applications": {name: {"status": "RUNNING", "deployments": {}}
                                for name in (cfg.app_name, f"{cfg.app_name}-grpc")}}
    answers = iter([ConnectionError("dropped"), running])

    def serve_details(state):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(local, "serve_details", serve_details)
    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    said = []
    assert local.wait_running(cfg, LocalState(), said.append, timeout_s=60) == running
    assert any("did not answer (ConnectionError)" in line for line in said)

    def dropped(state):
        raise ConnectionError("dropped")

    monkeypatch.setattr(local, "serve_details", dropped)
    with pytest.raises(BringUpError, match="stopped answering"):
        local.wait_running(cfg, LocalState(dashboard_url="http://127.0.0.1:8265"), said.append, timeout_s=-1)


@pytest.mark.parametrize("args, environ, host", [
    (["--no-auth"], {}, "127.0.0.1"),
    (["--no-auth"], {"WARMPATH_PORTS__HOST": "0.0.0.0"}, "0.0.0.0"),  # set on purpose: kept
    ([], {}, "0.0.0.0"),  # keys on: every caller is checked
    # Another port set, by a flag or a variable, filled in the whole ports section, 0.0.0.0 included.
    (["--no-auth", "--http-port", "8001"], {}, "127.0.0.1"),
    (["--no-auth"], {"WARMPATH_PORTS__METRICS_EXPORT_PORT": "8081"}, "127.0.0.1"),
])
def test_up_without_keys_listens_on_loopback_unless_told_otherwise(tmp_path, monkeypatch, args, environ, host):
    """Without keys every caller holds every permission, server-side HTTP tools that reach this machine's
    networks included; the proxies listened on every address."""
    from typer.testing import CliRunner

    from cluster.cli import app

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    seen = []

    def recording_up(cfg, progress, **kwargs):
        seen.append(cfg.ports.host)
        raise BringUpError("stop here")

    monkeypatch.setattr(local, "up", recording_up)
    CliRunner().invoke(app, ["up", "--state-dir", str(tmp_path), *args])
    assert seen == [host]


def test_the_rendered_serve_config_binds_what_up_binds_without_keys(tmp_path):
    """`render serve-config` is the file `up` deploys: without keys it wrote 0.0.0.0 where `up` bound 127.0.0.1."""
    import yaml
    from typer.testing import CliRunner

    from cluster.cli import app

    config = tmp_path / "no-keys.yaml"
    config.write_text("access:\n  is_auth_enabled: false\n")
    result = CliRunner().invoke(app, ["render", "serve-config", "-c", str(config)])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["http_options"]["host"] == "127.0.0.1"


def test_the_rendered_serve_config_takes_the_redis_the_deployment_uses(tmp_path, monkeypatch):
    """`up` fills in the Redis it starts; the rendered file had only the config's redis_url, and no way to set
    one short of editing the config, and said nothing where it had none (`serve deploy` of it then failed in
    every orchestrator replica)."""
    import yaml
    from typer.testing import CliRunner

    from cluster.cli import app

    monkeypatch.delenv("REDIS_URL", raising=False)
    config = tmp_path / "plain.yaml"
    config.write_text(f"app_name: warmpath\nstate_dir: {tmp_path}/.warmpath\n")

    def rendered_redis_url(*flags: str) -> tuple[object, str]:
        result = CliRunner().invoke(app, ["render", "serve-config", "-c", str(config), *flags])
        assert result.exit_code == 0, result.output
        (application, _grpc) = yaml.safe_load(result.stdout)["applications"]
        return application["args"]["redis_url"], result.stderr

    url, said = rendered_redis_url("--redis-url", "redis://redis.internal:6379/0")
    assert url == "redis://redis.internal:6379/0" and "redis_url" not in said
    url, said = rendered_redis_url()
    assert url is None and "no redis_url" in said and "REDIS_URL" in said
    assert f"model.source {tmp_path}/.warmpath/models/warmpath-tiny is not on this machine" in said
    refused = CliRunner().invoke(app, ["render", "serve-config", "-c", str(config), "--redis-url", "http://x"])
    assert refused.exit_code == 2 and refused.output.startswith("--redis-url ")


def test_the_rendered_serve_config_says_when_its_model_folder_is_not_on_this_machine(tmp_path):
    """Rendered where no model was built, the file named a folder of the state directory that no node had, and
    said nothing: every replica failed to load it after `serve deploy`."""
    from typer.testing import CliRunner

    from cluster.cli import app

    config = tmp_path / "plain.yaml"
    for source, is_said in ((tmp_path, False), (tmp_path / "missing", True), ("Qwen/Qwen2.5-0.5B-Instruct", False)):
        config.write_text(f"model:\n  source: {source}\nredis_url: redis://r:6379/0\n")
        result = CliRunner().invoke(app, ["render", "serve-config", "-c", str(config)])
        assert result.exit_code == 0 and ("is not on this machine" in result.stderr) is is_said, result.stderr


@pytest.mark.parametrize("is_head_up, taken", [(True, []), (False, ["port 8000 (ports.http_port)"])])
def test_up_refuses_a_head_it_cannot_start_before_building_or_starting_anything(tmp_path, monkeypatch, is_head_up,
                                                                                 taken):
    """Another process's head, or a taken port, was found only after the model was built (up to 40 s), Redis
    started and a key written: `up` failed then, and left that Redis running."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "check_proxy_host", lambda cfg, address: None)
    monkeypatch.setattr(local, "_ray_head_up", lambda: is_head_up)
    monkeypatch.setattr(local, "ports_in_use", lambda cfg: taken)
    for step in ("ensure_model", "start_redis", "ensure_local_api_key", "start_ray"):
        monkeypatch.setattr(local, step, lambda *args, step=step, **kwargs: pytest.fail(f"{step} ran"))
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    with pytest.raises(BringUpError, match="already running" if is_head_up else "in use by another process"):
        local.up(cfg, progress=lambda msg: None)


def test_down_with_a_state_dir_that_is_not_there_says_so(tmp_path):
    """A mistyped --state-dir was "nothing to stop" and exit 0: a script read the cluster as stopped."""
    from typer.testing import CliRunner

    from cluster.cli import app

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for where, message in ((tmp_path / "mistyped", "does not exist"), (a_file, "is a file")):
        result = CliRunner().invoke(app, ["down", "--state-dir", str(where)])
        assert result.exit_code == 2 and message in result.output, result.output
    result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path)])  # there, and nothing recorded
    assert result.exit_code == 0 and "nothing to stop" in result.output
    # The same typo through the variable README names as the flag's equal.
    result = CliRunner().invoke(app, ["down"], env={"WARMPATH_STATE_DIR": str(tmp_path / "mistyped")})
    assert result.exit_code == 2 and "WARMPATH_STATE_DIR" in result.output and "does not exist" in result.output


def test_down_that_cannot_rewrite_its_record_says_so_in_one_line(tmp_path, monkeypatch):
    """A full disk: what `down` stopped was said, then a traceback."""
    from typer.testing import CliRunner

    from cluster.cli import app

    LocalState(redis_pid=1, redis_port=6380).save(tmp_path)  # pid 1 is no redis-server: nothing to stop there

    def full_disk(self, state_dir):
        raise OSError(28, "No space left on device", str(state_dir / "local.json"))

    monkeypatch.setattr(LocalState, "save", full_disk)
    result = CliRunner().invoke(app, ["down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "error: cannot update" in result.output and "No space left on device" in result.output


def test_down_and_status_with_a_state_dir_this_user_cannot_enter_say_so_in_one_line(tmp_path, as_unprivileged):
    """`sudo warmpath up` under umask 077 leaves a folder other users cannot enter: a traceback, exit 1."""
    from typer.testing import CliRunner

    from cluster.cli import app

    closed = tmp_path / "closed"
    (closed / "state").mkdir(parents=True)
    closed.chmod(0)

    def check():
        for command in ("down", "status"):
            result = CliRunner().invoke(app, [command, "--state-dir", str(closed / "state")])
            assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
            assert "cannot be read" in result.output, result.output

    try:
        as_unprivileged(check)
    finally:
        closed.chmod(0o700)


def test_a_build_model_seed_torch_cannot_take_is_refused_before_building(tmp_path):
    from typer.testing import CliRunner

    from cluster.cli import app

    result = CliRunner().invoke(app, ["build-model", "--seed", str(2**64), "--out", str(tmp_path / "m")])
    assert result.exit_code == 2 and not (tmp_path / "m").exists()


def test_a_state_directory_up_makes_is_its_owners_only(tmp_path):
    """It holds the Redis data (every transcript, the API keys' records): made 0755, any local user read them."""
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path / "fresh")})
    with local.state_dir_lock(cfg):
        pass
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700
    LocalState().save(tmp_path / "saved")
    assert (tmp_path / "saved").stat().st_mode & 0o777 == 0o700
