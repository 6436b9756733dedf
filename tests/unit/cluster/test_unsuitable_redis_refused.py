"""A Redis Cluster is refused where a deployment starts, against a real redis-server in cluster mode.

Both stores use a plain client, so a cluster would answer `MOVED` for every key hashed to another
node's slots: two sessions in three failing at random, with nothing at start to say why.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time

import pytest
import redis
from redis.exceptions import MovedError

from cluster import local
from cluster.config import load_config
from cluster.local import BringUpError, LocalState
from cluster.redis_errors import redis_refusal
from cluster.redis_pool import refuse_unsuitable_redis
from serve_apps.access import AccessGuard, GuardSettings
from serve_apps.orchestrator.deployment import Orchestrator

needs_redis = pytest.mark.skipif(local.shutil.which("redis-server") is None, reason="redis-server is not installed")


def _free_port() -> int:
    """A free loopback port whose cluster bus port (10,000 above it) is free too."""
    while True:
        with socket.socket() as sock, socket.socket() as bus:
            port = random.randrange(20_000, 55_000)
            try:
                sock.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10_000))
            except OSError:
                continue
            return port


def _redis_server(tmp_path, *flags: str):
    """A redis-server on a free loopback port with `flags`, answering PING; yields its URL."""
    port = _free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 15
    try:
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield client, f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def cluster_url(tmp_path):
    """A one-node Redis Cluster holding every slot."""
    for client, url in _redis_server(tmp_path, "--cluster-enabled", "yes", "--cluster-config-file",
                                     str(tmp_path / "nodes.conf")):
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        yield url


@pytest.fixture
def standalone_url(tmp_path):
    for _, url in _redis_server(tmp_path):
        yield url


@pytest.fixture
def evicting_url(tmp_path):
    for _, url in _redis_server(tmp_path, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"):
        yield url


@needs_redis
@pytest.mark.parametrize("redis_kind, refusal", [
    ("cluster_url", "is a node of a Redis Cluster, which warmpath does not support"),
    ("evicting_url", r"evicts keys when full \(maxmemory \d+, maxmemory-policy allkeys-lru\)"),
])
def test_an_unsuitable_redis_is_refused_by_up_the_orchestrator_and_the_key_check(request, tmp_path, redis_kind,
                                                                                  refusal):
    """A Redis Cluster answers MOVED for most keys. With allkeys-lru (or a volatile-* policy: every session key
    has a TTL) a full Redis dropped a session's idle transcript while its record stayed: the session showed no
    messages and its next turn ran on none."""
    url = request.getfixturevalue(redis_kind)
    with pytest.raises(ValueError, match=refusal):
        refuse_unsuitable_redis(url)
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path), "redis_url": url})
    with pytest.raises(BringUpError, match=refusal):
        local.start_redis(cfg, LocalState(), progress=lambda msg: None)
    with pytest.raises(ValueError, match=refusal):
        AccessGuard(GuardSettings(access={"is_auth_enabled": True}, redis_url=url))
    with pytest.raises(ValueError, match=refusal):  # before it loads a tokenizer or calls a replica
        Orchestrator(None, {"redis_url": url})


@needs_redis
def test_a_standalone_redis_and_one_that_does_not_answer_pass(standalone_url):
    refuse_unsuitable_redis(standalone_url)
    refuse_unsuitable_redis(f"redis://127.0.0.1:{_free_port()}/0", timeout_s=0.5)  # an outage: the stores' to answer


def test_a_moved_reply_is_named_as_a_cluster_the_service_does_not_support():
    assert "Redis Cluster" in redis_refusal(MovedError("12671 127.0.0.1:7103"))


def _lifespan_fails(url: str) -> bool:
    """Whether the HTTP ingress app's lifespan startup fails, as Serve runs it where a replica starts."""
    import asyncio

    from uvicorn.config import Config
    from uvicorn.lifespan.on import LifespanOn

    from serve_apps.builders import ingress_app

    app = ingress_app(GuardSettings(access={"is_auth_enabled": True}, redis_url=url))

    async def start() -> bool:
        lifespan = LifespanOn(Config(app, lifespan="on", log_level=None, log_config=None))
        await lifespan.startup()
        return lifespan.should_exit

    return asyncio.run(start())


@needs_redis
def test_the_http_ingress_refuses_a_redis_cluster_as_it_starts(cluster_url, standalone_url):
    """Built on first use, the key check failed every request with a bare 500, each asking Redis again."""
    assert _lifespan_fails(cluster_url)
    assert not _lifespan_fails(standalone_url)


@needs_redis
def test_an_eviction_policy_without_a_memory_limit_evicts_nothing_and_passes(tmp_path):
    for _, url in _redis_server(tmp_path, "--maxmemory-policy", "volatile-lru"):
        refuse_unsuitable_redis(url)


@pytest.mark.parametrize("memory_failure", [redis.exceptions.TimeoutError("read timed out"),
                                            redis.exceptions.ResponseError("unknown section")])
def test_a_cluster_node_is_refused_whatever_its_memory_section_answers(monkeypatch, memory_failure):
    """The eviction check's INFO call came before the cluster refusal: a failing second call let a cluster pass."""
    class Node:
        def info(self, section):
            if section == "cluster":
                return {"cluster_enabled": 1}
            raise memory_failure

        def close(self):
            pass

    monkeypatch.setattr(redis.Redis, "from_url", staticmethod(lambda *args, **kwargs: Node()))
    with pytest.raises(ValueError, match="Redis Cluster"):
        refuse_unsuitable_redis("redis://cluster-node:6379/0")


def test_a_deployments_redis_url_from_its_environment_is_checked_with_its_password_masked():
    """A Secret's password holding `/` (base64) cut the URL short: redis-py's error quoted part of it, and that
    error became the deployment's status message, readable wherever the RayService's status is."""
    from cluster.redis_pool import serving_redis_url

    with pytest.raises(ValueError) as err:
        serving_redis_url(None, "the orchestrator", {"REDIS_URL": "redis://:S3cr3t/xyz@warmpath-redis:6379/1"})
    assert str(err.value).startswith("REDIS_URL has a port that is not a number") and "S3cr3t" not in str(err.value)
    assert "must be percent-encoded" in str(err.value)
    with pytest.raises(ValueError, match="the orchestrator needs redis_url in the cluster config or REDIS_URL"):
        serving_redis_url(None, "the orchestrator", {})
    assert serving_redis_url(None, "x", {"REDIS_URL": "redis://:p%2Fq@r:6379/1"}) == "redis://:p%2Fq@r:6379/1"
    assert serving_redis_url("redis://r:6379/2", "x", {"REDIS_URL": "redis://other:6379/1"}) == "redis://r:6379/2"
