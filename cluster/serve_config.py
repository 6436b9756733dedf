"""Renders the Ray Serve config file (`serve deploy`-able) from the cluster config.

Why a file and not only `serve.run`: the same rendered document is what
`warmpath up` deploys locally and what the KubeRay manifests embed as
`serveConfigV2`, so a config that serves here serves on Kubernetes.
The application's `args` carry the whole cluster config with the model source
resolved, and `serve_apps.builders:build_app` validates it again on arrival.
"""

from __future__ import annotations

from typing import Any

import yaml

from cluster.config import ClusterConfig

BUILDER_IMPORT_PATH = "serve_apps.builders:build_app"
GRPC_BUILDER_IMPORT_PATH = "serve_apps.builders:build_grpc_app"
# Serve's proxy only registers applications with a route prefix; HTTP there answers 404.
# Ray CPUs of the deployments beside the replicas (`serve_apps.builders`), one in all: a KubeRay worker offers
# a replica's bundle and this one more (`k8s_render.worker_ray_cpus`), no more than its pod's CPU limit.
HTTP_INGRESS_NUM_CPUS = 0.5
ORCHESTRATOR_NUM_CPUS = 0.25
GRPC_INGRESS_NUM_CPUS = 0.25
SERVICE_NUM_CPUS = HTTP_INGRESS_NUM_CPUS + ORCHESTRATOR_NUM_CPUS + GRPC_INGRESS_NUM_CPUS
# Set in a local head's environment (`cluster.local.start_ray`), which its workers inherit: the folder of the
# replicas' KV-event sockets there (`serve_apps.kv_event_ports.kv_event_endpoints`).
KV_EVENTS_IPC_DIR_ENV = "WARMPATH_KV_EVENTS_IPC_DIR"

GRPC_ROUTE_PREFIX = "/grpc"
GRPC_SERVICER_FUNCTIONS = [
    # The generated add_*Servicer_to_server, but a request that does not decode is INVALID_ARGUMENT, not UNKNOWN.
    "serve_apps.grpc_decoding.add_inference_servicer",
    "serve_apps.grpc_decoding.add_agent_servicer",
    # grpc.health.v1, answered inside the proxy (Kubernetes probes send no metadata).
    "serve_apps.grpc_status.add_health_servicer_to_server",
]


# What Serve's gRPC proxy reads or sends in one message at most (Ray's default is 2 GiB). Requests are
# held to `access.max_request_bytes` by the gRPC ingress; this bounds what an unauthenticated caller can
# make the proxy read, and leaves room for large responses (a long session's transcript).
GRPC_PROXY_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def grpc_proxy_env(cfg: ClusterConfig) -> dict[str, str]:
    """Environment every Ray node needs before it starts, so Serve's gRPC proxy takes its message limit."""
    limit = max(GRPC_PROXY_MAX_MESSAGE_BYTES, cfg.access.max_request_bytes)
    return {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(limit)}


def grpc_app_name(cfg: ClusterConfig) -> str:
    """gRPC clients send this as the `application` metadata."""
    return f"{cfg.app_name}-grpc"


def render_serve_config(cfg: ClusterConfig) -> dict[str, Any]:
    """The Serve config document (`ServeDeploySchema` shape) for `cfg`."""
    args = cfg.model_dump(mode="json")
    args["model"]["source"] = cfg.model_source()
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.ports.host, "port": cfg.ports.http_port},
        "grpc_options": {
            "port": cfg.ports.grpc_port,
            "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS,
            "enable_reflection": True,
        },
        "applications": [
            {"name": cfg.app_name, "route_prefix": "/", "import_path": BUILDER_IMPORT_PATH, "args": args},
            {
                "name": grpc_app_name(cfg),
                "route_prefix": GRPC_ROUTE_PREFIX,
                "import_path": GRPC_BUILDER_IMPORT_PATH,
                "args": args,
            },
        ],
    }


def dump_serve_config(cfg: ClusterConfig) -> str:
    """YAML text of `render_serve_config`, stable across runs (sorted keys)."""
    return yaml.safe_dump(render_serve_config(cfg), sort_keys=True, default_flow_style=False)


def own_application_names(cfg: ClusterConfig) -> set[str]:
    """The Serve applications `warmpath up` deploys and `warmpath down` removes."""
    return {cfg.app_name, grpc_app_name(cfg)}


def other_applications(details: dict[str, Any], own: set[str]) -> list[dict[str, Any]]:
    """Configs of the applications others deployed through Serve's REST API (`serve deploy`, another tool).

    Why: a Serve config document is the whole desired state of a head; applications it leaves out
    that were deployed the same way are deleted. Deploying into (or removing from) a shared head
    must carry them along. Applications deployed from Python (`serve.run`) are never deleted by a
    document, so they are not carried.
    """
    return [
        app["deployed_app_config"]
        for name, app in sorted(details.get("applications", {}).items())
        if name not in own and app.get("source") != "imperative" and app.get("deployed_app_config")
    ]


def with_other_applications(doc: dict[str, Any], details: dict[str, Any], own: set[str]) -> dict[str, Any]:
    """`doc` with the other applications running on the head (`other_applications`) added after its own."""
    return {**doc, "applications": doc["applications"] + other_applications(details, own)}


def without_own_applications(details: dict[str, Any], own: set[str]) -> dict[str, Any]:
    """The document that removes `own` from a running head and keeps everything else as it runs."""
    return {
        "proxy_location": details.get("proxy_location", "EveryNode"),
        "http_options": details.get("http_options", {}),
        "grpc_options": details.get("grpc_options", {}),
        "applications": other_applications(details, own),
    }
