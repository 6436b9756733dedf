"""One typed configuration for the whole cluster.

Why one object: the local bring-up, the Ray Serve config file (`serve deploy`),
and the KubeRay manifests must all describe the same cluster. The YAML file is
validated here once, at the edge; everything downstream receives these models,
never dicts. The only place a config turns back into a dict is
`cluster.serve_config.render_serve_config`, which embeds it as the Serve
application's `args` so `serve_apps.builders.build_app` can validate it again on
the other side of the process boundary.

Precedence, lowest to highest: field defaults < YAML file < environment
(`WARMPATH_<SECTION>__<FIELD>`, plus the standard `REDIS_URL`,
`OTEL_EXPORTER_OTLP_ENDPOINT` and `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) < CLI flags.

Configs do no I/O beyond `load_config` reading the file, and hold no runtime state.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, get_args, get_origin
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

import redis
import yaml
from pydantic import (
    BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError, ValidationInfo, field_validator,
    model_validator,
)

from cluster.model_builder import ModelShape

DEFAULT_MODEL_ID = "warmpath-tiny"
ENV_PREFIX = "WARMPATH_"

# JSON-shaped values that vLLM engine arguments accept (passed through verbatim), nested as deep as vLLM's
# own (`hf_overrides: {rope_scaling: {...}}`, `compilation_config: {pass_config: {...}}`).
EngineArgValue = JsonValue


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML reads `yes`, `on` and `true` as booleans, which pydantic takes for 1 (`num_replicas: yes`,
        `local_redis_port: true`: a privileged port): a number field refuses them."""
        if info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool):
            allowed = _leaf_types(annotation)
            if bool not in allowed and allowed & {int, float}:
                raise ValueError(f"{str(value).lower()} is a boolean, not a number")
        elif isinstance(value, dict) and get_origin(annotation) is dict and get_args(annotation)[1] in (int, float):
            # `scorer_weights: {load: yes}` and `ray_resources: {slot: on}` read as 1.0 too
            if flags := sorted(str(key) for key, item in value.items() if isinstance(item, bool)):
                raise ValueError(f"{', '.join(flags)}: a boolean, not a number")
        return value


def _holds_nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(map(_holds_nonfinite, value.values()))
    if isinstance(value, list):
        return any(map(_holds_nonfinite, value))
    return False


def _leaf_types(annotation: Any) -> set:
    """The plain types an annotation admits (`int | None` admits int and NoneType)."""
    args = get_args(annotation)
    if not args:
        return {annotation}
    return set().union(*(_leaf_types(arg) for arg in args))


class ModelConfig(_Strict):
    """Which model every replica serves and how requests name it."""

    model_id: str = Field(
        DEFAULT_MODEL_ID, description="Name clients put in the `model` field (no '#': Ray Serve names a "
        "deployment after it, and '#' separates a replica's id there).", min_length=1, pattern=r"^[^#]+$",
    )
    source: str = Field(
        "",
        description=(
            "Local checkpoint folder or Hugging Face id. Empty means the model "
            "`warmpath build-model` writes under the state directory."
        ),
    )
    max_model_len_tokens: int = Field(8192, description="Context window in tokens.", ge=256)
    tool_call_parser: str = Field(
        "hermes", description="vLLM tool-call parser for `tool_choice: auto` (the built model's template emits hermes).",
        min_length=1,
    )

    @field_validator("source")
    @classmethod
    def _local_or_hub(cls, source: str) -> str:
        if "://" in source:  # s3://, gs://: Ray Serve LLM would mirror it, the orchestrator's tokenizer cannot
            raise ValueError(
                f"{source!r}: a local folder or a Hugging Face id, not a URL (download the model to a folder on "
                "every node, or into the image, and name that folder)"
            )
        return source

    @model_validator(mode="after")
    def _fits_the_built_model(self) -> "ModelConfig":
        if not self.source and (self.model_id.startswith("/") or {".", "..", ""} & set(self.model_id.split("/"))):
            # Without a source the model is built into <state_dir>/models/<model_id>: an absolute id (Ray Serve
            # LLM's configs load the model from its id) or `..` put that folder outside, over a model of the user's.
            raise ValueError(f"model.model_id {self.model_id!r} names a folder outside the state directory, where "
                             "the built model goes when model.source is empty: set model.source to the model's "
                             "folder (or Hugging Face id) and model.model_id to the name clients send")
        # The model `build-model` writes has a fixed window: beyond it every replica fails to start, minutes later.
        built = ModelShape().max_position_embeddings
        if not self.source and self.max_model_len_tokens > built:
            raise ValueError(f"model.max_model_len_tokens {self.max_model_len_tokens} is over the {built} tokens the "
                             "built model holds (max_position_embeddings); set model.source to a model with a longer "
                             "window, or at most that")
        return self


# The custom resource names every reader of them takes alike (see `_check_accelerator`).
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9_.:/-]+")
# Far past any machine, and low enough that Ray's integer CPU counts (`ray start --num-cpus`) stay exact.
MAX_CPUS_PER_REPLICA = 1024.0
# VLLM_CPU_OMP_THREADS_BIND's core lists: `5,2-4` per worker, workers separated by `|` (spaces around the
# numbers are fine: vLLM reads each with int()).
_CORE_RANGE = r"\s*[0-9]+\s*(?:-\s*[0-9]+\s*)?"
_CORE_LIST = rf"{_CORE_RANGE}(?:,{_CORE_RANGE})*"
_CORE_LISTS = re.compile(rf"{_CORE_LIST}(?:\|{_CORE_LIST})*")
# vLLM's structured-output settings every replica starts with, unless `replicas.engine_kwargs` sets its own
# `structured_outputs_config` (whole). Compact JSON under grammars: without it a weak model fills every allowed
# whitespace position and tool-call arguments never close.
DEFAULT_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


class ReplicaConfig(_Strict):
    """Resources of one vLLM replica and how many replicas run."""

    num_replicas: int = Field(2, description="Number of vLLM replicas.", ge=1, le=512)
    accelerator: Literal["cpu", "gpu"] = Field("cpu", description="Where the engine runs.")
    num_cpus: float = Field(
        1.0, description=(
            "Logical CPUs per replica: a CPU replica's engine bundle. GPU replicas take Ray Serve LLM's bundles "
            "(one per GPU, the first with the replica actor's CPU); there it sizes only the Ray CPUs each KubeRay "
            "worker offers (num_cpus + 1) and a local head `up` starts (num_replicas x num_cpus + 4)."
        ), gt=0, le=MAX_CPUS_PER_REPLICA, allow_inf_nan=False,
    )
    num_gpus: int = Field(
        0, description="GPUs per replica; on GPU, tensor_parallel_size times engine_kwargs.pipeline_parallel_size.", ge=0
    )
    tensor_parallel_size: int = Field(1, description="vLLM tensor parallel degree.", ge=1)
    kv_cache_space_gib: int = Field(1, description="CPU only: KV cache GiB per replica (VLLM_CPU_KVCACHE_SPACE, whole GiB).", ge=1)
    cpu_omp_threads_bind: str = Field(
        "nobind",
        description=(
            "CPU only: VLLM_CPU_OMP_THREADS_BIND. vLLM's 'auto' pins every colocated engine to the same "
            "core; 'nobind' lets the OS spread replicas. Explicit core lists are every replica's: with more than "
            "one replica they need a node each (ray_resources naming a slot each node offers once, as the "
            "KubeRay CPU overlay does), or replicas sharing a host would all run on the same cores."
        ),
    )
    block_size_tokens: int = Field(32, description="KV block size; a multiple of 32 on CPU.", ge=1)
    stream_batching_interval_ms: float = Field(
        50.0,
        description=(
            "How long a replica gathers streamed chunks after the first before sending them to the "
            "ingress (Ray Serve LLM's stream_batching_interval_ms). The first chunk always leaves at "
            "once; 0 sends every chunk alone (more items across the actor boundary)."
        ),
        ge=0,
        le=1000,
    )
    engine_kwargs: dict[str, EngineArgValue] = Field(
        default_factory=dict, description="Extra vLLM engine arguments, passed through unchanged."
    )
    ray_resources: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "CPU only: custom Ray resources each replica's bundle takes besides its CPUs. With nodes "
            "that offer one replica's worth each (the KubeRay CPU overlay's workers offer "
            "warmpath_replica_slot: 1), no node holds two replicas."
        ),
    )

    @model_validator(mode="after")
    def _check_accelerator(self) -> "ReplicaConfig":
        pipeline = self.engine_kwargs.get("pipeline_parallel_size", 1)
        if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1:
            raise ValueError(f"replicas.engine_kwargs.pipeline_parallel_size must be a whole number >= 1, "
                             f"got {pipeline!r}")
        if self.accelerator == "cpu":
            if self.num_gpus:
                raise ValueError("replicas.num_gpus must be 0 when replicas.accelerator is 'cpu'")
            if self.block_size_tokens % 32:
                raise ValueError(
                    f"replicas.block_size_tokens={self.block_size_tokens}: vLLM's CPU attention needs a multiple of 32"
                )
            self._check_threads_bind()
        else:
            # Ray Serve LLM gives a replica tensor x pipeline parallel GPUs; `up`'s check and the KubeRay
            # workers count `num_gpus`, so the two must agree.
            if self.num_gpus != self.tensor_parallel_size * pipeline:
                times = f" times replicas.engine_kwargs.pipeline_parallel_size={pipeline}" if pipeline != 1 else ""
                raise ValueError(
                    f"replicas.num_gpus={self.num_gpus} must equal replicas.tensor_parallel_size="
                    f"{self.tensor_parallel_size}{times} on GPU (the GPUs each replica takes)"
                )
        data_parallel = self.engine_kwargs.get("data_parallel_size", 1)
        if data_parallel != 1:
            raise ValueError(
                f"replicas.engine_kwargs.data_parallel_size={data_parallel!r}: each replica runs one engine here; "
                "scale with replicas.num_replicas (vLLM's data-parallel ranks publish KV events on ports of their "
                "own, which the router does not follow, and take GPUs num_gpus does not count)"
            )
        for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if self.engine_kwargs.get(key, 1) != 1:
                raise ValueError(
                    f"replicas.engine_kwargs.{key}={self.engine_kwargs[key]!r}: context parallelism makes vLLM hash "
                    "and report blocks of block_size times its size, which the router would skip, blind to every "
                    "replica"
                )
        if self.ray_resources and self.accelerator != "cpu":
            raise ValueError("replicas.ray_resources applies to CPU replicas (GPU replicas are placed by their GPUs)")
        builtin = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(self.ray_resources))
        if builtin:
            raise ValueError(f"replicas.ray_resources may not name Ray's own resources {builtin}: use num_cpus")
        bad = sorted(name for name, amount in self.ray_resources.items() if not amount > 0 or amount == float("inf"))
        if bad:
            raise ValueError(f"replicas.ray_resources {bad}: amounts must be finite and above 0")
        if unsafe := sorted(name for name in self.ray_resources if not _RESOURCE_NAME.fullmatch(name)):
            # A worker's `ray start --resources` is a shell command line (KubeRay's), which a quote breaks, and
            # Ray's autoscaler reads its JSON without its escapes (`é` written `\u00e9` named another resource).
            raise ValueError(f"replicas.ray_resources {unsafe}: names are letters, digits and `_.:/-`")
        reserved = {"model", "tensor_parallel_size", "block_size", "enable_prefix_caching", "kv_events_config",
                    "enable_prompt_tokens_details", "enable_auto_tool_choice",
                    # Ray Serve LLM sets these itself (the served name is model.model_id) and refuses them there.
                    "served_model_name", "distributed_executor_backend"}
        clash = sorted(reserved & set(self.engine_kwargs))
        if clash:
            raise ValueError(f"replicas.engine_kwargs may not set {clash}: they are owned by the cluster config")
        if "api_key" in self.engine_kwargs:
            raise ValueError("replicas.engine_kwargs.api_key is the key of vLLM's own HTTP server, which Ray Serve LLM "
                             "does not run: nothing would check it (warmpath's API keys are `warmpath keys`, access.*)")
        if server_options := sorted(_VLLM_SERVER_OPTIONS & set(self.engine_kwargs)):
            raise ValueError(
                f"replicas.engine_kwargs {server_options}: options of vLLM's own HTTP server, which Ray Serve LLM "
                "does not run, so they would do nothing (warmpath's ingress serves HTTP on ports.*; put TLS in a "
                "terminating proxy or Ingress in front of it)"
            )
        if self.engine_kwargs.get("disable_log_stats"):
            raise ValueError("replicas.engine_kwargs.disable_log_stats: the replicas report KV cache use to the router "
                             "and metrics from the engine's stats (Ray Serve LLM refuses it with its engine metrics on)")
        if nonfinite := sorted(key for key, value in self.engine_kwargs.items() if _holds_nonfinite(value)):
            raise ValueError(f"replicas.engine_kwargs {nonfinite}: NaN or infinity, which the serve config's JSON "
                             "cannot carry")
        template_kwargs = self.engine_kwargs.get("default_chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ValueError("replicas.engine_kwargs.default_chat_template_kwargs must be a mapping of template "
                             f"arguments, got {type(template_kwargs).__name__}")
        # The orchestrator sizes prompts by the model section too: one value, read by both.
        owned_by_model = {"max_model_len": "model.max_model_len_tokens", "tool_call_parser": "model.tool_call_parser"}
        if clash := sorted(set(owned_by_model) & set(self.engine_kwargs)):
            fields = ", ".join(f"{owned_by_model[name]} for {name}" for name in clash)
            raise ValueError(f"replicas.engine_kwargs may not set {clash}: set {fields}")
        return self

    def _check_threads_bind(self) -> None:
        """vLLM's forms of VLLM_CPU_OMP_THREADS_BIND: `auto`, `nobind`, or a core list per engine worker
        (`0-15|16-31` for two), which the engine reads only as it starts."""
        bind = self.cpu_omp_threads_bind
        if bind in ("auto", "nobind"):
            return
        if not _CORE_LISTS.fullmatch(bind):
            raise ValueError(f"replicas.cpu_omp_threads_bind={bind!r}: 'auto', 'nobind', or core lists such as "
                             "'0-15' (one per tensor x pipeline parallel worker, separated by '|': '0-15|16-31')")
        pipeline = self.engine_kwargs.get("pipeline_parallel_size", 1)
        workers = self.tensor_parallel_size * (pipeline if isinstance(pipeline, int) else 1)
        if len(bind.split("|")) != workers:
            raise ValueError(f"replicas.cpu_omp_threads_bind={bind!r} names {len(bind.split('|'))} core lists; each "
                             f"replica runs {workers} engine workers (tensor x pipeline parallel), one list each")
        if self.num_replicas > 1 and not self.ray_resources:
            # vLLM reads the lists by a worker's rank within its engine: every replica's engine binds the same.
            raise ValueError(
                f"replicas.cpu_omp_threads_bind={bind!r} would pin all {self.num_replicas} replicas to the same "
                "cores wherever they share a host; use 'nobind', or give each replica a node of its own "
                "(replicas.ray_resources naming a slot each node offers once, as the KubeRay CPU overlay does)")

    def grammar_backend(self) -> str:
        """The structured-output backend the replicas compile forced tool calls with (vLLM's `auto` where a
        `structured_outputs_config` of `engine_kwargs` names none)."""
        settings = self.engine_kwargs.get("structured_outputs_config", DEFAULT_STRUCTURED_OUTPUTS)
        return str(settings.get("backend", "auto")) if isinstance(settings, dict) else "auto"


# vLLM's frontend options that configure its own HTTP server (`vllm serve`), which Ray Serve LLM does not start:
# Ray's proxy and warmpath's ingress answer instead (its CORS, TLS, bind address and paths are theirs).
_VLLM_SERVER_OPTIONS = frozenset({
    "host", "port", "uds", "grpc_port", "root_path", "middleware", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
    "ssl_cert_reqs", "ssl_ciphers", "enable_ssl_refresh", "allowed_origins", "allowed_methods", "allowed_headers",
    "allow_credentials",
})


RouterPolicy = Literal["warmpath", "pow2", "round-robin", "session-hash", "prefix-tree"]
# Upper bounds of the router's numbers: far past any useful setting, and low enough that every
# decision's arithmetic (a weight times a score, summed and scaled to 1e-9 ties) stays finite and exact.
MAX_SCORER_WEIGHT = 1000.0
# The picker's ties are scores within 1e-9 (`router.picker`): a smaller weight could never tell replicas apart.
MIN_SCORER_WEIGHT = 1e-6
MAX_LOAD_GUARD_FACTOR = 1000.0
MAX_TOKENS_PER_EXCESS_REQUEST = 10_000_000.0
MAX_ROUTER_SECONDS = 86_400.0
# The longest session TTL Redis is given (in milliseconds, an integer: `inf` has none).
MAX_SESSION_TTL_S = 10 * 365 * 86_400


class RouterConfig(_Strict):
    """Request routing policy for every handle that calls the replicas."""

    policy: RouterPolicy = Field(
        "warmpath",
        description=(
            "warmpath: exact KV index + load + session affinity; pow2: Ray's default power of two "
            "choices; round-robin; session-hash; prefix-tree: Ray's PrefixCacheAffinityRouter."
        ),
    )
    scorer_weights: dict[str, float] = Field(
        default_factory=lambda: {"prefix-cache": 1.0, "load": 2.0, "session-affinity": 1.0, "session-balance": 1.0},
        description="Weight per scorer (registry key); missing scorers are off.",
    )
    load_guard_factor: float = Field(
        1.5, description="No replica takes more than this multiple of the mean load.", gt=1.0,
        le=MAX_LOAD_GUARD_FACTOR, allow_inf_nan=False,
    )
    load_guard_min_requests: int = Field(
        2, description="The load guard never removes a replica that would hold at most this many requests.", ge=1
    )
    load_guard_tokens_per_excess_request: float | None = Field(
        512.0,
        description=(
            "Prefill tokens one request over the load guard's limit is worth: a guarded replica that served "
            "the request's session stays a candidate while the history only it holds saves more tokens than "
            "this times its excess requests, and below the limit that replica is chosen over the scorers' "
            "choice at the same rate (and when it saves more than this at equal load). null: the guard counts "
            "requests only and the scorers choose (below 1 it would exempt nearly every session from the guard, as "
            "0 would, and is refused)."
        ),
        ge=1,
        le=MAX_TOKENS_PER_EXCESS_REQUEST,
        allow_inf_nan=False,
    )
    session_idle_s: float = Field(
        120.0,
        description=(
            "A session counts toward its replica's active sessions (session-balance), and draws its next request "
            "to its last replica (session-affinity), until idle this long."
        ),
        gt=0, le=MAX_ROUTER_SECONDS, allow_inf_nan=False,
    )
    pending_ttl_s: float = Field(
        2.0, description="How long an optimistic (not yet confirmed by events) placement counts.", gt=0,
        le=MAX_ROUTER_SECONDS, allow_inf_nan=False,
    )
    max_blocks_per_replica: int = Field(
        500_000,
        description=(
            "Bound on indexed blocks per replica (least recently stored forgotten beyond it), raised to the KV "
            "cache size a replica reports where that is larger."
        ),
        ge=1,
    )
    forward_prompt_token_ids: bool = Field(
        True,
        description=(
            "Send the router's token ids with each text-only chat request, so the engine prefills exactly "
            "the tokens the router hashed and skips rendering and tokenizing the prompt again."
        ),
    )

    @model_validator(mode="after")
    def _check_weights(self) -> "RouterConfig":
        from router.registry import SCORERS  # the router's own list; it imports nothing of the config

        unknown = sorted(set(self.scorer_weights) - set(SCORERS))
        if unknown:
            raise ValueError(f"router.scorer_weights names unknown scorers {unknown}; known: {sorted(SCORERS)}")
        bad = {k: v for k, v in self.scorer_weights.items() if not 0 <= v <= MAX_SCORER_WEIGHT}
        if bad:
            raise ValueError(f"router.scorer_weights must be finite, >= 0 and <= {MAX_SCORER_WEIGHT:g}, got {bad}")
        if tiny := {k: v for k, v in self.scorer_weights.items() if 0 < v < MIN_SCORER_WEIGHT}:
            raise ValueError(f"router.scorer_weights must be 0 (off) or at least {MIN_SCORER_WEIGHT:g}, got {tiny}: "
                             "replicas scoring closer than that are ties, picked at random")
        if not any(self.scorer_weights.values()):
            raise ValueError(
                "router.scorer_weights needs at least one weight above 0: with none, every replica scores 0 and "
                "the warmpath policy picks at random (for that, use policy: pow2 or round-robin)"
            )
        return self


# Ports a Ray head listens on by default, which no other listener of the cluster may take.
RAY_HEAD_PORTS = {6379: "its GCS", 8265: "its dashboard", 10001: "its client server", 52365: "its dashboard agent"}

# One label of a DNS name (RFC 1123): letters, digits and inner hyphens.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _is_host_name(text: str) -> bool:
    """Whether `text` is an IP address or a DNS name a proxy can bind to (no scheme, port or brackets)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    if len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return False
    return not labels[-1].isdigit()  # `10.0.0.300` is a mistyped address, not a name


def is_loopback_host(host: str) -> bool:
    """Whether proxies bound to `host` answer this machine alone (`127.0.0.1`, `::1`, `localhost`, however
    written: `LOCALHOST`, `localhost.`)."""
    if host.lower().rstrip(".") in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to now, not assumed private


class PortsConfig(_Strict):
    """Listening ports of the Serve proxies."""

    http_port: int = Field(8000, description="OpenAI-compatible HTTP ingress.", ge=1, le=65535)
    grpc_port: int = Field(9000, description="gRPC proxy.", ge=1, le=65535)
    host: str | None = Field(
        None, description="Bind address of the proxies. Unset: 0.0.0.0, or 127.0.0.1 while API keys are off "
        "(without keys every caller holds every permission, server-side HTTP tools included).",
    )
    metrics_export_port: int = Field(
        8080, description="Ray's Prometheus metrics port on a local head (`ray_warmpath_*` series).", ge=1, le=65535
    )
    local_redis_port: int = Field(
        6380, description="Port of the redis-server `warmpath up` starts when redis_url is unset (6379 is Ray's).",
        ge=1, le=65535,
    )

    @field_validator("host")
    @classmethod
    def _host(cls, host: str | None) -> str | None:
        if host is not None and not _is_host_name(host):
            raise ValueError(
                f"{host!r} is not an IP address or host name (write it without brackets or port: 0.0.0.0, "
                "127.0.0.1, my-host.local, and \"::\" quoted in YAML)"
            )
        return host

    @model_validator(mode="after")
    def _distinct(self) -> "PortsConfig":
        named = [("ports.http_port", self.http_port), ("ports.grpc_port", self.grpc_port),
                 ("ports.metrics_export_port", self.metrics_export_port),
                 ("ports.local_redis_port", self.local_redis_port)]
        for at, (name, port) in enumerate(named):
            for other, other_port in named[at + 1:]:
                if port == other_port:
                    raise ValueError(f"{name} and {other} are both {port}")
            if port in RAY_HEAD_PORTS:
                raise ValueError(f"{name} is {port}, which a Ray head takes ({RAY_HEAD_PORTS[port]})")
        return self


class TelemetryConfig(_Strict):
    """OpenTelemetry export; off when no endpoint is set."""

    otlp_endpoint: str | None = Field(
        None, description="OTLP/HTTP endpoint, e.g. http://collector:4318; unset or empty: tracing is off."
    )
    service_name: str | None = Field(
        None, min_length=1,
        description="OpenTelemetry service.name; unset: OTEL_SERVICE_NAME, else the service.name of "
        "OTEL_RESOURCE_ATTRIBUTES, else warmpath.",
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str | None) -> str | None:
        if not endpoint:
            return None  # every process reads "" as off, as OTel's own SDK does
        if (problem := otlp_http_url_problem(endpoint)) is not None:
            raise ValueError(problem)
        return endpoint


def otlp_http_url_problem(endpoint: str) -> str | None:
    """Why `endpoint` is no URL an OTLP/HTTP exporter can post to (an http:// or https:// URL with a host and a
    port, where it names one, from 0 to 65535), or None. The exporter takes anything and fails every export."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL (OTLP over HTTP), got {endpoint!r}"
    try:
        _ = parts.port  # reading it parses it: a bad one failed every export, with tracing on
    except ValueError:
        return f"has a port that is not a number from 0 to 65535: {endpoint!r}"
    return None


# Largest token bucket of an API key: far past any use, and exact as a Lua number (the rate-limit
# script keeps 14 digits).
MAX_KEY_BURST = 10**9
# Longest a key's empty bucket may take to refill (burst / requests_per_s): about 31,700 years. Beyond
# it the bucket arithmetic leaves what Redis can hold as a millisecond expiry.
MAX_REFILL_S = 1e12


def refill_problem(burst: int, requests_per_s: float) -> str | None:
    """Why a key's token bucket of this size and rate cannot be kept (`MAX_REFILL_S`), or None: one rule for
    a key's record, `keys create`'s flags and the config's defaults, each naming its own fields."""
    refill_s = burst / requests_per_s
    return None if refill_s < MAX_REFILL_S else f"must be under {MAX_REFILL_S:g} s, got {refill_s:g} s"


def bad_permissions(permissions: Sequence[str]) -> list[str]:
    """The permissions no key can be granted (empty, or holding whitespace), as keys, tools and the config
    name them."""
    return [p for p in permissions if not p or any(c.isspace() for c in p)]
# gRPC's message size options are C ints: the gRPC proxy cannot start with a larger limit.
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1


class AccessConfig(_Strict):
    """Who may call the cluster, how often, and how much one request may carry."""

    is_auth_enabled: bool = Field(
        True, description="Require an API key (Authorization: Bearer, x-api-key, or gRPC metadata) on every call."
    )
    default_requests_per_s: float = Field(
        20.0, description="Sustained request rate of keys created without their own (read by `warmpath keys create`, "
        "which stores it in the key: give it the cluster's config).", gt=0, allow_inf_nan=False
    )
    default_burst: int = Field(
        40, description="Token bucket size of keys created without their own (read by `warmpath keys create`, as "
        "default_requests_per_s).", ge=1, le=MAX_KEY_BURST
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024, description="Largest HTTP request body or gRPC message accepted (413 beyond).", ge=1024,
        le=MAX_GRPC_MESSAGE_BYTES,
    )
    max_sessions_per_key: int | None = Field(
        1000,
        description="Live sessions one API key may hold at once (429 `session_quota_exceeded` beyond), unless the "
        "key was created with its own `--max-sessions`; null: no limit. Keys holding '*' have none.",
        ge=1,
    )

    @model_validator(mode="after")
    def _refills(self) -> "AccessConfig":
        # As `keys create` refuses a key's own: else every key created with the defaults was refused, naming
        # flags its creator never passed.
        if (problem := refill_problem(self.default_burst, self.default_requests_per_s)) is not None:
            raise ValueError(f"access.default_burst / access.default_requests_per_s (the seconds an empty bucket "
                             f"takes to refill) {problem}")
        return self


# Never a tool: link-local addresses (cloud metadata services answer there) and the other metadata endpoints.
DEFAULT_BLOCKED_TOOL_NETWORKS = ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128", "100.100.100.200/32")
# What a key must hold to define server-side HTTP tools: any other key would aim the cluster's requests.
DEFAULT_HTTP_TOOLS_PERMISSION = "tools:http"


class ToolNetworkConfig(_Strict):
    """Where server-side (HTTP) tools may point: the orchestrator POSTs to whatever URL a session declares."""

    allowed_url_prefixes: list[str] = Field(
        default_factory=list,
        description="When set, an HTTP tool's URL must fall under one of these (e.g. `https://tools.internal/`): "
        "same scheme, host and port, and a path at or below the prefix's.",
    )
    blocked_networks: list[str] = Field(
        default_factory=lambda: list(DEFAULT_BLOCKED_TOOL_NETWORKS),
        description="CIDRs no HTTP tool may reach, checked on the URL's host and every address it resolves to.",
    )
    http_tools_permission: str | None = Field(
        DEFAULT_HTTP_TOOLS_PERMISSION,
        description="Permission an API key needs to give a session server-side HTTP tools (the cluster POSTs to "
        "URLs the session names); null: any key may. Client-side tools need none.",
    )

    @field_validator("allowed_url_prefixes")
    @classmethod
    def _http_prefixes(cls, prefixes: list[str]) -> list[str]:
        def is_http_url(prefix: str) -> bool:
            try:
                parts = urlsplit(prefix)
                return parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 1) > 0
            except ValueError:  # a port out of range, a bracketed host that is no address
                return False

        bad = [p for p in prefixes if not is_http_url(p)]
        if bad:
            raise ValueError(f"URL prefixes must be http(s)://host[:port][/path], got {bad}")
        return prefixes

    @field_validator("http_tools_permission")
    @classmethod
    def _permission(cls, permission: str | None) -> str | None:
        if permission is not None and bad_permissions([permission]):
            raise ValueError(f"must be non-empty without whitespace (or null), got {permission!r}")
        return permission

    @field_validator("blocked_networks")
    @classmethod
    def _networks(cls, networks: list[str]) -> list[str]:
        for network in networks:
            ipaddress.ip_network(network, strict=False)  # ValueError names the bad one
        return networks


class ClusterConfig(_Strict):
    """The whole cluster: model, replicas, routing, state and ports."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Served model.")
    replicas: ReplicaConfig = Field(default_factory=ReplicaConfig, description="vLLM replicas.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Routing policy.")
    ports: PortsConfig = Field(default_factory=PortsConfig, description="Proxy ports.")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, description="Tracing and metrics export.")
    access: AccessConfig = Field(default_factory=AccessConfig, description="API keys, rate limits, request size.")
    tool_network: ToolNetworkConfig = Field(
        default_factory=ToolNetworkConfig, description="Where server-side tools may send their calls."
    )
    redis_url: str | None = Field(
        None, description="Session store. Unset: `warmpath up` starts a local redis-server with persistence."
    )
    session_ttl_s: float = Field(
        86_400.0,
        description="Sessions expire this long after their creation or last committed turn (1 s to 10 years).",
        ge=1, le=MAX_SESSION_TTL_S, allow_inf_nan=False,
    )
    state_dir: str = Field(
        ".warmpath", description="Local state: model, Redis data, logs, pid files.", min_length=1
    )
    app_name: str = Field(
        "warmpath", description="Ray Serve application name: printable ASCII without '#' (it separates a replica's "
        "id, as in model_id); gRPC clients send it in metadata, which takes printable ASCII only.",
        min_length=1, pattern=r"^[ -\"$-~]+$",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if not url or not url.strip():
            return None  # an empty REDIS_URL= is unset: `up` starts its own Redis and deploys with its URL
        check_redis_url(url)
        return url

    @model_validator(mode="after")
    def _proxy_host(self) -> "ClusterConfig":
        """Resolves an unset `ports.host` here, once, so that `up`, `render serve-config` and every check of
        the ports read the one address the proxies bind (whichever layer set what)."""
        if self.ports.host is None:
            host = "0.0.0.0" if self.access.is_auth_enabled else "127.0.0.1"
            object.__setattr__(self, "ports", self.ports.model_copy(update={"host": host}))  # the model is frozen
        return self

    def model_source(self) -> str:
        """Folder or Hugging Face id the engines load.

        A local path (`/`, `./`, `../`, `~`) is made absolute here, where the config is read: the
        engines run in Ray's workers, with another working directory, and no shell expands `~` there.
        """
        if self.model.source:
            if self.model.source.startswith(LOCAL_PATH_PREFIXES):
                return os.path.abspath(os.path.expanduser(self.model.source))
            return self.model.source
        return str(Path(self.state_dir).expanduser().resolve() / "models" / self.model.model_id)

    def tokenizer_source(self) -> str:
        """Folder or hub id of the tokenizer the engines load: `replicas.engine_kwargs.tokenizer` where set (as
        vLLM reads it), else the model's."""
        tokenizer = self.replicas.engine_kwargs.get("tokenizer")
        return str(tokenizer) if tokenizer else self.model_source()

    def tokenizer_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` arguments loading the engines' tokenizer as vLLM does: its remote code where the
        engines run the model's (`trust_remote_code`), at the tokenizer's revision, else the model's.

        Why: the orchestrator and the router render prompts with it; without these they loaded another
        revision's tokenizer, or none (a tokenizer of custom code is refused without `trust_remote_code`).
        """
        engine_kwargs = self.replicas.engine_kwargs
        kwargs: dict[str, Any] = {}
        if _reads_as_true(engine_kwargs.get("trust_remote_code")):  # as vLLM's ModelConfig reads it ('yes' too)
            kwargs["trust_remote_code"] = True
        revision = engine_kwargs.get("tokenizer_revision") or engine_kwargs.get("revision")
        if revision:
            kwargs["revision"] = str(revision)
        return kwargs


def _reads_as_true(value: Any) -> bool:
    """Whether pydantic's lax bool, which vLLM's config classes use, reads `value` as true."""
    try:
        return TypeAdapter(bool).validate_python(value) is True
    except ValidationError:
        return False


# How a `model.source` that is a local path starts; anything else may be a Hugging Face id ("org/name").
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")

# Highest database number a Redis URL may name: Redis' default `databases 16` numbers them 0-15.
MAX_REDIS_DB = 15


def without_password(url: str) -> str:
    """`url` with its password masked, for messages: in `user:password@`, and a `password` option of its
    query (redis-py reads one there too).

    The option is masked in the text as written, and the user part ends at the last `@` before the
    first `=`: a password holding `#`, `/` or `?` unencoded ends the address where a URL parser reads
    it, before the `@`, and was printed whole; an `@` in the query (`password=a@b`) is no user part.
    """
    url = _RAW_QUERY_PASSWORD.sub(r"\1***", url)
    scheme, separator, rest = url.partition("://")
    userinfo = rest.partition("=")[0].rpartition("@")[0] if separator else ""
    if userinfo:
        user = userinfo.partition(":")[0] + ":" if ":" in userinfo else ""
        url = f"{scheme}://{user}***@{rest[len(userinfo) + 1:]}"
    try:
        parts = urlsplit(url)
    except ValueError:  # a netloc it cannot read (an unclosed `[`): masked whole
        return "<unreadable URL>"
    if parts.password not in (None, "***"):  # a password holding `=`, which the text's split left to the parser
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    text = parts.geturl()
    return text.replace(":", "://", 1) if separator and not parts.netloc else text  # `unix:///path` as written


# A `password=` option in a URL's text, up to the next option or a fragment.
_RAW_QUERY_PASSWORD = re.compile(r"([?&;]password=)[^&;#]*", re.IGNORECASE)


def check_redis_url(url: str) -> None:
    """Raises ValueError, one line naming the problem, unless the Redis client can use `url` as written.

    Checked at config time because redis-py is lenient until it is too late: a
    database that is not a number (`/abc`) silently means db 0, one the server
    lacks (`/99`) fails every call, and a bad option (`?socket_timeout=abc`)
    fails only when a deployment builds its client. Nothing connects.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"must be a redis://, rediss:// or unix:// URL, got {without_password(url)!r}")
    try:
        _ = parts.port  # reading it parses it
    except ValueError:
        # Where the address the parser read has no `@` but the URL has one, the password cut it short.
        hint = (" (a password's `#`, `/` and `?` must be percent-encoded: %23, %2F, %3F)"
                if "@" in url.partition("://")[2] and "@" not in parts.netloc else "")
        raise ValueError(f"has a port that is not a number from 0 to 65535: {without_password(url)!r}{hint}") from None
    _check_redis_db(parts)
    _check_redis_options(url)


def _redis_db_text(parts: SplitResult) -> str | None:
    """The database as the URL writes it (`?db=`, else a redis:// URL's path); None when it names none (db 0)."""
    query_db = parse_qs(parts.query).get("db")
    if query_db:
        return query_db[0]
    path = unquote(parts.path)
    if parts.scheme == "unix" or path in ("", "/"):
        return None  # a unix:// URL's path is its socket
    return path[1:]


def _check_redis_db(parts: SplitResult) -> None:
    """A database number from 0 to MAX_REDIS_DB, written as digits (`/1/2` would silently mean db 12)."""
    text = _redis_db_text(parts)
    if text is not None and not (re.fullmatch(r"[0-9]+", text) and int(text) <= MAX_REDIS_DB):
        raise ValueError(
            f"names database {text!r}; it must be a number from 0 to {MAX_REDIS_DB} (as in redis://host:6379/0)"
        )


def _check_redis_options(url: str) -> None:
    """Builds a throwaway client and connection object from `url` (nothing connects) so its options are parsed."""
    try:
        client = redis.Redis.from_url(url)
        client.connection_pool.make_connection()  # an unknown option fails only here
    except (ValueError, TypeError, redis.RedisError) as err:
        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(err))
        if unknown:
            raise ValueError(f"has a query option the Redis client does not know: {unknown.group(1)!r}") from None
        raise ValueError(f"has a query option the Redis client cannot use: {err}") from None
    client.close()


class ConfigError(ValueError):
    """A configuration that cannot be used; the message lists every problem."""


def _set_path(target: dict, path: list[str], value: object) -> None:
    for key in path[:-1]:
        node = target.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {'.'.join(path)}: {key} is not a section")
        target = node
    target[path[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key a mapping writes twice: the second silently replaced the first
    (a second `replicas:` section dropped every field of the first). Keys a merge (`<<`) brings in may be
    written again: that is what a merge is for."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Checked before the merge keys' entries join the node's own, once per node (a merged mapping is
        # flattened where it is merged, before it is built itself).
        checked = self.__dict__.setdefault("_checked_nodes", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        super().flatten_mapping(node)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own text spans several lines)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{err.problem or err.context or 'unreadable'}{where}"
    return " ".join(str(err).split())


def _field_at(path: Sequence[str]) -> Any:
    """The config field `path` names (pydantic's `FieldInfo`), or None where it names none."""
    model: Any = ClusterConfig
    field = None
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = field.annotation
    return field


def _text_field_kind(path: Sequence[str]) -> str | None:
    """"text" or "optional" (text or null) when `path` names a config field typed as text, else None."""
    field = _field_at(path)
    if field is None:
        return None
    if field.annotation is str:
        return "text"
    if set(get_args(field.annotation)) == {str, type(None)}:
        return "optional"
    return None


def _is_mapping_field(path: Sequence[str]) -> bool:
    """Whether `path` names a field that is a mapping of its own (`router.scorer_weights`), not a section."""
    field = _field_at(path)
    return field is not None and get_origin(field.annotation) is dict


def _engine_arg_value(raw: str) -> Any:
    """An engine argument from the environment: YAML's number, boolean, list or mapping, else the text as written.

    Why: vLLM's arguments are untyped here, and YAML cut a chat template path at ` #` (a comment) and refused
    a template's own text (`{% for ...`).
    """
    try:
        node = yaml.compose(raw) if raw else None
        value = yaml.safe_load(raw) if raw else raw
    except yaml.YAMLError:
        return raw
    if isinstance(node, yaml.ScalarNode) and node.style in ("'", '"'):  # quoted: the text YAML says ('1.0')
        return value
    return raw if isinstance(value, str) else value


def env_overrides(environ: Mapping[str, str]) -> dict:
    """Turns `WARMPATH_SECTION__FIELD=value` (YAML-typed values) into a nested dict."""
    return env_layer(environ)[0]


def env_layer(environ: Mapping[str, str]) -> tuple[dict, dict[tuple[str, ...], str]]:
    """The environment's overrides as a nested dict, and the variable that set each path.

    Why the variables: a value that fails validation is named by its field
    (`ports.http_port`), which a user who set `WARMPATH_PORTS__HTTP_PORT` or `REDIS_URL`
    would not look for in their shell.

    A variable is configuration when its first part names a section or field of
    the config, or when it has the `__` of a nested one (a misspelt section is
    then an error, not ignored), and one naming a section with one underscore
    (`WARMPATH_REPLICAS_NUM_REPLICAS`) is an error. Other `WARMPATH_*` variables belong to the
    shell or the tests (`WARMPATH_KEY`, `WARMPATH_TEST_KEEP_CLUSTER`) and are left alone.

    Raises:
        ConfigError: a variable names no field, or its value is not valid YAML.
    """
    out: dict = {}
    sources: dict[tuple[str, ...], str] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "WARMPATH_CONFIG":
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX):].split("__") if part]
        if not path or (path[0] not in ClusterConfig.model_fields and "__" not in name):
            if section := next((section for section in _SECTIONS if path and path[0].startswith(section + "_")), None):
                raise ConfigError(  # `WARMPATH_REPLICAS_NUM_REPLICAS` was ignored, and the default served
                    f"environment variable {name} names no setting: a field of the {section} section takes two "
                    f"underscores after it ({ENV_PREFIX}{section.upper()}__{path[0][len(section) + 1:].upper()})"
                )
            continue
        if path[:2] == ["router", "scorer_weights"] and len(path) == 3:
            path[2] = path[2].replace("_", "-")  # scorer keys are kebab-case; shells allow no dash in a name
        text_kind = _text_field_kind(path)
        if text_kind is not None:  # as written: YAML would cut `dir #2` at its comment, read `off` as false
            value = None if text_kind == "optional" and raw.strip() in ("null", "~") else raw
        elif path[:2] == ["replicas", "engine_kwargs"] and len(path) == 3:
            value = _engine_arg_value(raw)
        else:
            try:
                value = yaml.safe_load(raw) if raw else raw
            except yaml.YAMLError as err:
                raise ConfigError(f"environment variable {name} is not valid YAML: {_yaml_problem(err)}") from None
        _set_path(out, path, value)
        sources[tuple(path)] = name
    if environ.get("REDIS_URL") and "redis_url" not in out:
        out["redis_url"] = environ["REDIS_URL"]
        sources[("redis_url",)] = "REDIS_URL"
    telemetry = out.setdefault("telemetry", {})
    if isinstance(telemetry, dict):  # else WARMPATH_TELEMETRY set it whole, to what validation then names
        # OTLP's signal-specific variable turns tracing on too (`telemetry.traces_endpoint` sends spans there).
        for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            if environ.get(variable) and "otlp_endpoint" not in telemetry and speaks_otlp_protocol(environ):
                telemetry["otlp_endpoint"] = environ[variable]
                sources[("telemetry", "otlp_endpoint")] = variable
        if environ.get("OTEL_SERVICE_NAME") and "service_name" not in telemetry:
            telemetry["service_name"] = environ["OTEL_SERVICE_NAME"]
            sources[("telemetry", "service_name")] = "OTEL_SERVICE_NAME"
        if not telemetry:
            del out["telemetry"]
    return out, sources


def speaks_otlp_protocol(environ: Mapping[str, str]) -> bool:
    """Whether the shell's OTLP protocol (where it names one) is the one warmpath's exporter speaks.

    Why: it posts OTLP/HTTP protobuf to the endpoint; a shell set up for a collector's gRPC port (4317) gave it
    an endpoint that answered nothing it could read, and every export failed while the replicas ran. Such an
    endpoint is another tool's, not taken (`telemetry.otlp_endpoint` still sets one).
    """
    names = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = next((environ[name].strip() for name in names if environ.get(name, "").strip()), OTLP_PROTOCOL)
    return protocol == OTLP_PROTOCOL


def deep_merge(base: dict, override: Mapping) -> dict:
    """Returns `base` updated by `override`, merging nested sections key by key."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def format_validation_error(err: ValidationError, sources: Mapping[tuple[str, ...], str] | None = None) -> str:
    """One line per problem, naming what set the field (`environment variable REDIS_URL`, `--replicas`) where
    `sources` has it."""
    lines = [f"invalid cluster config ({err.error_count()} problem(s)):"]
    for item in err.errors():
        loc = tuple(str(p) for p in item["loc"])
        where = ".".join(loc) or "<root>"
        setter = _setter_of(loc, sources or {})
        below = _setters_below(loc, sources or {}) if setter is None else []
        if setter is not None:
            where += f" (set by {setter})"
        elif below and item["type"] == "extra_forbidden":  # a section that does not exist, named by a variable
            where += f" (set by {below[0]})"
        elif below:  # a section's own check: the file may be at fault as much as the variables
            where += f" (holding values set by {', '.join(below)})"
        lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)


def _setter_of(loc: tuple[str, ...], sources: Mapping[tuple[str, ...], str]) -> str | None:
    """What set `loc` or a section holding it (`WARMPATH_ROUTER`'s variable for `router.policy`)."""
    for depth in range(len(loc), 0, -1):
        if loc[:depth] in sources:
            return sources[loc[:depth]]
    return None


def _setters_below(loc: tuple[str, ...], sources: Mapping[tuple[str, ...], str]) -> list[str]:
    """What set paths under `loc` (`WARMPATH_REPLICA__NUM_REPLICAS`'s variable under a section `replica`)."""
    return sorted({setter for path, setter in sources.items() if loc and path[: len(loc)] == loc})


def validate_config(data: Mapping, sources: Mapping[tuple[str, ...], str] | None = None) -> ClusterConfig:
    """Validates a plain mapping; raises ConfigError with one line per problem.

    Args:
        sources: what set each path (`environment variable REDIS_URL`, `--replicas`), named beside its
            problems.
    """
    try:
        return ClusterConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, sources)) from None


OTLP_PROTOCOL = "http/protobuf"  # what `telemetry.setup_tracing`'s exporter sends
# The top-level keys whose value is a section of settings (a mapping).
_SECTIONS = frozenset(name for name, field in ClusterConfig.model_fields.items()
                      if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping | None = None,
    flag_names: Mapping[tuple[str, ...], str] | None = None,
) -> ClusterConfig:
    """Loads defaults < YAML file < environment < explicit overrides (CLI flags).

    Args:
        path: YAML file; None uses `$WARMPATH_CONFIG` if set, else defaults only.
        environ: environment to read overrides from (default: os.environ).
        overrides: nested dict of highest-precedence values.
        flag_names: the command-line flag that set each path of `overrides` (`("replicas", "num_replicas")`:
            `--replicas`), named beside its problems: a user who typed `--replicas 0` would not look for
            `replicas.num_replicas`.

    Returns:
        The validated config.
    """
    environ = os.environ if environ is None else environ
    path = path or environ.get("WARMPATH_CONFIG") or None
    data: dict = {}
    if path is not None:
        file = Path(path)
        try:
            if file.is_dir():
                raise ConfigError(f"config file {file} is a folder; name the YAML file in it")
            if not file.exists():  # a pipe (`--config <(...)`) is read as a file is
                raise ConfigError(f"config file not found: {file}")
        except OSError as err:  # a folder on the way this user may not enter
            raise ConfigError(f"config file {file} cannot be read: {err.strerror or err}") from None
        try:
            loaded = yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {file} is not valid YAML: {_yaml_problem(err)}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {file} is not UTF-8 text (byte {err.start}): save it as UTF-8") from None
        except OSError as err:
            raise ConfigError(f"config file {file} cannot be read: {err.strerror}") from None
        if loaded is None:  # empty, or comments only
            loaded = {}
        if not isinstance(loaded, dict):  # `false` or `[]` read as no settings at all
            raise ConfigError(f"config file {file} must hold a mapping at the top level")
        # A section whose every line is commented out reads as null: its defaults, as an absent section's.
        data = {key: {} if value is None and key in _SECTIONS else value for key, value in loaded.items()}
    env, sources = env_layer(environ)
    for layer in (env, overrides or {}):
        data = deep_merge(_with_defaults_under(data, layer, ClusterConfig), layer)
        if layer is env:
            # A variable that sets a mapping field whole (`WARMPATH_ROUTER__SCORER_WEIGHTS='{load: 1}'`, or within a
            # section it sets, `WARMPATH_ROUTER='{scorer_weights: {load: 1}}'`) replaces it, as the file's mapping
            # does; merged into the default or the file's, it could not take keys out.
            for path in _set_paths(env):
                if _is_mapping_field(path) and any(path[:n] in sources for n in range(1, len(path) + 1)):
                    _set_path(data, list(path), _value_at(env, path))
    flags = set(_set_paths(overrides or {}))
    setters = {path: f"environment variable {name}" for path, name in sources.items() if path not in flags}
    return validate_config(data, {**setters, **(flag_names or {})})


def _value_at(layer: Mapping, path: Sequence[str]) -> Any:
    for part in path:
        layer = layer[part]
    return layer


def _set_paths(layer: Mapping, above: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every path a layer of overrides sets, sections and the fields below them alike."""
    paths = []
    for key, value in layer.items():
        path = above + (str(key),)
        paths.append(path)
        if isinstance(value, Mapping):
            paths.extend(_set_paths(value, path))
    return paths


def _with_defaults_under(data: dict, layer: Mapping, model: type[BaseModel]) -> dict:
    """`data` holding, under every mapping field `layer` sets that `data` lacks, that field's default.

    Why: an environment variable or flag names one key of a mapping field
    (`WARMPATH_ROUTER__SCORER_WEIGHTS__LOAD=3`); merged into nothing, it would be the
    whole mapping and switch the other scorers off. A mapping the file writes stays the
    file's whole (its scorers missing there are off). A section (`ports`) is not filled
    in: its unset fields stay unset, as some mean something (`ports.host` unset is
    127.0.0.1 while keys are off), and validation gives the others their defaults.
    """
    out = dict(data)
    for key, value in layer.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None or not isinstance(value, Mapping):
            continue
        below = out.get(key)
        section = field.annotation if isinstance(field.annotation, type) else None
        if section is not None and issubclass(section, BaseModel):
            if below is None or isinstance(below, dict):
                out[key] = _with_defaults_under(below or {}, value, section)
        elif below is None and isinstance(default := field.get_default(call_default_factory=True), dict):
            out[key] = dict(default)
    return out
