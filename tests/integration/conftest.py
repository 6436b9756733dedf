"""One real local cluster per test session: Redis, a Ray head, 2 vLLM CPU replicas.

The cluster is brought up through `cluster.local.up`, the same code path as
`warmpath up`, with its own state directory and Redis port so it never touches
a developer's running cluster state. Tests talk to it only over loopback HTTP
(the real `openai` client, httpx) and Redis.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster import local
from cluster.config import ClusterConfig, load_config
from cluster.model_builder import build_model, is_built
from tests.integration.otlp_receiver import OtlpReceiver

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / ".warmpath" / "models" / "warmpath-tiny"


@dataclass(frozen=True)
class Cluster:
    cfg: ClusterConfig
    base_url: str
    redis_url: str

    @property
    def model_id(self) -> str:
        return self.cfg.model.model_id


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


@pytest.fixture(scope="session")
def cluster(otlp_receiver: OtlpReceiver) -> Cluster:
    if not is_built(MODEL_DIR):
        build_model(MODEL_DIR)
    cfg = _test_config(otlp_receiver.endpoint)
    redeploy = os.environ.get("WARMPATH_TEST_REDEPLOY") == "1"
    state = local.up(cfg, progress=lambda msg: print(f"[cluster] {msg}", flush=True), timeout_s=900, redeploy=redeploy)
    try:
        yield Cluster(cfg=cfg, base_url=f"http://127.0.0.1:{cfg.ports.http_port}", redis_url=state.redis_url)
    finally:
        if os.environ.get("WARMPATH_TEST_KEEP_CLUSTER") != "1":
            local.down(cfg, progress=lambda msg: print(f"[cluster] {msg}", flush=True))


@pytest.fixture(scope="session")
def openai_client(cluster: Cluster):
    from openai import OpenAI

    return OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
