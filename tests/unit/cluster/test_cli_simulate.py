"""`warmpath simulate` on a tiny grid: the chosen policies run, and a bad name exits 2 with a message."""

from __future__ import annotations

import json

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
