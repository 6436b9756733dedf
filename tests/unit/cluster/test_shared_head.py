"""A head `up` joined or did not start keeps what others run there; `up` reports the ports Serve really
serves and returns only once its proxies take calls."""

import http.server
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cluster import local
from cluster.config import load_config
from cluster.local import BringUpError, LocalState
from cluster.serve_config import (
    other_applications,
    own_application_names,
    render_serve_config,
    with_other_applications,
    without_own_applications,
)

OWN = {"warmpath", "warmpath-grpc"}


def _details(**apps) -> dict:
    """Serve details as the dashboard reports them: name -> (source, config or None)."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": 8000, "ssl_keyfile": None},
        "grpc_options": {"port": 9000, "grpc_servicer_functions": ["a.b"], "request_timeout_s": None,
                         "enable_reflection": True},
        "applications": {
            name: {"status": "RUNNING", "source": source, "deployed_app_config": app_config}
            for name, (source, app_config) in apps.items()
        },
    }


def test_other_declarative_applications_are_carried_and_ours_and_imperative_ones_are_not():
    details = _details(
        warmpath=("declarative", {"name": "warmpath", "import_path": "old:app"}),
        billing=("declarative", {"name": "billing", "import_path": "billing:app", "route_prefix": "/billing"}),
        notebook=("imperative", None),
    )
    assert other_applications(details, OWN) == [
        {"name": "billing", "import_path": "billing:app", "route_prefix": "/billing"}
    ]
    cfg = load_config(environ={})
    doc = render_serve_config(cfg)
    merged = with_other_applications(doc, details, own_application_names(cfg))
    assert [app["name"] for app in merged["applications"]] == ["warmpath", "warmpath-grpc", "billing"]
    assert merged["applications"][0] is doc["applications"][0] and merged["http_options"] == doc["http_options"]
    assert len(doc["applications"]) == 2  # the rendered document itself is left as it was


def test_removing_ours_keeps_the_rest_and_the_running_proxy_options():
    details = _details(
        warmpath=("declarative", {"name": "warmpath"}),
        billing=("declarative", {"name": "billing", "route_prefix": "/billing"}),
    )
    doc = without_own_applications(details, OWN)
    assert doc["applications"] == [{"name": "billing", "route_prefix": "/billing"}]
    assert doc["http_options"] == details["http_options"] and doc["grpc_options"] == details["grpc_options"]
    assert without_own_applications(_details(warmpath=("declarative", {"name": "warmpath"})), OWN)["applications"] == []


class _FakeServe:
    """Serve's REST API as `ServeSubmissionClient` exposes it: a document replaces the declarative apps."""

    def __init__(self, details: dict):
        self.details = details
        self.puts: list[dict] = []
        self.deleted_all = False

    def get_serve_details(self) -> dict:
        return self.details

    def deploy_applications(self, doc: dict) -> None:
        self.puts.append(doc)
        kept = {name: app for name, app in self.details["applications"].items() if app["source"] == "imperative"}
        for app in doc["applications"]:
            kept[app["name"]] = {"status": "RUNNING", "source": "declarative", "deployed_app_config": app}
        self.details = {**self.details, "applications": kept}

    def delete_applications(self) -> None:
        self.deleted_all = True
        self.details = {**self.details, "applications": {}}


@pytest.fixture
def serve(monkeypatch):
    fake = _FakeServe(_details(
        warmpath=("declarative", {"name": "warmpath"}),
        billing=("declarative", {"name": "billing", "route_prefix": "/billing"}),
        notebook=("imperative", None),
    ))
    monkeypatch.setattr(local, "_serve_client", lambda state: fake)
    monkeypatch.setattr(local.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    return fake


def test_deploying_into_a_shared_head_keeps_its_other_applications(tmp_path, serve):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    lines = []
    local.deploy(cfg, LocalState(ray_address="ray://head:10001"), lines.append)
    assert set(serve.details["applications"]) == {"warmpath", "warmpath-grpc", "billing", "notebook"}
    assert serve.details["applications"]["warmpath"]["deployed_app_config"]["import_path"] == "serve_apps.builders:build_app"
    assert any("keeping the head's other applications as they are: billing" in line for line in lines), lines


def test_down_on_a_joined_head_removes_only_warmpath(tmp_path, serve):
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    LocalState(ray_address="ray://head:10001", dashboard_url="http://head:8265").save(tmp_path)
    lines = []
    local.down(cfg, lines.append)
    assert not serve.deleted_all
    assert set(serve.details["applications"]) == {"billing", "notebook"}
    assert any("was joined, not started: left running" in line for line in lines), lines
    assert LocalState.load(tmp_path).is_empty()


def test_down_without_the_config_removes_the_application_up_recorded(tmp_path, serve):
    """Run without the config that set `app_name: agents`, `down` deleted `warmpath` (never there), said so, and
    forgot `agents`, which went on serving with nothing recorded."""
    serve.details["applications"]["agents"] = {"status": "RUNNING", "source": "declarative",
                                               "deployed_app_config": {"name": "agents"}}
    serve.details["applications"]["agents-grpc"] = {"status": "RUNNING", "source": "declarative",
                                                    "deployed_app_config": {"name": "agents-grpc"}}
    LocalState(ray_address="ray://head:10001", dashboard_url="http://head:8265", http_url="http://head:8000",
               app_name="agents").save(tmp_path)
    lines = []
    assert local.down(load_config(environ={}, overrides={"state_dir": str(tmp_path)}), lines.append)
    assert set(serve.details["applications"]) == {"warmpath", "billing", "notebook"}
    assert any("the recorded application is 'agents'" in line for line in lines), lines


@pytest.mark.parametrize("address", ["auto", "ray://head.example:10001"])
@pytest.mark.parametrize("has_served", [False, True])
def test_a_join_that_never_served_is_forgotten_when_its_head_cannot_be_reached(
        tmp_path, monkeypatch, has_served, address):
    """`RAY_ADDRESS=auto` with no head running: `up` failed, and every later `down` failed and every plain `up`
    was refused, with nothing to say how out. A join that did serve stays recorded for the next `down`, unless
    it joined a local head that no longer runs (its applications went with it)."""
    def unreachable(state):
        raise ConnectionError("Connection refused")

    monkeypatch.setattr(local, "_serve_client", unreachable)
    monkeypatch.setattr(local, "_ray_head_up", lambda: address != "auto")  # the local head is gone
    LocalState(ray_address=address, app_name="warmpath",
               http_url="http://127.0.0.1:8000" if has_served else None).save(tmp_path)
    lines = []
    is_kept = has_served and address != "auto"
    assert local.down(load_config(environ={}, overrides={"state_dir": str(tmp_path)}), lines.append) is not is_kept
    assert LocalState.load(tmp_path).is_empty() is not is_kept
    if is_kept:  # the next `down` takes the same path again
        assert LocalState.load(tmp_path).http_url == "http://127.0.0.1:8000"
    else:
        assert any("the join is forgotten" in line for line in lines), lines


def test_a_join_whose_head_answers_but_fails_the_delete_stays_recorded(tmp_path, monkeypatch):
    """An `up` that deployed and then timed out has no `http_url`: a reachable head failing the delete must not
    make `down` forget applications that may run there."""
    class Failing:
        def get_serve_details(self):
            return {"applications": {"warmpath": {"status": "DEPLOY_FAILED", "source": "declarative"}}}

        def deploy_applications(self, doc):
            raise RuntimeError("500 Internal Server Error")

    monkeypatch.setattr(local, "_serve_client", lambda state: Failing())
    LocalState(ray_address="auto", app_name="warmpath").save(tmp_path)
    assert local.down(load_config(environ={}, overrides={"state_dir": str(tmp_path)}), lambda line: None) is False
    assert LocalState.load(tmp_path).ray_address == "auto"


def test_down_leaves_a_head_started_after_ours_alone(tmp_path, serve, monkeypatch):
    """The recorded head stopped (a reboot, `ray stop`) and someone else started one: not ours to stop."""
    monkeypatch.setattr(local, "_ray_head_up", lambda: True)
    monkeypatch.setattr(local, "head_session", lambda: "session_2026-12-05_14-00-00_222")
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    LocalState(ray_started=True, ray_address="auto", ray_session="session_2026-12-05_09-00-00_111").save(tmp_path)
    lines = []
    local.down(cfg, lines.append)  # `ray stop` would fail the test (serve fixture)
    assert not serve.deleted_all and "warmpath" in serve.details["applications"]
    assert any("started elsewhere and is left running" in line for line in lines), lines


def test_up_refuses_a_head_started_after_ours_and_forgets_ours(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: True)
    monkeypatch.setattr(local, "head_session", lambda: "session_new")
    monkeypatch.setattr(local.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    state = LocalState(ray_started=True, ray_address="auto", ray_session="session_old")
    lines = []
    with pytest.raises(BringUpError, match="already running"):
        local.start_ray(cfg, state, lines.append)
    assert not state.ray_started and state.ray_address is None
    assert any("session_old) is gone" in line for line in lines), lines
    monkeypatch.setattr(local, "head_session", lambda: "session_old")  # our own head: used again
    state = LocalState(ray_started=True, ray_session="session_old")
    assert local.start_ray(cfg, state, lines.append) == "auto" and state.ray_started


def test_joining_a_head_started_after_ours_forgets_ours_and_removes_only_warmpath(tmp_path, serve, monkeypatch):
    """With RAY_ADDRESS=auto the record of our head, gone, stayed: `up --redeploy` deleted every application of
    the head it joined (a head `up` started is all warmpath's), and `down` then left warmpath's there."""
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setattr(local, "_ray_head_up", lambda: True)
    monkeypatch.setattr(local, "head_session", lambda: "session_new")
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    state = LocalState(ray_started=True, ray_address="auto", ray_session="session_old")
    lines = []
    assert local.check_head_startable(cfg, state, lines.append) is False
    assert not state.ray_started and any("session_old) is gone" in line for line in lines), lines
    local.remove_applications(LocalState(ray_started=True, ray_session="session_old"), OWN, lines.append)
    assert not serve.deleted_all and set(serve.details["applications"]) == {"billing", "notebook"}


def test_status_of_a_head_that_is_gone_does_not_pass_another_checkouts_cluster_for_it(tmp_path, monkeypatch):
    """Another checkout's `up` serving the same app name on the same ports: RUNNING, exit 0, as this one's."""
    from typer.testing import CliRunner

    from cluster.cli import app

    LocalState(ray_started=True, ray_address="auto", ray_session="session_old", app_name="warmpath").save(tmp_path)
    monkeypatch.setattr(local, "head_session", lambda: "session_new")
    monkeypatch.setattr(local, "session_processes", lambda session: [])
    running = {"applications": {name: {"status": "RUNNING", "deployments": {}} for name in OWN}}
    monkeypatch.setattr(local, "serve_details", lambda state: running)
    result = CliRunner().invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "(session session_old) is gone" in result.output and "application warmpath: RUNNING" in result.output


@pytest.mark.parametrize("address, dashboard", [
    ("auto", "http://127.0.0.1:8265"),
    ("127.0.0.1:6379", "http://127.0.0.1:8265"),
    ("ray://raycluster-head-svc.default.svc:10001", "http://raycluster-head-svc.default.svc:8265"),
    ("10.0.0.7:6379", "http://10.0.0.7:8265"),
    ("ray://[fd00::7]:10001", "http://[fd00::7]:8265"),
])
def test_the_dashboard_of_a_joined_cluster_is_on_its_host(monkeypatch, address, dashboard):
    monkeypatch.delenv("RAY_DASHBOARD_ADDRESS", raising=False)
    assert local.dashboard_url_for(address) == dashboard


def test_ray_dashboard_address_wins_as_for_rays_own_cli(monkeypatch):
    monkeypatch.setenv("RAY_DASHBOARD_ADDRESS", "dash.example:443/")
    assert local.dashboard_url_for("ray://head:10001") == "http://dash.example:443"
    monkeypatch.setenv("RAY_DASHBOARD_ADDRESS", "https://dash.example")
    assert local.dashboard_url_for("auto") == "https://dash.example"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/-/healthz" else 404)
        self.end_headers()
        self.wfile.write(b"success")

    def log_message(self, *args):
        pass


def test_up_returns_only_once_both_proxies_take_calls():
    http_server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    grpc_port = _free_port()
    state = LocalState(http_url=f"http://127.0.0.1:{http_server.server_port}", grpc_address=f"127.0.0.1:{grpc_port}")
    try:
        with pytest.raises(BringUpError, match="proxies do not take calls after 1 s"):
            local.wait_proxies(state, lambda msg: None, timeout_s=1)  # gRPC's port is not bound yet
        with socket.socket() as grpc_listener:
            grpc_listener.bind(("127.0.0.1", grpc_port))
            grpc_listener.listen()
            lines = []
            local.wait_proxies(state, lines.append, timeout_s=10)
            assert lines == [f"serve: proxies take calls (http {state.http_url}, grpc {state.grpc_address})"]
    finally:
        http_server.shutdown()
        http_server.server_close()


def test_up_reports_the_ports_serve_really_serves(tmp_path, monkeypatch):
    """Serve keeps the ports it first started with: a later `up --http-port` must say so, not print its own."""
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {"http_port": 8100}})
    for step in ("check_head_startable", "ensure_model", "start_ray", "deploy", "wait_proxies"):
        monkeypatch.setattr(local, step, lambda *a, **k: None)
    monkeypatch.setattr(local, "start_redis", lambda cfg, state, progress: "redis://127.0.0.1:1/0")
    monkeypatch.setattr(local, "ensure_local_api_key", lambda *a: "key")
    monkeypatch.setattr(local, "wait_running", lambda *a, **k: _details())  # what Serve said once running
    lines = []
    state = local.up(cfg, lines.append)
    assert state.http_url == "http://127.0.0.1:8000" and state.grpc_address == "127.0.0.1:9000"
    assert any("started on ports 8000 (HTTP) and 9000 (gRPC), not the 8100 and 9000" in line for line in lines)
    assert LocalState.load(tmp_path).http_url == "http://127.0.0.1:8000"


def test_a_long_wait_says_it_is_still_waiting(tmp_path, monkeypatch):
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(local.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    starting = {"applications": {"warmpath": {"status": "DEPLOYING", "deployments": {}},
                                 "warmpath-grpc": {"status": "DEPLOYING", "deployments": {}}}}
    monkeypatch.setattr(local, "serve_details", lambda state: starting)
    lines = []
    with pytest.raises(BringUpError, match="not running after 100s"):
        local.wait_running(load_config(environ={}), LocalState(), lines.append, timeout_s=100)
    assert len(lines) >= 3 and all("serve: DEPLOYING" in line for line in lines)
    assert sum("(still waiting)" in line for line in lines) == len(lines) - 1


def test_keys_without_a_recorded_cluster_say_where_they_looked(tmp_path):
    from typer.testing import CliRunner

    from cluster.cli import app

    no_redis = {"REDIS_URL": None, "WARMPATH_REDIS_URL": None}
    result = CliRunner().invoke(app, ["keys", "list", "--state-dir", str(tmp_path / "elsewhere")], env=no_redis)
    assert result.exit_code == 2
    assert f"no local cluster is recorded in {tmp_path / 'elsewhere' / 'local.json'}" in result.output


def test_up_without_keys_on_a_head_whose_proxies_listen_everywhere_says_so(tmp_path, monkeypatch):
    """Serve keeps the proxies' first options: `up --no-auth` on a head started with keys (0.0.0.0) asked for
    127.0.0.1, said the proxies listened there only, and they went on listening on every address."""
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "ports": {"host": "127.0.0.1"},
                                             "access": {"is_auth_enabled": False}})
    for step in ("check_head_startable", "ensure_model", "start_ray", "deploy", "wait_proxies"):
        monkeypatch.setattr(local, step, lambda *a, **k: None)
    monkeypatch.setattr(local, "start_redis", lambda cfg, state, progress: "redis://127.0.0.1:1/0")
    details = _details()
    details["http_options"] = {**details.get("http_options", {}), "host": "0.0.0.0"}
    monkeypatch.setattr(local, "wait_running", lambda *a, **k: details)
    lines = []
    local.up(cfg, lines.append)
    assert any("proxies listen on 0.0.0.0, not the 127.0.0.1 asked for" in line for line in lines), lines
    assert any(line.startswith("WARNING: API keys are off") for line in lines), lines


def _process_of_session(session: str) -> subprocess.Popen:
    """A process naming `session` in an option of its command line, as a Ray head's GCS, raylet and workers do."""
    return _process_naming(f"--session-dir=/tmp/ray/{session}")


def _process_naming(argument: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", argument])
    while argument.encode() not in Path(f"/proc/{process.pid}/cmdline").read_bytes():  # until it has exec'd
        assert process.poll() is None
    return process


def test_down_stops_our_head_running_beside_one_started_after_it(tmp_path, serve, monkeypatch):
    """`session_latest` names the newer head: ours, still running, was taken for gone and left running for good.
    `ray stop` would stop both: ours goes by its session's processes."""
    ours, theirs = "session_2026-12-07_09-00-00_111", "session_2026-12-07_10-00-00_222"
    monkeypatch.setattr(local, "_ray_head_up", lambda: True)
    monkeypatch.setattr(local, "head_session", lambda: theirs)
    process, bystander = _process_of_session(ours), _process_of_session(theirs)
    reader = _process_naming(f"--log-file=/tmp/ray/{ours}/logs/raylet.out")  # no Ray option: another tool's
    try:
        cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
        LocalState(ray_started=True, ray_address="auto", ray_session=ours).save(tmp_path)
        lines = []
        with pytest.raises(BringUpError, match="runs beside another Ray head"):
            local.check_head_startable(cfg, LocalState.load(tmp_path), lines.append)
        assert LocalState.load(tmp_path).ray_session == ours  # not forgotten
        assert local.down(cfg, lines.append) is True  # `ray stop` would fail the test (serve fixture)
        assert process.wait(timeout=10) is not None and bystander.poll() is None
        assert reader.poll() is None  # a process reading the session's logs is no process of the session
        # The dashboard Ray's tools reach is the other head's: its applications were deleted, ours go with our
        # session's processes.
        assert not serve.deleted_all and LocalState.load(tmp_path).is_empty()
        assert any("runs beside one started elsewhere" in line for line in lines), lines
    finally:
        for each in (process, bystander, reader):
            each.kill()
            each.wait()


def test_up_says_its_own_half_started_head_holds_the_ports(tmp_path, monkeypatch):
    """A head this state directory started that does not answer: its ports were said to be another process's."""
    ours = "session_2026-12-07_09-30-00_333"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(local, "_ray_head_up", lambda: False)
    monkeypatch.setattr(local, "ports_in_use", lambda cfg: ["port 8265 (Ray's dashboard)"])
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    state = LocalState(ray_started=True, ray_address="auto", ray_session=ours)
    with pytest.raises(BringUpError, match="in use by another process"):
        local.check_head_startable(cfg, state, lambda line: None)  # none of its processes runs
    process = _process_of_session(ours)
    try:
        with pytest.raises(BringUpError, match=f"started \\(session {ours}\\) does not answer.*`warmpath down`"):
            local.check_head_startable(cfg, state, lambda line: None)
    finally:
        process.kill()
        process.wait()
