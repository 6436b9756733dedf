"""`warmpath simulate` on a tiny grid: the chosen policies run, and a bad name exits 2 with a message."""

from __future__ import annotations

import json

import pytest

from typer.testing import CliRunner

from cluster.cli import app


def test_simulate_runs_only_the_chosen_policies(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["simulate", "--workload", "fanout", "--sessions", "3", "--replicas", "2",
                                      "--policies", "warmpath, pow2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["workload"], r["num_replicas"], r["policy"]) for r in runs] == [
        ("fanout", 2, "warmpath"), ("fanout", 2, "pow2")
    ]
    assert runs[0]["bounds"] is not None and runs[1]["bounds"] is None  # warmpath's run carries the oracle


def test_simulate_refuses_an_unknown_policy(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["simulate", "--policies", "warmpath,fastest", "--out", str(out)])
    assert result.exit_code == 2
    assert "fastest" in result.output
    assert not out.exists()


def test_simulate_names_every_bad_choice_and_the_valid_ones(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, ["simulate", "--workload", "chess", "--policies", "fastest", "--out", str(out)])
    assert result.exit_code == 2
    assert "unknown workload chess (choose shared-tools, coding, fanout or all)" in result.output
    assert "unknown policy fastest (choose from warmpath, pow2" in result.output
    result = CliRunner().invoke(app, ["simulate", "--policies", " , ", "--out", str(out)])
    assert result.exit_code == 2 and "no policy given" in result.output
    assert not out.exists()


SIMULATE = ["simulate", "--workload", "fanout", "--sessions", "3", "--jobs", "1"]


def test_simulate_runs_a_policy_or_replica_count_named_twice_once(tmp_path):
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [*SIMULATE, "--replicas", "2", "--replicas", "3", "--replicas", "2",
                                      "--policies", "pow2,round-robin,pow2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["num_replicas"], r["policy"]) for r in runs] == [
        (2, "pow2"), (2, "round-robin"), (3, "pow2"), (3, "round-robin")
    ]


@pytest.mark.parametrize("count", ["4097", "100000000", "99999999999999999999", "0"])
def test_simulate_refuses_a_replica_count_out_of_range(tmp_path, monkeypatch, count):
    from bench import simulator

    def never(*args, **kwargs):
        raise AssertionError("simulated with a replica count out of range")

    monkeypatch.setattr(simulator, "run_grid", never)
    result = CliRunner().invoke(app, [*SIMULATE, "--replicas", count, "--out", str(tmp_path / "sim.json")])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip() == f"--replicas must be between 1 and 4096, got {count}"


def _failing_cell(monkeypatch, fail_policy: str, error: BaseException) -> None:
    """Makes the cells of `fail_policy` raise `error`; the others run for real."""
    from bench import simulator

    real = simulator.run_cell

    def run_cell(cell, *args, **kwargs):
        if cell.policy == fail_policy:
            raise error
        return real(cell, *args, **kwargs)

    monkeypatch.setattr(simulator, "run_cell", run_cell)


def test_simulate_keeps_the_cells_that_finished_when_one_fails(tmp_path, monkeypatch):
    _failing_cell(monkeypatch, "pow2", MemoryError())
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [*SIMULATE, "--replicas", "2", "--policies", "pow2,warmpath,round-robin",
                                      "--out", str(out)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "FAILED: MemoryError" in result.output
    assert "(ratio to warmpath, value in parentheses)" in result.output  # the baseline failed
    assert "error: 1 failed: fanout x2 pow2: MemoryError" in result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["error"]) for r in runs] == [("pow2", "MemoryError"), ("warmpath", None),
                                                         ("round-robin", None)]
    assert runs[1]["summary"]["hit_rate"] is not None and runs[0]["summary"] is None


def test_simulate_interrupted_writes_the_cells_that_finished_and_exits_130(tmp_path, monkeypatch):
    _failing_cell(monkeypatch, "round-robin", KeyboardInterrupt())
    out = tmp_path / "sim.json"
    result = CliRunner().invoke(app, [*SIMULATE, "--replicas", "2", "--policies", "pow2,round-robin,warmpath",
                                      "--out", str(out)])
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output.splitlines()[-1]
    document = json.loads(out.read_text())
    assert [r["policy"] for r in document["runs"]] == ["pow2"] and document["interrupted"] is True


def test_simulate_keeps_each_finished_cell_on_disk_as_the_grid_goes(tmp_path, monkeypatch):
    from bench import simulator

    out = tmp_path / "sim.json"
    real = simulator.run_cell
    on_disk: list[dict] = []

    def run_cell(cell, *args, **kwargs):
        if cell.policy == "round-robin":  # the second cell: the first is already written
            on_disk.append(json.loads(out.read_text()))
        return real(cell, *args, **kwargs)

    monkeypatch.setattr(simulator, "run_cell", run_cell)
    result = CliRunner().invoke(app, [*SIMULATE, "--replicas", "2", "--policies", "pow2,round-robin",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    [partial] = on_disk
    assert partial["in_progress"] is True and [r["policy"] for r in partial["runs"]] == ["pow2"]
    assert partial["runs"][0]["summary"]["hit_rate"] is not None
    document = json.loads(out.read_text())
    assert "in_progress" not in document and [r["policy"] for r in document["runs"]] == ["pow2", "round-robin"]


def test_simulate_goes_on_when_the_file_cannot_be_written_as_cells_finish(tmp_path, monkeypatch):
    from bench import report

    out = tmp_path / "sim.json"
    real = report.write_json

    def write_json(path, document):
        if document.get("in_progress"):
            raise PermissionError(13, "Permission denied")
        real(path, document)

    monkeypatch.setattr(report, "write_json", write_json)
    result = CliRunner().invoke(app, [*SIMULATE, "--replicas", "2", "--policies", "pow2,round-robin",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.count(f"warning: cannot write {out} as cells finish (Permission denied)") == 1
    assert [r["policy"] for r in json.loads(out.read_text())["runs"]] == ["pow2", "round-robin"]


@pytest.mark.parametrize("flag, value, message", [
    ("--sessions", "0", "--sessions must be between 1 and 1,000,000, got 0"),
    # The workload is generated up front: a mistyped count grew until memory ran out.
    ("--sessions", "99999999999999999999", "--sessions must be between 1 and 1,000,000, got 99999999999999999999"),
    ("--jobs", "-1", "--jobs must be >= 0 (0: one per CPU core), got -1"),
])
def test_simulate_names_the_flag_and_value_it_refuses(tmp_path, flag, value, message):
    result = CliRunner().invoke(app, ["simulate", flag, value, "--out", str(tmp_path / "s.json")])
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_config_that_is_a_folder_is_named_as_one(tmp_path):
    result = CliRunner().invoke(app, ["render", "serve-config", "--config", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.output, result.output
