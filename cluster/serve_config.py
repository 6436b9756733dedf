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
GRPC_ROUTE_PREFIX = "/grpc"
GRPC_SERVICER_FUNCTIONS = [
    "warmpath.v1.inference_pb2_grpc.add_InferenceServicer_to_server",
    "warmpath.v1.agent_pb2_grpc.add_AgentServicer_to_server",
    # grpc.health.v1, answered inside the proxy (Kubernetes probes send no metadata).
    "serve_apps.grpc_status.add_health_servicer_to_server",
]


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
