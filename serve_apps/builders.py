"""Ray Serve application builder: cluster config in, Serve application out.

`build_app` is the `import_path` of the rendered Serve config
(`serve_apps.builders:build_app`), so `warmpath up`, `serve deploy` and the
KubeRay `serveConfigV2` all build the application through this one function
from the same validated `ClusterConfig`.

The graph is Ray Serve LLM's: one `LLMServer` deployment (our subclass) with N
replicas behind an `OpenAiIngress` (our subclass). The request router is set on
the LLM deployment, so every handle that calls the replicas routes with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.ingress import init as init_fastapi_app
from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, build_llm_deployment

from cluster.config import (
    DEFAULT_STRUCTURED_OUTPUTS,
    ClusterConfig,
    RouterPolicy,
    is_loopback_host,
    validate_config,
)
from cluster.model_builder import is_built
from cluster.serve_config import GRPC_INGRESS_NUM_CPUS, HTTP_INGRESS_NUM_CPUS, ORCHESTRATOR_NUM_CPUS
from ray.llm._internal.serve.core.server.builder import _get_deployment_name
from ray.serve.handle import DeploymentHandle

from serve_apps import api_errors
from serve_apps.access import AccessMiddleware, GuardSettings
from serve_apps.ingress_grpc import GrpcIngress
from serve_apps.ingress_http import ENDPOINTS, WarmpathIngress
from serve_apps.orchestrator.deployment import Orchestrator

ORCHESTRATOR_DEPLOYMENT = "Orchestrator"
from serve_apps.vllm_replica import WarmpathLLMServer

# Policies other than warmpath's own, for side-by-side comparison.
_ROUTER_CLASSES: dict[RouterPolicy, str | None] = {
    "warmpath": "router.adapter:PrefixKVRouter",
    "pow2": None,  # Ray Serve's default PowerOfTwoChoicesRequestRouter
    "round-robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter",
    "session-hash": "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter",
    "prefix-tree": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
}


def request_router_config(cfg: ClusterConfig) -> dict[str, Any] | None:
    """The LLM deployment's `request_router_config` for the configured policy."""
    router_class = _ROUTER_CLASSES[cfg.router.policy]
    if router_class is None:
        return None
    kwargs: dict[str, Any] = {}
    if cfg.router.policy == "warmpath":
        kwargs = {
            "router": cfg.router.model_dump(mode="json"),
            "model_id": cfg.model.model_id,
            "model_source": cfg.tokenizer_source(),
            "tokenizer_kwargs": cfg.tokenizer_kwargs(),
            "block_size_tokens": cfg.replicas.block_size_tokens,
            "max_model_len_tokens": cfg.model.max_model_len_tokens,
        }
    return {
        "request_router_class": router_class,
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": 2.0,
        "request_routing_stats_timeout_s": 5.0,
    }


def engine_kwargs(cfg: ClusterConfig) -> dict[str, Any]:
    """vLLM engine and frontend arguments every replica starts with."""
    kwargs: dict[str, Any] = {
        "max_model_len": cfg.model.max_model_len_tokens,
        "block_size": cfg.replicas.block_size_tokens,
        "enable_prefix_caching": True,
        "tensor_parallel_size": cfg.replicas.tensor_parallel_size,
        # Frontend options: cached-token counts in usage, and tool calls parsed
        # back out of the model's text. Streams carry usage when the request
        # asks (`stream_options.include_usage`); the ingresses ask for the router.
        "enable_prompt_tokens_details": True,
        "enable_auto_tool_choice": True,
        "tool_call_parser": cfg.model.tool_call_parser,
        "structured_outputs_config": dict(DEFAULT_STRUCTURED_OUTPUTS),
    }
    if cfg.replicas.accelerator == "cpu":
        # Graph compilation costs ~25 s per engine start on CPU and buys little for a small model.
        kwargs["enforce_eager"] = True
    kwargs.update(cfg.replicas.engine_kwargs)
    return kwargs


def llm_config(cfg: ClusterConfig) -> LLMConfig:
    """Ray Serve LLM configuration of the replica deployment."""
    deployment_config: dict[str, Any] = {
        "num_replicas": cfg.replicas.num_replicas,
        "max_ongoing_requests": 64,
        "ray_actor_options": {"num_cpus": 0 if cfg.replicas.accelerator == "cpu" else 1},
    }
    router_config = request_router_config(cfg)
    if router_config is not None:
        deployment_config["request_router_config"] = router_config
    env_vars = {
        # `tool_choice: required` or a named tool decode under vLLM's JSON-Schema
        # grammar of the tools (compact, `disable_any_whitespace`). The strict
        # structural-tag path instead lets whitespace into the arguments, which a
        # weak model fills until max_tokens.
        "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0",
        "VLLM_NO_USAGE_STATS": "1",
    }
    extra: dict[str, Any] = {}
    # Always the config's word: unset, a replica read the endpoint its worker inherited (a head started with
    # the shell's OTEL_* variables), traced with tracing off, and failed to start on a gRPC-style value.
    env_vars["OTEL_EXPORTER_OTLP_ENDPOINT"] = cfg.telemetry.otlp_endpoint or ""
    if cfg.telemetry.otlp_endpoint and cfg.telemetry.service_name:
        env_vars["OTEL_SERVICE_NAME"] = cfg.telemetry.service_name
    if not cfg.model.source or is_built(Path(cfg.model_source())):
        # The built model: never look for it on a hub. Read from the folder, not from an empty source: the
        # rendered serve config names the folder (`render_serve_config`), and so does the CPU overlay.
        env_vars["HF_HUB_OFFLINE"] = "1"
    if cfg.replicas.accelerator == "cpu":
        env_vars["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.replicas.kv_cache_space_gib)
        env_vars["VLLM_CPU_OMP_THREADS_BIND"] = cfg.replicas.cpu_omp_threads_bind
        # Without explicit bundles every replica asks for a GPU and never starts.
        extra["placement_group_config"] = {"bundles": [{"CPU": cfg.replicas.num_cpus, **cfg.replicas.ray_resources}]}
    return LLMConfig(
        model_loading_config={"model_id": cfg.model.model_id, "model_source": cfg.model_source()},
        engine_kwargs=engine_kwargs(cfg),
        deployment_config=deployment_config,
        runtime_env={"env_vars": env_vars},
        experimental_configs={"stream_batching_interval_ms": cfg.replicas.stream_batching_interval_ms},
        **extra,
    )


def ingress_app(guard: GuardSettings) -> FastAPI:
    """Ray Serve LLM's OpenAI app with the API's error shapes and the access guard.

    Every route but the public ones (health, OpenAPI) passes the API-key, rate and size
    checks first. The guard sits just inside the CORS layer, so its refusals (401, 413,
    429, 503) carry CORS headers and a browser on another origin can read them (and their
    `Retry-After`); it was the outermost layer.
    """
    app = init_fastapi_app()
    api_errors.install(app)
    cors_at = next((at for at, layer in enumerate(app.user_middleware) if layer.cls is CORSMiddleware), None)
    # `user_middleware` lists the outermost first: after CORS is inside it.
    app.user_middleware.insert(0 if cors_at is None else cors_at + 1, Middleware(AccessMiddleware, settings=guard))
    return app


def build_llm_app(cfg: ClusterConfig) -> Application:
    """Replica deployment plus the OpenAI ingress, from a validated config."""
    llm = llm_config(cfg)
    replicas = build_llm_deployment(llm, deployment_cls=WarmpathLLMServer)
    app = ingress_app(GuardSettings(access=cfg.access, redis_url=cfg.redis_url))
    ingress_cls = make_fastapi_ingress(WarmpathIngress, endpoint_map=ENDPOINTS, app=app)
    orchestrator = serve.deployment(
        Orchestrator, name=ORCHESTRATOR_DEPLOYMENT, num_replicas=1, max_ongoing_requests=256,
        ray_actor_options={"num_cpus": ORCHESTRATOR_NUM_CPUS},
    ).bind(replicas, cfg.model_dump(mode="json"))
    options = WarmpathIngress.get_deployment_options([llm])
    options["ray_actor_options"] = {"num_cpus": HTTP_INGRESS_NUM_CPUS}
    return serve.deployment(ingress_cls, name="OpenAiIngress", **options).bind(
        llm_deployments={cfg.model.model_id: replicas},
        model_cards={cfg.model.model_id: to_model_metadata(cfg.model.model_id, llm)},
        orchestrator=orchestrator,
        telemetry_config=cfg.telemetry.model_dump(mode="json"),
        window_tokens=cfg.model.max_model_len_tokens,
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve config entry point: `args` is a `ClusterConfig` as plain data."""
    return build_llm_app(validate_config(args))


def llm_deployment_name(cfg: ClusterConfig) -> str:
    """Name `build_llm_deployment` gives the replica deployment ("<class>:<model id>")."""
    return f"{WarmpathLLMServer.__name__}:{_get_deployment_name(llm_config(cfg))}"


def build_grpc_app(args: dict[str, Any]) -> Application:
    """Serve config entry point of the gRPC application.

    Only the gRPC ingress: it calls the HTTP application's replica and
    orchestrator deployments through handles by name, so nothing is
    duplicated and both APIs share one router state per caller process.
    """
    cfg = validate_config(args)
    return serve.deployment(
        GrpcIngress, name="GrpcIngress", num_replicas=1, max_ongoing_requests=256,
        ray_actor_options={"num_cpus": GRPC_INGRESS_NUM_CPUS},
    ).bind(
        llm_handle=DeploymentHandle(llm_deployment_name(cfg), app_name=cfg.app_name),
        orchestrator_handle=DeploymentHandle(ORCHESTRATOR_DEPLOYMENT, app_name=cfg.app_name),
        model_id=cfg.model.model_id,
        guard_settings=GuardSettings(access=cfg.access, redis_url=cfg.redis_url).model_dump(mode="json"),
        telemetry_config=cfg.telemetry.model_dump(mode="json"),
        window_tokens=cfg.model.max_model_len_tokens,
        loopback_callers_only=not cfg.access.is_auth_enabled and is_loopback_host(cfg.ports.host),
    )
