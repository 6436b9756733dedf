"""The serveConfigV2 the KubeRay CPU overlay embeds, deployed on the local cluster.

The document is deployed unchanged. Only what a pod's environment supplies on
Kubernetes is supplied here the same way: `REDIS_URL` (from the Secret there)
as an environment variable of the application, and the model at the path the
CPU image builds it to (`/models/warmpath-tiny`). The replicas' custom Ray
resources (`replicas.ray_resources`, a slot each worker pod offers once) are
dropped: the local head offers none, and Ray cannot add a resource to a
running node. Runs last: it replaces the test application.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from cluster import local
from cluster.k8s_render import embedded_serve_config
from cluster.model_builder import build_model, is_built
from cluster.serve_config import own_application_names

pytestmark = [pytest.mark.integration, pytest.mark.redeploys_cluster]

REPO = Path(__file__).resolve().parents[2]


def test_cpu_overlay_serve_config_serves_a_request(cluster):
    doc = embedded_serve_config(REPO / "k8s" / "overlays" / "cpu")
    app = doc["applications"][0]
    model_dir = Path(app["args"]["model"]["source"])
    try:
        if not is_built(model_dir):
            build_model(model_dir)
    except PermissionError:
        pytest.skip(f"cannot write the image's model path {model_dir} on this machine")
    deployed = copy.deepcopy(doc)
    for application in deployed["applications"]:
        application["runtime_env"] = {"env_vars": {"REDIS_URL": cluster.redis_url}}
        application["args"]["replicas"].pop("ray_resources", None)
    state = local.LocalState.load(local.state_dir_of(cluster.cfg))
    local.remove_applications(state, own_application_names(cluster.cfg), progress=print)
    local.deploy_document(state, deployed)
    local.wait_running(cluster.cfg, state, progress=print, timeout_s=600)

    resp = cluster.client.post(
        "/v1/chat/completions",
        json={"model": app["args"]["model"]["model_id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-warmpath-replica"]
    session = cluster.client.post("/v1/sessions", json={"model": "warmpath-tiny"}, timeout=60)
    assert session.status_code == 201, session.text
