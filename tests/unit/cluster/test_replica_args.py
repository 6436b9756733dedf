"""The replicas' vLLM arguments, checked by `up` against the vLLM installed here before it starts anything."""
from __future__ import annotations

import builtins
import json

import pytest
from typer.testing import CliRunner

from cluster import local
from cluster.cli import app
from cluster.config import load_config
from cluster.replica_args import replica_args_problems


def _config(**sections):
    return load_config(environ={}, overrides=sections)


def test_arguments_of_the_engine_and_of_the_frontend_pass():
    cfg = _config(replicas={"engine_kwargs": {"max_num_seqs": 4, "enforce_eager": True,
                                              "chat_template_content_format": "string"}})
    assert replica_args_problems(cfg) == []


def test_a_misspelt_argument_and_parser_are_named_with_what_was_meant():
    """Each replica found them as it started, minutes into `up`, in its own log."""
    cfg = _config(model={"tool_call_parser": "hermess"}, replicas={"engine_kwargs": {"max_num_seq": 4}})
    assert replica_args_problems(cfg) == [
        "replicas.engine_kwargs.max_num_seq is no argument of vLLM's engine or OpenAI frontend "
        "(did you mean 'max_num_seqs'?)",
        "model.tool_call_parser 'hermess' is no tool-call parser of this vLLM (did you mean 'hermes'?)",
    ]
    far = replica_args_problems(_config(model={"tool_call_parser": "zzzz"}))
    assert len(far) == 1 and "its parsers: " in far[0] and "hermes" in far[0]


def test_a_parser_plugin_may_name_parsers_of_its_own():
    cfg = _config(model={"tool_call_parser": "my_parser"},
                  replicas={"engine_kwargs": {"tool_parser_plugin": "/opt/parsers/mine.py"}})
    assert replica_args_problems(cfg) == []


def test_without_vllm_here_the_replicas_check_for_themselves(monkeypatch):
    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name.startswith("vllm"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    assert replica_args_problems(_config(replicas={"engine_kwargs": {"max_num_seq": 4}})) == []


def test_up_refuses_bad_replica_arguments_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "up", lambda *args, **kwargs: pytest.fail("up started"))
    config = tmp_path / "cluster.yaml"
    config.write_text("replicas:\n  engine_kwargs:\n    enable_prefix_cachng: true\n")
    result = CliRunner().invoke(app, ["up", "-c", str(config), "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 2, result.output
    assert "replicas.engine_kwargs.enable_prefix_cachng is no argument" in result.stderr


def _model_folder(tmp_path, **config):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, **config}))
    return str(folder)


@pytest.mark.parametrize("config, is_refused", [
    ({}, True),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}, True),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, False),  # vLLM stretches the window
    ({"model_max_length": 131072}, False),  # vLLM's own override (Command R ships it)
])
def test_a_window_over_a_local_models_is_named(tmp_path, config, is_refused):
    """The CPU overlay names its model's folder (not the default empty source, which the config checks): a
    longer window rendered cleanly, and every replica failed as vLLM derived the model's."""
    cfg = _config(model={"source": _model_folder(tmp_path, **config), "max_model_len_tokens": 16384})
    problems = replica_args_problems(cfg)
    assert any("is over the 8192 tokens the model in" in p for p in problems) is is_refused, problems
    assert replica_args_problems(_config(model={"source": str(tmp_path / "model"), "max_model_len_tokens": 8192})) == []


def test_the_renders_warn_of_what_the_replicas_would_refuse(tmp_path):
    """They rendered a misspelt engine argument cleanly; it failed in the RayService. (`up` refuses it.)"""
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model:\n  source: {_model_folder(tmp_path)}\n  max_model_len_tokens: 16384\n"
                      "redis_url: redis://r:6379/0\nreplicas:\n  engine_kwargs: {gpu_memory_utilisation: 0.8}\n")
    result = CliRunner().invoke(app, ["render", "serve-config", "-c", str(config)])
    assert result.exit_code == 0, result.output
    assert "warning: replicas.engine_kwargs.gpu_memory_utilisation is no argument" in result.stderr
    assert "warning: model.max_model_len_tokens 16384 is over the 8192 tokens" in result.stderr


def test_a_number_where_vllm_takes_text_is_named():
    """`revision: 20240101` (YAML's number, from the file or a variable) reached vLLM's hub lookup as an int."""
    cfg = _config(replicas={"engine_kwargs": {"revision": 20240101, "tokenizer_revision": "v2", "max_num_seqs": 4}})
    assert replica_args_problems(cfg) == [
        "replicas.engine_kwargs.revision is text to vLLM, not the int 20240101: quote it (revision: \"20240101\")"]
