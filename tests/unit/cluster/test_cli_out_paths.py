"""Commands that write files check the path before any work: a bad one is one line and exit 2."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cluster.cli import app

SIMULATE = ["simulate", "--workload", "fanout", "--sessions", "2", "--replicas", "2", "--policies", "warmpath", "--jobs", "1"]


def _never(*args, **kwargs):
    raise AssertionError("the command did work before checking its output path")


def _bad_file_paths(tmp_path: Path) -> list[tuple[Path, str]]:
    """(path, expected message) pairs that no command can write a file at."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return [
        (tmp_path, "is a directory"),
        (a_file / "x.json", f"{a_file} is not a directory"),
        (a_file / "deeper" / "x.json", f"{a_file} is not a directory"),
    ]


def _assert_refused(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert message in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("case", range(3))
def test_render_serve_config_refuses_a_path_it_cannot_write(tmp_path, case):
    out, message = _bad_file_paths(tmp_path)[case]
    _assert_refused(CliRunner().invoke(app, ["render", "serve-config", "--out", str(out)]), message)


def test_render_serve_config_creates_missing_parent_folders(tmp_path):
    out = tmp_path / "new" / "dir" / "serve.yaml"
    result = CliRunner().invoke(app, ["render", "serve-config", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "import_path" in out.read_text()


def test_render_serve_config_writes_a_file_only_its_owner_reads(tmp_path, monkeypatch):
    """The config holds redis_url with its password; the file was world-readable."""
    monkeypatch.setenv("REDIS_URL", "redis://:s3cret@db.internal:6379/0")
    out = tmp_path / "serve.yaml"
    out.write_text("")
    out.chmod(0o644)
    result = CliRunner().invoke(app, ["render", "serve-config", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "s3cret" in out.read_text() and out.stat().st_mode & 0o777 == 0o600


def test_render_serve_config_to_a_pipe_or_device_leaves_its_mode(tmp_path):
    """Made owner-only as a file is: run as root, `--out /dev/null` closed /dev/null to every other user."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    pipe.chmod(0o666)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    try:
        result = CliRunner().invoke(app, ["render", "serve-config", "--out", str(pipe)])
        assert result.exit_code == 0, result.output
        assert b"import_path" in os.read(reader, 1 << 20)
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(pipe.stat().st_mode) and stat.S_IMODE(pipe.stat().st_mode) == 0o666


def test_render_serve_config_that_fails_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    """Written in place, a full disk left a file cut short that still parsed as YAML, ready to be deployed."""
    from cluster import local

    out = tmp_path / "serve.yaml"
    assert CliRunner().invoke(app, ["render", "serve-config", "--out", str(out)]).exit_code == 0
    before = out.read_text()

    def fill_the_disk(file, text):
        Path(file).write_text(text[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local, "write_private", fill_the_disk)
    result = CliRunner().invoke(app, ["render", "serve-config", "--out", str(out)])
    assert result.exit_code == 1 and "No space left on device" in result.output
    assert out.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["serve.yaml"]


@pytest.mark.parametrize("case", range(3))
def test_simulate_refuses_a_bad_out_before_simulating(tmp_path, monkeypatch, case):
    from bench import simulator

    monkeypatch.setattr(simulator, "run_grid", _never)
    out, message = _bad_file_paths(tmp_path)[case]
    _assert_refused(CliRunner().invoke(app, [*SIMULATE, "--out", str(out)]), message)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_simulate_refuses_a_folder_where_files_cannot_be_created(monkeypatch):
    from bench import simulator

    monkeypatch.setattr(simulator, "run_grid", _never)
    _assert_refused(CliRunner().invoke(app, [*SIMULATE, "--out", "/proc/warmpath-x.json"]), "cannot be written")


def test_simulate_probe_leaves_no_file_behind_and_keeps_an_existing_one(tmp_path, monkeypatch):
    from bench import simulator

    def refuse_after_check(*args, **kwargs):
        raise SystemExit(3)

    monkeypatch.setattr(simulator, "run_grid", refuse_after_check)
    new = tmp_path / "new.json"
    CliRunner().invoke(app, [*SIMULATE, "--out", str(new)])
    assert not new.exists()
    old = tmp_path / "old.json"
    old.write_text("keep")
    CliRunner().invoke(app, [*SIMULATE, "--out", str(old)])
    assert old.read_text() == "keep"


def test_simulate_that_cannot_write_at_the_end_prints_the_results_and_one_error_line(tmp_path, monkeypatch):
    from bench import report

    def fail(path, document):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(report, "write_json", fail)
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [*SIMULATE, "--out", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"error: cannot write {out} (Permission denied)" in result.output
    assert "warmpath" in result.output.split("error:")[0]  # the report came first


@pytest.mark.parametrize("case", range(2))
def test_bench_refuses_a_bad_out_before_running(tmp_path, monkeypatch, case):
    from bench import live

    monkeypatch.setattr(live, "run_bench", _never)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    taken = tmp_path / "taken"
    (taken / "bench-fanout.json").mkdir(parents=True)  # a folder where the results file goes
    out, message = [(a_file, "is not a directory"), (taken, "is a directory")][case]
    _assert_refused(CliRunner().invoke(app, ["bench", "--workload", "fanout", "--out", str(out)]), message)


def test_chaos_refuses_a_bad_out_before_breaking_anything(tmp_path, monkeypatch):
    from bench import chaos

    monkeypatch.setattr(chaos, "run_chaos", _never)
    _assert_refused(CliRunner().invoke(app, ["chaos", "--out", str(tmp_path)]), "is a directory")


def test_build_model_refuses_an_out_that_is_a_file(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    _assert_refused(CliRunner().invoke(app, ["build-model", "--out", str(a_file)]), "is not a directory")


def test_build_model_refuses_to_write_random_weights_where_a_hugging_face_id_points(tmp_path, monkeypatch):
    """Read as a folder, `Qwen/Qwen2.5-7B-Instruct` got the small random-weight model under ./Qwen/..."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WARMPATH_MODEL__SOURCE", "Qwen/Qwen2.5-7B-Instruct")
    _assert_refused(CliRunner().invoke(app, ["build-model"]), "names a Hugging Face model")
    assert not (tmp_path / "Qwen").exists()


def _users_model(folder):
    folder.mkdir()
    for name, text in (("config.json", '{"model_type": "qwen2"}'), ("generation_config.json", "{}"),
                       ("model.safetensors", "weights")):
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("how", ["--out", "model.source"])
def test_build_model_refuses_to_overwrite_a_model_folder_it_did_not_write(tmp_path, monkeypatch, how):
    """A GPU config's `model.source: /models/qwen` got random weights, a Llama config and no generation config."""
    models = _users_model(tmp_path / "qwen")
    args = ["build-model", "--out", str(models)] if how == "--out" else ["build-model"]
    if how == "model.source":
        monkeypatch.setenv("WARMPATH_MODEL__SOURCE", str(models))
    _assert_refused(CliRunner().invoke(app, args), "holds files that no warmpath build wrote")
    assert (models / "config.json").read_text() == '{"model_type": "qwen2"}'
    assert (models / "generation_config.json").is_file()


def test_build_model_rewrites_its_own_folders_and_any_with_force(tmp_path):
    from cluster.model_builder import BUILD_MARKER, is_rebuildable

    assert is_rebuildable(tmp_path / "missing") and is_rebuildable(tmp_path)
    stopped = tmp_path / "stopped"  # a build interrupted before its manifest
    stopped.mkdir()
    (stopped / BUILD_MARKER).write_text("")
    (stopped / "tokenizer.json").write_text("{}")
    earlier = tmp_path / "earlier"  # a build from before the marker
    earlier.mkdir()
    (earlier / "manifest.json").write_text('{"seed": 0, "shape": {}, "files": {}}')
    (earlier / "config.json").write_text("{}")
    assert is_rebuildable(stopped) and is_rebuildable(earlier)
    assert not is_rebuildable(_users_model(tmp_path / "qwen"))
    (tmp_path / "a-file").write_text("x")
    assert not is_rebuildable(tmp_path / "a-file")


def test_simulate_still_writes_its_results(tmp_path):
    out = tmp_path / "deep" / "sim.json"
    result = CliRunner().invoke(app, [*SIMULATE, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["kind"] == "warmpath-simulate"
