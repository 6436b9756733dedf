"""One real local cluster per test session: Redis, a Ray head, 2 vLLM CPU replicas.

The cluster is brought up through `cluster.local.up`, the same code path as
`warmpath up`, with its own state directory and Redis port so it never touches
a developer's running cluster state. Tests talk to it only over loopback HTTP
(the real `openai` client, httpx) and Redis.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from cluster import local
from cluster.api_keys import bearer_headers
from cluster.config import ClusterConfig, load_config
from cluster.model_builder import build_model, is_built
from cluster.serve_config import grpc_app_name
from tests.integration.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parents[2]
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
MODEL_DIR = REPO / ".warmpath" / "models" / "warmpath-tiny"


@dataclass(frozen=True)
class Cluster:
    cfg: ClusterConfig
    base_url: str
    redis_url: str
    api_key: str

    @property
    def model_id(self) -> str:
        return self.cfg.model.model_id

    @cached_property
    def client(self) -> httpx.Client:
        """An HTTP client for the cluster, authenticated with the admin key."""
        return self.http()

    @property
    def headers(self) -> dict[str, str]:
        """What every call needs: the local admin key `warmpath up` created."""
        return bearer_headers(self.api_key)

    def http(self, api_key: str | None = None, timeout_s: float = 300) -> httpx.Client:
        """An HTTP client for the cluster, authenticated with the admin key (or `api_key`)."""
        return httpx.Client(
            base_url=self.base_url, timeout=timeout_s, headers=bearer_headers(api_key or self.api_key)
        )


def _test_config(otlp_endpoint: str) -> ClusterConfig:
    overrides = {
        "telemetry": {"otlp_endpoint": otlp_endpoint, "service_name": "warmpath-test"},
        "state_dir": str(REPO / ".warmpath" / "test-cluster"),
        "model": {"source": str(MODEL_DIR)},
        "ports": {"local_redis_port": 6391},
        "replicas": {"num_replicas": 2},
    }
    return load_config(environ={k: v for k, v in os.environ.items() if k.startswith("WARMPATH_ROUTER")},
                       overrides=overrides)


def pytest_collection_modifyitems(items):
    """Tests that kill replicas run after the others, and those that replace the application last."""

    def rank(item) -> int:
        if item.get_closest_marker("redeploys_cluster"):
            return 2
        return 1 if item.get_closest_marker("disrupts_replicas") else 0

    items.sort(key=rank)


@pytest.fixture(scope="session")
def otlp_receiver() -> OtlpReceiver:
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


def _uncaptured_progress(config: pytest.Config):
    """Progress lines shown as they happen: a bring-up takes minutes, and pytest's capture would hold its lines
    back until a test failed (a CI log showed nothing while the cluster started, or hung)."""
    capture = config.pluginmanager.getplugin("capturemanager")

    def say(message: str) -> None:
        if capture is None:  # -p no:capture
            print(f"[cluster] {message}", flush=True)
            return
        with capture.global_and_fixture_disabled():
            print(f"[cluster] {message}", flush=True)

    return say


@pytest.fixture(scope="session")
def cluster(otlp_receiver: OtlpReceiver, pytestconfig: pytest.Config) -> Cluster:
    if not is_built(MODEL_DIR):
        build_model(MODEL_DIR)
    cfg = _test_config(otlp_receiver.endpoint)
    redeploy = os.environ.get("WARMPATH_TEST_REDEPLOY") == "1"
    progress = _uncaptured_progress(pytestconfig)
    try:
        # Inside the try: a bring-up that fails or times out still stops what it started.
        state = local.up(cfg, progress=progress, timeout_s=900, redeploy=redeploy)
        api_key = local.api_key_file(cfg).read_text().strip()
        yield Cluster(
            cfg=cfg, base_url=f"http://127.0.0.1:{cfg.ports.http_port}", redis_url=state.redis_url, api_key=api_key
        )
    finally:
        if os.environ.get("WARMPATH_TEST_KEEP_CLUSTER") != "1":
            local.down(cfg, progress=progress)


@pytest.fixture(scope="session")
def openai_client(cluster: Cluster):
    from openai import OpenAI

    return OpenAI(base_url=f"{cluster.base_url}/v1", api_key=cluster.api_key, max_retries=0, timeout=120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A bare redis-server of its own for one test module (no persistence), apart from the cluster's."""
    if not shutil.which(REDIS_SERVER):
        pytest.skip("redis-server is not installed")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 15
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"redis-server exited with code {process.returncode}")
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail("redis-server did not answer PING within 15 s")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=10)


# --- a loopback tool server for server-side tools ------------------------------------------------

ORDER_RESULT = {"order_id": "ORD-98231", "total": "1,284.50 EUR", "ships_on": "2026-11-30", "carrier_ref": "ZX-44017"}
LOOKUP_SCHEMA = {
    "type": "object",
    "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{5}$"}},
    "required": ["order_id"],
    "additionalProperties": False,
}


class _ToolHandler(http.server.BaseHTTPRequestHandler):
    """`/lookup` answers ORDER_RESULT, `/fail` HTTP 500, `/gate` as `/lookup` once opened, anything else garbage."""

    calls: list = []
    # The W3C trace context header of each call, None where it had none.
    traceparents: list = []
    # `/gate` answers only once the test opens it, after telling the test the call arrived.
    gate_reached = threading.Event()
    gate_open = threading.Event()

    def do_POST(self):  # noqa: N802 - http.server naming
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        _ToolHandler.calls.append((self.path, body))
        _ToolHandler.traceparents.append(self.headers.get("traceparent"))
        if self.path == "/gate":
            _ToolHandler.gate_reached.set()
            _ToolHandler.gate_open.wait(60)
            self.path = "/lookup"
        if self.path == "/fail":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal error")
            return
        payload = json.dumps(ORDER_RESULT).encode() if self.path == "/lookup" else b"\x00\xffnot json"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def tool_server():
    """Base URL of a loopback tool server (`_ToolHandler`) for one test module."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ToolHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _ToolHandler.gate_open.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def tool_gate(tool_server):
    """The `/gate` tool of `tool_server`, closed: `gate_reached` is set when a call arrives, which then waits
    until the test sets `gate_open` (opened when the test ends, whatever its outcome)."""
    _ToolHandler.gate_reached.clear()
    _ToolHandler.gate_open.clear()
    yield _ToolHandler
    _ToolHandler.gate_open.set()


@pytest.fixture
def tool_traceparents(tool_server) -> list:
    """The W3C `traceparent` header of each call `tool_server` gets from now on (None for a call without one).

    A fixture, not an import: pytest loads this file as a module of its own, apart from
    `tests.integration.conftest`, whose `_ToolHandler` no server uses.
    """
    _ToolHandler.traceparents.clear()
    return _ToolHandler.traceparents


@pytest.fixture
def ray_connection():
    """This process connected to the cluster's Ray (named actors, Serve handles); disconnected after the test."""
    import ray

    ray.init(address="auto", ignore_reinit_error=True, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def channel(cluster):
    """A gRPC channel to the cluster's proxy."""
    with grpc.insecure_channel(f"127.0.0.1:{cluster.cfg.ports.grpc_port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def metadata(cluster):
    """What every gRPC call sends: the gRPC application's name and the API key."""
    return [("application", grpc_app_name(cluster.cfg)), ("authorization", f"Bearer {cluster.api_key}")]
