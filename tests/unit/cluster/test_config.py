"""Cluster config: defaults, precedence (file < env < flags) and clear errors."""

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, check_redis_url, env_overrides, load_config
from cluster.serve_config import (
    BUILDER_IMPORT_PATH,
    GRPC_BUILDER_IMPORT_PATH,
    GRPC_SERVICER_FUNCTIONS,
    render_serve_config,
)


def test_defaults_describe_a_two_replica_cpu_cluster():
    cfg = load_config(environ={})
    assert cfg.replicas.num_replicas == 2
    assert cfg.replicas.accelerator == "cpu"
    assert cfg.router.policy == "warmpath"
    assert cfg.ports.http_port == 8000 and cfg.ports.grpc_port == 9000
    assert cfg.redis_url is None
    assert cfg.model_source().endswith("models/warmpath-tiny")


@pytest.mark.parametrize(
    "environ, path, expected",
    [
        ({"WARMPATH_REPLICAS__NUM_REPLICAS": "3"}, ("replicas", "num_replicas"), 3),
        ({"WARMPATH_ROUTER__POLICY": "round-robin"}, ("router", "policy"), "round-robin"),
        ({"WARMPATH_ROUTER__LOAD_GUARD_FACTOR": "2.5"}, ("router", "load_guard_factor"), 2.5),
        ({"REDIS_URL": "redis://r:6379/0"}, ("redis_url",), "redis://r:6379/0"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ("telemetry", "otlp_endpoint"), "http://c:4318"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/spans"}, ("telemetry", "otlp_endpoint"), "http://c:4318/spans"),
        ({"WARMPATH_PORTS__HTTP_PORT": "8100"}, ("ports", "http_port"), 8100),
    ],
)
def test_environment_overrides(environ, path, expected):
    value = load_config(environ=environ)
    for part in path:
        value = getattr(value, part)
    assert value == expected


def test_precedence_file_then_env_then_flags(tmp_path: Path):
    file = tmp_path / "c.yaml"
    file.write_text("replicas:\n  num_replicas: 4\n  kv_cache_space_gib: 2\nrouter:\n  policy: pow2\n")
    cfg = load_config(file, environ={})
    assert (cfg.replicas.num_replicas, cfg.replicas.kv_cache_space_gib, cfg.router.policy) == (4, 2, "pow2")
    cfg = load_config(file, environ={"WARMPATH_REPLICAS__NUM_REPLICAS": "5"})
    assert cfg.replicas.num_replicas == 5 and cfg.replicas.kv_cache_space_gib == 2
    cfg = load_config(file, environ={"WARMPATH_REPLICAS__NUM_REPLICAS": "5"}, overrides={"replicas": {"num_replicas": 6}})
    assert cfg.replicas.num_replicas == 6


@pytest.mark.parametrize(
    "data, message",
    [
        ({"replicas": {"num_replicas": 0}}, "replicas.num_replicas"),
        ({"replicas": {"block_size_tokens": 16}}, "multiple of 32"),
        ({"replicas": {"accelerator": "gpu", "num_gpus": 1, "tensor_parallel_size": 2}}, "must equal"),
        # Ray Serve LLM gives each replica tensor x pipeline parallel GPUs; `up` and KubeRay counted num_gpus.
        ({"replicas": {"accelerator": "gpu", "num_gpus": 1, "engine_kwargs": {"pipeline_parallel_size": 2}}},
         "times replicas.engine_kwargs.pipeline_parallel_size=2"),
        ({"replicas": {"accelerator": "gpu", "num_gpus": 1, "engine_kwargs": {"pipeline_parallel_size": "2"}}},
         "whole number"),
        ({"replicas": {"engine_kwargs": {"data_parallel_size": 2}}}, "scale with replicas.num_replicas"),
        ({"replicas": {"num_gpus": 1}}, "must be 0"),
        ({"replicas": {"engine_kwargs": {"block_size": 64}}}, "owned by the cluster config"),
        # Ray Serve LLM refuses these inside each replica, minutes after `up` began.
        ({"replicas": {"engine_kwargs": {"served_model_name": "x"}}}, "owned by the cluster config"),
        ({"replicas": {"engine_kwargs": {"distributed_executor_backend": "ray"}}}, "owned by the cluster config"),
        ({"model": {"max_model_len_tokens": 16384}}, "over the 8192 tokens the built model holds"),
        ({"model": {"tool_call_parser": ""}}, "model.tool_call_parser"),
        ({"replicas": {"engine_kwargs": {"default_chat_template_kwargs": "enable_thinking"}}}, "must be a mapping"),
        ({"access": {"default_requests_per_s": 1e-12}}, "must be under 1e+12 s"),
        # YAML's yes/on/true: taken for 1 (a replica, 1 GiB of KV cache, a privileged port).
        ({"replicas": {"num_replicas": True}}, "replicas.num_replicas: Value error, true is a boolean, not a number"),
        ({"ports": {"local_redis_port": True}}, "ports.local_redis_port"),
        ({"router": {"pending_ttl_s": False}}, "false is a boolean"),
        ({"replicas": {"accelerator": "gpu", "num_gpus": 1, "ray_resources": {"slot": 1}}}, "applies to CPU replicas"),
        ({"replicas": {"ray_resources": {"CPU": 1}}}, "Ray's own resources ['CPU']"),
        ({"replicas": {"ray_resources": {"slot": 0}}}, "finite and above 0"),
        ({"replicas": {"ray_resources": {"slot": float("inf")}}}, "finite and above 0"),
        # A KubeRay worker's start command breaks on a quote; Ray's autoscaler read `slot_é` as `slot_u00e9`.
        ({"replicas": {"ray_resources": {"slot'x": 1}}}, "names are letters, digits"),
        ({"replicas": {"ray_resources": {"slot_é": 1}}}, "names are letters, digits"),
        ({"replicas": {"ray_resources": {'slot"x': 1}}}, "names are letters, digits"),
        ({"router": {"policy": "random"}}, "router.policy"),
        ({"router": {"load_guard_factor": 0.5}}, "router.load_guard_factor"),
        ({"router": {"load_guard_tokens_per_excess_request": 0}}, "router.load_guard_tokens_per_excess_request"),
        ({"router": {"scorer_weights": {"load": -1}}}, ">= 0"),
        ({"router": {"scorer_weights": {"load": float("inf")}}}, "finite"),
        ({"router": {"scorer_weights": {"load": 1e300}}}, "<= 1000"),
        ({"router": {"scorer_weights": {"load": float("nan")}}}, "finite"),
        ({"router": {"scorer_weights": dict.fromkeys(["prefix-cache", "load", "session-affinity", "session-balance"], 0)}},
         "at least one weight above 0"),
        ({"router": {"load_guard_factor": float("inf")}}, "router.load_guard_factor"),
        ({"router": {"load_guard_factor": float("nan")}}, "router.load_guard_factor"),
        ({"router": {"load_guard_factor": 1e308}}, "router.load_guard_factor"),
        ({"router": {"load_guard_tokens_per_excess_request": float("inf")}},
         "router.load_guard_tokens_per_excess_request"),
        ({"router": {"pending_ttl_s": float("inf")}}, "router.pending_ttl_s"),
        ({"router": {"pending_ttl_s": 1e12}}, "router.pending_ttl_s"),
        ({"router": {"session_idle_s": float("nan")}}, "router.session_idle_s"),
        # Redis keeps the TTL in whole milliseconds: `inf` crashed the orchestrator, 0.1 ms expired sessions at once.
        ({"session_ttl_s": float("inf")}, "session_ttl_s"),
        ({"session_ttl_s": 0.0001}, "session_ttl_s"),
        ({"session_ttl_s": 1e12}, "session_ttl_s"),
        ({"ports": {"http_port": 9000}}, "both 9000"),
        ({"replicas": {"num_replica": 2}}, "replicas.num_replica"),
    ],
)
def test_invalid_values_name_the_field(data, message):
    with pytest.raises(ConfigError) as err:
        load_config(environ={}, overrides=data)
    assert message in str(err.value)


def test_bad_files_are_reported(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, environ={})


def test_env_values_are_yaml_typed():
    assert env_overrides({"WARMPATH_REPLICAS__ENGINE_KWARGS": "{max_num_seqs: 8}"}) == {
        "replicas": {"engine_kwargs": {"max_num_seqs": 8}}
    }


def test_serve_config_embeds_the_whole_validated_config():
    cfg = load_config(environ={}, overrides={"replicas": {"num_replicas": 3}})
    doc = render_serve_config(cfg)
    app, grpc_app = doc["applications"]
    assert app["import_path"] == BUILDER_IMPORT_PATH
    assert grpc_app["import_path"] == GRPC_BUILDER_IMPORT_PATH and grpc_app["args"] == app["args"]
    assert doc["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS
    assert doc["http_options"]["port"] == 8000 and doc["grpc_options"]["port"] == 9000
    again = ClusterConfig.model_validate(app["args"])
    assert again.replicas.num_replicas == 3
    assert again.model.source == cfg.model_source()


@pytest.mark.parametrize("environ, message", [
    ({"WARMPATH_REPLICAS__NUM_REPLICAS": "[1"}, "environment variable WARMPATH_REPLICAS__NUM_REPLICAS is not valid YAML"),
    ({"WARMPATH_ROUTER__SCORER_WEIGHTS": "{load: 1"}, "environment variable WARMPATH_ROUTER__SCORER_WEIGHTS is not valid YAML"),
    ({"WARMPATH_PORTS__HTTP_PORT": "a: b: c"}, "environment variable WARMPATH_PORTS__HTTP_PORT is not valid YAML"),
])
def test_bad_environment_variables_are_one_line_config_errors(environ, message):
    with pytest.raises(ConfigError) as err:
        load_config(environ=environ)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_warmpath_variables_that_name_no_config_field_are_not_config():
    """README's `export WARMPATH_KEY=...` and the tests' switches must not break every command."""
    environ = {"WARMPATH_KEY": "wp_x", "WARMPATH_TEST_KEEP_CLUSTER": "1", "WARMPATH_": "1",
               "WARMPATH_REPLICAS__NUM_REPLICAS": "3"}
    assert load_config(environ=environ).replicas.num_replicas == 3
    with pytest.raises(ConfigError) as err:  # the `__` of a nested field: a misspelt section is an error
        load_config(environ={"WARMPATH_REPLICA__NUM_REPLICAS": "3"})
    assert "replica" in str(err.value)


def test_a_file_that_is_not_yaml_is_named_on_one_line(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicas:\n  num_replicas: [1\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad, environ={})
    assert str(err.value).startswith(f"config file {bad} is not valid YAML: ") and "line " in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("data, message", [
    ({"redis_url": "notaurl"}, "redis_url"),
    ({"redis_url": "http://r:6379/0"}, "redis://"),
    ({"redis_url": "redis://r:port/0"}, "port that is not a number"),
    ({"access": {"default_requests_per_s": float("inf")}}, "access.default_requests_per_s"),
    ({"access": {"default_requests_per_s": float("nan")}}, "access.default_requests_per_s"),
])
def test_values_the_key_store_cannot_use_are_config_errors(data, message):
    with pytest.raises(ConfigError) as err:
        load_config(environ={}, overrides=data)
    assert message in str(err.value)


@pytest.mark.parametrize("url", [
    "redis://r:6379/0", "rediss://u:p@r:6380/1", "unix:///run/redis.sock", "redis://r:6379", "redis://r:6379/",
    "redis://r:6379/15", "unix:///run/redis.sock?db=2", "redis://r:6379/0?socket_timeout=2.5&health_check_interval=10",
])
def test_redis_urls_the_client_accepts_are_kept(url):
    assert load_config(environ={}, overrides={"redis_url": url}).redis_url == url


@pytest.mark.parametrize("url", ["", "  "])
def test_an_empty_redis_url_is_unset(url):
    """`REDIS_URL=` started a local Redis (empty counted as unset there) but deployed the app with no URL, whose
    ingress and orchestrator then failed to start."""
    assert load_config(environ={}, overrides={"redis_url": url}).redis_url is None
    assert load_config(environ={"REDIS_URL": url}).redis_url is None


@pytest.mark.parametrize("url, problem", [
    ("redis://r:6379/abc", "names database 'abc'; it must be a number from 0 to 15"),  # redis-py: silently db 0
    ("redis://r:6379/16", "names database '16'"),  # Redis: "DB index is out of range" on every call
    ("redis://r:6379/1/2", "names database '1/2'"),  # redis-py: db 12
    ("redis://r:6379/-1", "names database '-1'"),
    ("redis://r:6379/0?db=99", "names database '99'"),
    ("unix:///run/redis.sock?db=x", "names database 'x'"),
    ("redis://r:6379/0?socket_timeout=abc",
     "has a query option the Redis client cannot use: Invalid value for 'socket_timeout'"),
    ("redis://r:6379/0?sockettimeout=2", "has a query option the Redis client does not know: 'sockettimeout'"),
    ("redis://r:6379/0?protocol=9", "has a query option the Redis client cannot use: protocol must be either 2 or 3"),
])
def test_redis_urls_the_client_would_misread_or_fail_on_are_refused_naming_why(url, problem):
    with pytest.raises(ValueError) as err:
        check_redis_url(url)
    assert problem in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(environ={}, overrides={"redis_url": url})
    assert f"redis_url: Value error, {problem}" in str(err.value)


def test_every_command_stops_on_an_environment_variable_that_is_not_yaml(monkeypatch):
    from typer.testing import CliRunner

    from cluster.cli import app

    monkeypatch.setenv("WARMPATH_REPLICAS__NUM_REPLICAS", "[1")
    result = CliRunner().invoke(app, ["render", "serve-config"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.output.startswith("environment variable WARMPATH_REPLICAS__NUM_REPLICAS is not valid YAML: ")
    assert len(result.output.strip().splitlines()) == 1


def test_a_cpu_replica_bundle_takes_its_custom_ray_resources_beside_its_cpus():
    from serve_apps.builders import llm_config

    cfg = load_config(environ={}, overrides={"replicas": {"num_cpus": 2, "ray_resources": {"warmpath_replica_slot": 1}}})
    assert llm_config(cfg).placement_group_config == {"bundles": [{"CPU": 2.0, "warmpath_replica_slot": 1.0}]}
    plain = load_config(environ={})
    assert llm_config(plain).placement_group_config == {"bundles": [{"CPU": 1.0}]}



def test_the_prefix_aware_router_gets_arguments_it_accepts_with_the_engines_window():
    from router.adapter import RouterArgs
    from serve_apps.builders import request_router_config

    cfg = load_config(environ={}, overrides={"model": {"max_model_len_tokens": 4096}})
    args = RouterArgs.model_validate(request_router_config(cfg)["request_router_kwargs"])
    assert args.max_model_len_tokens == 4096 and args.block_size_tokens == cfg.replicas.block_size_tokens


def test_a_model_of_ones_own_sets_its_own_window():
    cfg = load_config(environ={}, overrides={"model": {"source": "/models/long", "max_model_len_tokens": 32768}})
    assert cfg.model.max_model_len_tokens == 32768


def test_a_bad_flag_value_is_named_by_its_flag(tmp_path, monkeypatch):
    """`up --replicas 0` was refused as `replicas.num_replicas`, a name the user never typed."""
    from typer.testing import CliRunner

    from cluster.cli import app

    monkeypatch.setenv("WARMPATH_ROUTER__POLICY", "pow3")
    result = CliRunner().invoke(app, ["up", "--replicas", "0", "--http-port", "70000",
                                      "--state-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert "  replicas.num_replicas (set by --replicas): Input should be greater than or equal to 1" in lines
    assert any(line.startswith("  ports.http_port (set by --http-port): ") for line in lines)
    assert any(line.startswith("  router.policy (set by environment variable WARMPATH_ROUTER__POLICY): ")
               for line in lines)


@pytest.mark.parametrize("engine_kwargs, backend", [
    ({}, "xgrammar"),  # warmpath's own setting
    ({"structured_outputs_config": {"backend": "guidance"}}, "guidance"),
    ({"structured_outputs_config": {"disable_any_whitespace": True}}, "auto"),  # replaced whole: vLLM's default
])
def test_the_grammar_backend_is_the_one_the_replicas_start_with(engine_kwargs, backend):
    from serve_apps.builders import engine_kwargs as replica_engine_kwargs

    cfg = load_config(environ={}, overrides={"replicas": {"engine_kwargs": engine_kwargs}})
    assert cfg.replicas.grammar_backend() == backend
    assert replica_engine_kwargs(cfg)["structured_outputs_config"].get("backend", "auto") == backend


def test_the_built_model_keeps_the_hub_offline_as_the_rendered_serve_config_names_it(tmp_path):
    """`render_serve_config` writes the built model's folder as `model.source`: the application built from it
    saw a source and let the replicas look the model up on a hub."""
    from cluster.serve_config import render_serve_config
    from serve_apps.builders import llm_config

    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path)})
    built = Path(cfg.model_source())
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    (built / "manifest.json").write_text("{}")
    rendered = ClusterConfig.model_validate(render_serve_config(cfg)["applications"][0]["args"])
    assert rendered.model.source == str(built)
    assert llm_config(rendered).runtime_env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    hub = load_config(environ={}, overrides={"model": {"source": "Qwen/Qwen2.5-0.5B-Instruct"}})
    assert "HF_HUB_OFFLINE" not in llm_config(hub).runtime_env["env_vars"]
