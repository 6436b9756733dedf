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


def render_serve_config(cfg: ClusterConfig) -> dict[str, Any]:
    """The Serve config document (`ServeDeploySchema` shape) for `cfg`."""
    args = cfg.model_dump(mode="json")
    args["model"]["source"] = cfg.model_source()
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.ports.host, "port": cfg.ports.http_port},
        "grpc_options": {"port": cfg.ports.grpc_port, "grpc_servicer_functions": []},
        "applications": [
            {
                "name": cfg.app_name,
                "route_prefix": "/",
                "import_path": BUILDER_IMPORT_PATH,
                "args": args,
            }
        ],
    }


def dump_serve_config(cfg: ClusterConfig) -> str:
    """YAML text of `render_serve_config`, stable across runs (sorted keys)."""
    return yaml.safe_dump(render_serve_config(cfg), sort_keys=True, default_flow_style=False)
