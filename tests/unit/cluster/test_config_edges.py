"""The cluster config refuses at the edge, in one line, what would fail later inside a deployment (or
leak a secret), and accepts what vLLM and Ray accept; environment variables set one key of a mapping."""

from __future__ import annotations

import os
import re

import pytest

from cluster import k8s_render
from cluster.config import ConfigError, load_config, without_password
from serve_apps.builders import engine_kwargs


def _load(environ=None, **overrides):
    return load_config(environ=environ or {}, overrides=overrides)


def test_one_scorer_weight_from_the_environment_keeps_the_others():
    cfg = _load({"WARMPATH_ROUTER__SCORER_WEIGHTS__LOAD": "3"})
    assert cfg.router.scorer_weights == {"prefix-cache": 1.0, "load": 3.0, "session-affinity": 1.0,
                                         "session-balance": 1.0}


def test_a_scorer_weight_from_the_environment_is_written_with_underscores(tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text("router:\n  scorer_weights: {load: 2}\n")  # the file's mapping is whole: others off
    cfg = load_config(config, environ={"WARMPATH_ROUTER__SCORER_WEIGHTS__PREFIX_CACHE": "4"})
    assert cfg.router.scorer_weights == {"load": 2.0, "prefix-cache": 4.0}


def test_a_mapping_set_whole_by_the_environment_replaces_the_default_and_the_files(tmp_path):
    """Merged key by key, `{load: 1}` kept the other scorers on (README: missing scorers are off), and `{}` could
    not take the file's engine arguments out."""
    assert _load({"WARMPATH_ROUTER__SCORER_WEIGHTS": "{load: 1}"}).router.scorer_weights == {"load": 1.0}
    config = tmp_path / "cluster.yaml"
    config.write_text("replicas:\n  engine_kwargs: {enforce_eager: false}\n")
    assert load_config(config, environ={"WARMPATH_REPLICAS__ENGINE_KWARGS": "{}"}).replicas.engine_kwargs == {}
    both = {"WARMPATH_ROUTER__SCORER_WEIGHTS": "{load: 1}", "WARMPATH_ROUTER__SCORER_WEIGHTS__PREFIX_CACHE": "2"}
    assert _load(both).router.scorer_weights == {"load": 1.0, "prefix-cache": 2.0}
    # Within a section a variable sets whole, too; and a later section variable that drops the mapping crashed.
    assert _load({"WARMPATH_ROUTER": "{scorer_weights: {load: 1}}"}).router.scorer_weights == {"load": 1.0}
    later = {"WARMPATH_ROUTER__SCORER_WEIGHTS": "{load: 1}", "WARMPATH_ROUTER": "{policy: pow2}"}
    assert _load(later).router.policy == "pow2"


@pytest.mark.parametrize("raw, value", [
    ("/srv/templates/tool use #2.jinja", "/srv/templates/tool use #2.jinja"),  # YAML cut it at ` #`
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "{% for m in messages %}{{ m.content }}{% endfor %}"),
    ("0.8", 0.8), ("true", True), ("{a: 1}", {"a": 1}),
    ("'1.0'", "1.0"),  # quoted: the text YAML says, not the quotes
])
def test_an_engine_argument_from_the_environment_is_typed_or_taken_as_written(raw, value):
    cfg = _load({"WARMPATH_REPLICAS__ENGINE_KWARGS__CHAT_TEMPLATE": raw})
    assert cfg.replicas.engine_kwargs["chat_template"] == value


def test_an_unknown_scorer_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown scorers \['prefix_cach'\]; known: \['load', 'prefix-cache'"):
        _load(router={"scorer_weights": {"prefix_cach": 1.0}})


@pytest.mark.parametrize("name, owner", [("max_model_len", "model.max_model_len_tokens"),
                                         ("tool_call_parser", "model.tool_call_parser")])
def test_engine_kwargs_may_not_override_what_the_model_section_owns(name, owner):
    with pytest.raises(ConfigError, match=rf"may not set \['{name}'\]: set {owner}"):
        _load(replicas={"engine_kwargs": {name: 2048 if name == "max_model_len" else "llama3_json"}})


def test_nested_engine_kwargs_pass_through_unchanged():
    nested = {
        "hf_overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
        "limit_mm_per_prompt": {"image": {"count": 2}},
        "compilation_config": {"pass_config": {"enable_fusion": False}, "cudagraph_capture_sizes": [1, 2, 4]},
    }
    cfg = _load(replicas={"engine_kwargs": nested})
    assert {name: engine_kwargs(cfg)[name] for name in nested} == nested


def test_a_request_size_grpc_cannot_take_is_refused():
    with pytest.raises(ConfigError, match="access.max_request_bytes"):
        _load(access={"max_request_bytes": 3 * 1024**3})
    assert _load(access={"max_request_bytes": 2**31 - 1}).access.max_request_bytes == 2**31 - 1


def test_the_session_quota_per_key_is_at_least_one_or_none():
    assert _load().access.max_sessions_per_key == 1000
    assert _load(access={"max_sessions_per_key": None}).access.max_sessions_per_key is None
    with pytest.raises(ConfigError, match="access.max_sessions_per_key"):
        _load(access={"max_sessions_per_key": 0})


@pytest.mark.parametrize("environ", [{"WARMPATH_TELEMETRY__OTLP_ENDPOINT": ""}, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}])
def test_an_empty_otlp_endpoint_is_off_everywhere(environ):
    assert _load(environ).telemetry.otlp_endpoint is None


def test_an_otlp_endpoint_without_a_scheme_is_refused():
    with pytest.raises(ConfigError, match=r"telemetry.otlp_endpoint: .*http:// or https:// URL"):
        _load(telemetry={"otlp_endpoint": "collector:4318"})


@pytest.mark.parametrize("endpoint", ["http://collector:99999", "http://collector:43l8"])
def test_an_otlp_endpoint_whose_port_is_no_port_is_refused(endpoint):
    """It loaded, and every export failed once tracing was on (`is not a valid host or port`)."""
    with pytest.raises(ConfigError, match=r"telemetry.otlp_endpoint: .*not a number from 0 to 65535"):
        _load(telemetry={"otlp_endpoint": endpoint})


def test_a_telemetry_section_set_whole_by_the_environment_is_a_config_error_not_a_crash():
    with pytest.raises(ConfigError, match="telemetry"):
        _load({"WARMPATH_TELEMETRY": "off", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})


@pytest.mark.parametrize("ports, match", [
    ({"metrics_export_port": 8000}, "ports.http_port and ports.metrics_export_port are both 8000"),
    ({"http_port": 8265}, "ports.http_port is 8265, which a Ray head takes"),
    ({"local_redis_port": 6379}, "ports.local_redis_port is 6379, which a Ray head takes"),
    ({"local_redis_port": 9000}, "ports.grpc_port and ports.local_redis_port are both 9000"),
    ({"http_port": 10001}, "ports.http_port is 10001, which a Ray head takes \\(its client server\\)"),
    ({"metrics_export_port": 52365}, "ports.metrics_export_port is 52365, which a Ray head takes"),
])
def test_ports_two_listeners_would_share_are_refused(ports, match):
    with pytest.raises(ConfigError, match=match):
        _load(ports=ports)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "127.0.0.1", "::1", "localhost", "node-1.cluster.local"])
def test_a_bare_address_or_name_is_a_proxy_host(host):
    assert _load(ports={"host": host}).ports.host == host


@pytest.mark.parametrize("host", ["[::]", "http://0.0.0.0", "0.0.0.0:8000", "10.0.0.300", "", "my host", "-node"])
def test_a_proxy_host_that_is_no_address_or_name_is_refused(host):
    with pytest.raises(ConfigError, match=r"ports.host: .*is not an IP address or host name"):
        _load(ports={"host": host})


def test_a_problem_set_by_the_environment_names_its_variable():
    with pytest.raises(ConfigError) as err:
        _load({"WARMPATH_PORTS__HTTP_PORT": "eighty", "REDIS_URL": "http://cache:6379",
               "WARMPATH_ROUTER": "fast", "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"})
    lines = str(err.value).splitlines()[1:]
    assert any(line.startswith("  ports.http_port (set by environment variable WARMPATH_PORTS__HTTP_PORT): ")
               for line in lines)
    assert any(line.startswith("  redis_url (set by environment variable REDIS_URL): ") for line in lines)
    assert any(line.startswith("  router (set by environment variable WARMPATH_ROUTER): ") for line in lines)
    assert any(line.startswith("  telemetry.otlp_endpoint (set by environment variable OTEL_EXPORTER_OTLP_ENDPOINT)")
               for line in lines)


def test_a_misspelt_section_names_the_variable_that_set_a_field_in_it():
    with pytest.raises(ConfigError) as err:
        _load({"WARMPATH_REPLICA__NUM_REPLICAS": "2"})
    assert "replica (set by environment variable WARMPATH_REPLICA__NUM_REPLICAS): " in str(err.value)


@pytest.mark.parametrize("num_cpus", ["inf", "nan", "1e300"])
def test_a_replicas_cpus_must_be_a_finite_count_ray_can_take(num_cpus):
    """`inf` passed, and `up` then failed with an OverflowError traceback after starting Redis."""
    with pytest.raises(ConfigError, match="replicas.num_cpus"):
        _load({"WARMPATH_REPLICAS__NUM_CPUS": num_cpus})


def test_a_problem_a_flag_set_over_the_environment_names_no_variable():
    with pytest.raises(ConfigError) as err:
        _load({"WARMPATH_PORTS__HTTP_PORT": "8001"}, ports={"http_port": "eighty"})
    assert "  ports.http_port: Input should be a valid integer" in str(err.value)
    assert "WARMPATH_PORTS__HTTP_PORT" not in str(err.value)


@pytest.mark.parametrize("overrides, where", [({"app_name": ""}, "app_name"),
                                              ({"model": {"model_id": "org/model#2"}}, "model.model_id")])
def test_names_ray_serve_refuses_are_refused_here(overrides, where):
    with pytest.raises(ConfigError, match=where):
        _load(**overrides)


def test_an_overlay_redis_url_with_a_password_option_is_refused(tmp_path):
    (tmp_path / "cluster.yaml").write_text(
        "model: {source: /models/m}\nredis_url: redis://warmpath-redis:6379/1?password=hunter2\n"
    )
    with pytest.raises(ConfigError, match="redis_url carries a password"):
        k8s_render.load_overlay_config(tmp_path)


@pytest.mark.parametrize("setting, message", [
    ("replicas: {engine_kwargs: {hf_token: hf_S3CRET}}", "hf_token"),
    ("telemetry: {otlp_endpoint: 'https://user:S3CRET@otel.example:4318'}", "otlp_endpoint carries a password"),
])
def test_an_overlay_credential_is_refused_not_written_into_the_rayservice(tmp_path, setting, message):
    """Rendered whole into serveConfigV2 (and the pods' environment), readable by anyone who can read it."""
    (tmp_path / "cluster.yaml").write_text(f"model: {{source: /models/m}}\n{setting}\n")
    with pytest.raises(ConfigError, match=message) as refused:
        k8s_render.load_overlay_config(tmp_path)
    assert "S3CRET" not in str(refused.value)


@pytest.mark.parametrize("source", ["~/models/my-llama", "./models/my-llama", "../my-llama"])
def test_a_local_model_path_reaches_the_engines_absolute(source, monkeypatch, tmp_path):
    """The engines run in Ray's workers: another working directory, and no shell to expand `~`."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    resolved = _load(model={"source": source}).model_source()
    assert os.path.isabs(resolved) and "~" not in resolved and ".." not in resolved.split(os.sep)
    assert _load(model={"source": "Qwen/Qwen2.5-0.5B"}).model_source() == "Qwen/Qwen2.5-0.5B"  # a hub id as is


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    file = tmp_path / "latin1.yaml"
    file.write_bytes("model:\n  model_id: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(str(file), environ={})


def test_an_empty_state_dir_is_refused_not_taken_as_the_working_directory():
    with pytest.raises(ConfigError, match="state_dir"):
        _load(state_dir="")


def test_a_redis_password_stays_out_of_config_errors():
    with pytest.raises(ConfigError) as refused:
        _load(redis_url="redis://:S3cretPass@127.0.0.1:99999/0")
    assert "S3cretPass" not in str(refused.value) and "0 to 65535" in str(refused.value)


@pytest.mark.parametrize("password", ["my#S3cret", "my/S3cret", "my?S3cret"])
def test_a_redis_password_written_unencoded_stays_out_of_config_errors_which_say_to_encode_it(password):
    """A URL parser ends the address at `#`, `/` or `?`, before the `@`: no password was found to mask, and
    the URL was printed whole, as a port that is no number."""
    with pytest.raises(ConfigError) as refused:
        _load(redis_url=f"redis://:{password}@redis.internal:6379/0")
    said = str(refused.value)
    assert "S3cret" not in said and "redis://:***@redis.internal:6379/0" in said
    assert "must be percent-encoded" in said


@pytest.mark.parametrize("url, shown", [
    ("redis://user:p@ss#w/rd@h:1/0", "redis://user:***@h:1/0"),
    ("redis://token@h:1", "redis://***@h:1"),  # a user part without `:` is masked whole: it may be the secret
    ("redis://h:1/0?password=x&db=1", "redis://h:1/0?password=***&db=1"),
    ("unix:///run/redis.sock?db=2", "unix:///run/redis.sock?db=2"),
    # An `@` in the query is no end of a user part: the password after it was printed.
    ("redis://10.0.0.5:6379/0?password=hunter2@Secr3tTail", "redis://10.0.0.5:6379/0?password=***"),
    ("unix:///run/redis.sock?password=pa@ss", "unix:///run/redis.sock?password=***"),
    ("redis://10.0.0.5:6379/0?client_name=a@b", "redis://10.0.0.5:6379/0?client_name=a@b"),
    ("redis://:a=b@h:1", "redis://:***@h:1"),
])
def test_messages_show_redis_urls_as_written_less_their_secrets(url, shown):
    assert without_password(url) == shown


@pytest.mark.parametrize("variable, raw, field, value", [
    ("WARMPATH_STATE_DIR", "/tmp/my dir #2", "state_dir", "/tmp/my dir #2"),  # YAML read ` #2` as a comment
    ("WARMPATH_STATE_DIR", "off", "state_dir", "off"),  # and `off` as false
    ("WARMPATH_APP_NAME", "2024", "app_name", "2024"),
    ("WARMPATH_REDIS_URL", "null", "redis_url", None),  # an optional text field may still be unset
])
def test_a_text_field_from_the_environment_is_taken_as_written(variable, raw, field, value):
    assert getattr(_load({variable: raw}), field) == value


def test_a_number_from_the_environment_is_still_read_as_yaml():
    assert _load({"WARMPATH_REPLICAS__NUM_REPLICAS": "3"}).replicas.num_replicas == 3


def test_a_sections_own_check_does_not_blame_a_variable_that_set_another_field(tmp_path):
    """`ports.http_port` 8080 in the file clashes with the metrics port; the variable that set the gRPC port
    was named as having set the section ("set by environment variable WARMPATH_PORTS__GRPC_PORT")."""
    config = tmp_path / "cluster.yaml"
    config.write_text("ports:\n  http_port: 8080\n")
    with pytest.raises(ConfigError) as err:
        load_config(config, environ={"WARMPATH_PORTS__GRPC_PORT": "9001"})
    line = str(err.value).splitlines()[1]
    assert line.startswith("  ports (holding values set by environment variable WARMPATH_PORTS__GRPC_PORT): ")
    assert "both 8080" in line


@pytest.mark.parametrize("overrides, message", [
    ({"router": {"scorer_weights": {"load": True}}}, "load: a boolean, not a number"),  # YAML's `yes`
    ({"replicas": {"ray_resources": {"slot": True}}}, "slot: a boolean, not a number"),
    ({"model": {"source": "s3://bucket/models/qwen"}}, "a local folder or a Hugging Face id, not a URL"),
    ({"app_name": "a#b"}, "app_name"),  # '#' separates a replica's id: Ray's controller cannot read it back
    ({"replicas": {"cpu_omp_threads_bind": "no-bind"}}, "'auto', 'nobind', or core lists"),
    ({"replicas": {"cpu_omp_threads_bind": "0-3|4-7"}}, "names 2 core lists; each replica runs 1 engine workers"),
    ({"replicas": {"engine_kwargs": {"disable_log_stats": True}}}, "report KV cache use"),
    ({"replicas": {"engine_kwargs": {"api_key": "sk-vllm"}}}, "vLLM's own HTTP server"),
    # vLLM's server options: no TLS, and Ray's proxy allows every origin, whatever these say.
    ({"replicas": {"engine_kwargs": {"ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem"}}},
     "['ssl_certfile', 'ssl_keyfile']: options of vLLM's own HTTP server"),
    ({"replicas": {"engine_kwargs": {"allowed_origins": ["https://app.example"]}}}, "would do nothing"),
    # On CPU too: the replicas failed as they started.
    ({"replicas": {"engine_kwargs": {"pipeline_parallel_size": 0}}}, "pipeline_parallel_size must be a whole"),
    ({"replicas": {"engine_kwargs": {"pipeline_parallel_size": "2"}}}, "pipeline_parallel_size must be a whole"),
    # gRPC clients name the application in metadata, which takes printable ASCII only.
    ({"app_name": "wärmpath"}, "app_name"),
    ({"app_name": "warm\npath"}, "app_name"),
    ({"replicas": {"engine_kwargs": {"gpu_memory_utilization": float("nan")}}}, "NaN or infinity"),
    ({"replicas": {"engine_kwargs": {"hf_overrides": {"rope_theta": float("inf")}}}}, "NaN or infinity"),
    # Events of blocks of block_size x 2: the router skipped every one, blind to every replica.
    ({"replicas": {"engine_kwargs": {"decode_context_parallel_size": 2}}}, "context parallelism"),
    ({"replicas": {"engine_kwargs": {"prefill_context_parallel_size": 2}}}, "context parallelism"),
])
def test_values_that_would_fail_at_deploy_time_are_refused_here(overrides, message):
    """Each rendered and deployed, then failed in Ray or vLLM minutes later (or was silently ignored)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        _load(**overrides)


@pytest.mark.parametrize("overrides, message", [
    # Every total rounds to one tier (the picker's ties are 1e-9 apart): decisions at random.
    ({"router": {"scorer_weights": {"prefix-cache": 1e-10}}}, "must be 0 (off) or at least 1e-06"),
    # A session holding two blocks more than an idle replica stayed through 97 requests over the limit.
    ({"router": {"load_guard_tokens_per_excess_request": 1e-9}}, "greater than or equal to 1"),
])
def test_router_settings_that_would_switch_the_policy_off_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _load(**overrides)


@pytest.mark.parametrize("bind", ["auto", "nobind", "0-15", "0,2,4-7", "0-15|16-31", "0-3, 8-11", " 0-7", "0-3 | 4-7"])
def test_vllms_thread_binds_are_taken(bind):
    replicas = {"cpu_omp_threads_bind": bind, "tensor_parallel_size": bind.count("|") + 1, "num_replicas": 1}
    assert _load(replicas=replicas).replicas.cpu_omp_threads_bind == bind


def test_core_lists_for_several_replicas_need_a_node_each():
    """vLLM reads the lists by a worker's rank within its engine, and every replica's engine is its own: two
    replicas on one host both ran on cores 0-3 and left the rest idle."""
    with pytest.raises(ConfigError, match="would pin all 2 replicas to the same cores"):
        _load(replicas={"cpu_omp_threads_bind": "0-3", "num_replicas": 2})
    slotted = {"cpu_omp_threads_bind": "0-3", "num_replicas": 2, "ray_resources": {"warmpath_replica_slot": 1}}
    assert _load(replicas=slotted).replicas.cpu_omp_threads_bind == "0-3"
    assert _load(replicas={"cpu_omp_threads_bind": "nobind", "num_replicas": 4}).replicas.num_replicas == 4


def test_merge_keys_nested_and_overridden_are_no_duplicates(tmp_path):
    """A mapping merging another and overriding one of its keys, itself merged above: PyYAML flattens it where it
    is merged, before it is built, and the check read the merged key and the override as one key twice."""
    config = tmp_path / "cluster.yaml"
    config.write_text("replicas:\n  engine_kwargs:\n    hf_overrides:\n"
                      "      base: &base {rope_theta: 10000.0, tie_word_embeddings: false}\n"
                      "      long: &long {<<: *base, rope_theta: 1000000.0}\n"
                      "    override_generation_config: {<<: *long, temperature: 0.7}\n")
    assert load_config(config, environ={}).replicas.engine_kwargs["override_generation_config"] == {
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "temperature": 0.7}


def test_a_duplicate_key_in_the_config_file_is_refused_naming_its_line(tmp_path):
    """The second `replicas:` replaced the first: `num_replicas: 3` silently became the default 2."""
    config = tmp_path / "cluster.yaml"
    config.write_text("replicas:\n  num_replicas: 3\nrouter:\n  policy: pow2\nreplicas:\n  accelerator: cpu\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'replicas' at line 5, column 1"):
        load_config(config, environ={})


@pytest.mark.parametrize("text", ["false\n", "0\n", "[]\n", "''\n"])
def test_a_config_file_that_is_no_mapping_is_refused_not_read_as_the_defaults(tmp_path, text):
    file = tmp_path / "cluster.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError, match="must hold a mapping at the top level"):
        load_config(file, environ={})


def test_an_empty_config_file_and_a_section_with_every_line_commented_out_are_the_defaults(tmp_path):
    """`replicas:` above commented-out settings reads as null: it was refused as no mapping, though the same
    file loaded once any WARMPATH_REPLICAS__* variable was set."""
    file = tmp_path / "cluster.yaml"
    file.write_text("# nothing yet\n")
    assert load_config(file, environ={}) == load_config(environ={})
    file.write_text("replicas:\n  # num_replicas: 4\nrouter:\n  policy: pow2\n")
    cfg = load_config(file, environ={})
    assert cfg.replicas == load_config(environ={}).replicas and cfg.router.policy == "pow2"


def test_a_config_read_from_a_pipe_loads(tmp_path):
    """`--config <(render ...)`: a pipe is no regular file, and was refused as not found."""
    import os
    import threading

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_text("router:\n  policy: pow2\n"))
    writer.start()
    try:
        assert load_config(pipe, environ={}).router.policy == "pow2"
    finally:
        writer.join(10)


def test_a_config_file_in_a_folder_this_user_cannot_enter_is_one_line(tmp_path, as_unprivileged):
    closed = tmp_path / "closed"
    closed.mkdir()
    (closed / "cluster.yaml").write_text("{}\n")
    closed.chmod(0)

    def check():
        with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
            load_config(closed / "cluster.yaml", environ={})

    try:
        as_unprivileged(check)
    finally:
        closed.chmod(0o700)


def test_a_section_field_variable_written_with_one_underscore_is_refused_not_ignored():
    """`WARMPATH_REPLICAS_NUM_REPLICAS=7` deployed the default two replicas, saying nothing."""
    with pytest.raises(ConfigError, match=re.escape(
            "WARMPATH_REPLICAS_NUM_REPLICAS names no setting: a field of the replicas section takes two underscores "
            "after it (WARMPATH_REPLICAS__NUM_REPLICAS)")):
        _load({"WARMPATH_REPLICAS_NUM_REPLICAS": "7"})
    with pytest.raises(ConfigError, match="WARMPATH_TOOL_NETWORK__ALLOW"):
        _load({"WARMPATH_TOOL_NETWORK_ALLOW": "x"})
    assert _load({"WARMPATH_VENV": ".venv", "WARMPATH_KEY": "wp_x"}).replicas.num_replicas == 2  # the shell's own


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_an_otlp_endpoint_from_a_shell_set_up_for_another_protocol_is_not_taken(variable):
    """A shell set up for a gRPC collector: every span went over OTLP/HTTP to its gRPC port, and was lost. Not
    refused either: `down`, `status` and `keys` must still work in that shell."""
    cfg = _load({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", variable: "grpc"})
    assert cfg.telemetry.otlp_endpoint is None
    cfg = _load({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", variable: "http/protobuf"})
    assert cfg.telemetry.otlp_endpoint == "http://collector:4318"
    cfg = _load({"WARMPATH_TELEMETRY__OTLP_ENDPOINT": "http://collector:4318", variable: "grpc"})
    assert cfg.telemetry.otlp_endpoint == "http://collector:4318"  # the config's own word
