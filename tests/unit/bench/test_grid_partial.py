"""A simulation grid keeps the cells that finished: a cell that raises is recorded with its error, serially
and in worker processes; a cell whose worker process dies runs again alone (recorded as failed if it dies
there too); each finished cell is handed out as the grid goes; Ctrl-C carries the finished cells out; large
workloads say they are generating."""

from __future__ import annotations

import os
import signal

import pytest

from bench import simulator
from bench.report import simulation_report
from bench.sim_cost import GPU_PROFILE


def test_a_failed_cell_is_recorded_and_the_others_run(monkeypatch):
    real = simulator.run_cell

    def run_cell(cell, *args, **kwargs):
        if cell.num_replicas == 2 and cell.policy == "pow2":
            raise MemoryError()
        return real(cell, *args, **kwargs)

    monkeypatch.setattr(simulator, "run_cell", run_cell)
    messages: list[str] = []
    runs = simulator.run_grid(["fanout"], [2, 3], 3, policies=("pow2", "round-robin"), profile=GPU_PROFILE,
                              progress=messages.append)
    assert [(r.num_replicas, r.policy, r.error) for r in runs] == [
        (2, "pow2", "MemoryError"), (2, "round-robin", None), (3, "pow2", None), (3, "round-robin", None)
    ]
    assert runs[0].summary is None and runs[0].num_requests is None and runs[1].num_requests > 0
    assert "fanout x2 pow2: FAILED: MemoryError" in messages
    text = simulation_report([r.to_json() for r in runs])
    assert "pow2         FAILED: MemoryError" in text
    assert "(ratio to round-robin, value in parentheses)" in text  # pow2, the baseline, failed on 2 replicas
    assert "(ratio to pow2, value in parentheses)" in text  # and ran on 3


def test_a_failed_cell_in_a_worker_process_is_recorded_and_the_others_run():
    runs = simulator.run_grid(["fanout"], [2], 3, policies=("pow2", "fastest"), profile=GPU_PROFILE, jobs=2)
    assert [r.policy for r in runs] == ["pow2", "fastest"]
    assert runs[0].error is None and runs[0].num_requests > 0
    assert runs[1].error.startswith("ValueError: unknown policy 'fastest'")


def test_ctrl_c_in_a_grid_carries_the_cells_that_finished(monkeypatch):
    real = simulator.run_cell

    def run_cell(cell, *args, **kwargs):
        if cell.policy == "round-robin":
            raise KeyboardInterrupt
        return real(cell, *args, **kwargs)

    monkeypatch.setattr(simulator, "run_cell", run_cell)
    with pytest.raises(simulator.GridInterrupted) as stop:
        simulator.run_grid(["fanout"], [2], 3, policies=("pow2", "round-robin", "warmpath"), profile=GPU_PROFILE)
    assert [r.policy for r in stop.value.runs] == ["pow2"]
    assert isinstance(stop.value, KeyboardInterrupt)  # a caller that does not know it still stops


def test_a_large_workload_says_it_is_generating_and_a_small_one_does_not(monkeypatch):
    messages: list[str] = []
    simulator.run_grid(["fanout"], [2], 3, policies=("pow2",), profile=GPU_PROFILE, progress=messages.append)
    assert not any("generating" in m for m in messages)
    monkeypatch.setattr(simulator, "GENERATION_PROGRESS_MIN_SESSIONS", 3)
    messages.clear()
    simulator.run_grid(["fanout"], [2], 3, policies=("pow2",), profile=GPU_PROFILE, progress=messages.append)
    assert messages[0] == "generating 3 fanout sessions"
    cell_messages: list[str] = []
    cell = simulator.GridCell("fanout", 2, "pow2", 3, 0, "gpu")
    simulator.run_cell(cell, GPU_PROFILE, progress=cell_messages.append)  # a worker generates its own
    assert cell_messages[0] == "fanout x2 pow2: generating 3 fanout sessions"


def run_cell_or_die(cell, *args, **kwargs):
    """`run_cell` in a worker process that kills itself on the cells of $GRID_TEST_DIE_POLICY.

    With $GRID_TEST_DIE_ONCE (a file path) it dies only while that file does not exist, creating it first.
    """
    if cell.policy == os.environ.get("GRID_TEST_DIE_POLICY"):
        marker = os.environ.get("GRID_TEST_DIE_ONCE")
        if marker is None or not os.path.exists(marker):
            if marker is not None:
                open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    return simulator.run_cell(cell, *args, **kwargs)


def _figures(run):
    return {k: v for k, v in run.to_json().items() if k not in ("wall_s", "cpu_s")}


GRID = (["fanout"], [2], 3)
POLICIES = ("pow2", "round-robin", "session-hash")


def test_a_cell_whose_worker_process_dies_runs_again_and_the_grid_completes(monkeypatch, tmp_path):
    serial = simulator.run_grid(*GRID, policies=POLICIES, profile=GPU_PROFILE)
    monkeypatch.setenv("GRID_TEST_DIE_POLICY", "pow2")
    monkeypatch.setenv("GRID_TEST_DIE_ONCE", str(tmp_path / "died"))
    monkeypatch.setattr(simulator, "run_cell", run_cell_or_die)  # what the parent submits to its workers
    messages: list[str] = []
    runs = simulator.run_grid(*GRID, policies=POLICIES, profile=GPU_PROFILE, jobs=2, progress=messages.append)
    assert (tmp_path / "died").exists()  # it did die once
    assert [_figures(r) for r in runs] == [_figures(r) for r in serial]
    deaths = [m for m in messages if m.startswith("a simulation process died")]
    assert len(deaths) == 1 and "fanout x2 pow2" in deaths[0] and "again alone" in deaths[0], messages


def test_a_cell_whose_worker_process_dies_every_time_is_recorded_and_the_others_run(monkeypatch):
    monkeypatch.setenv("GRID_TEST_DIE_POLICY", "round-robin")
    monkeypatch.delenv("GRID_TEST_DIE_ONCE", raising=False)
    monkeypatch.setattr(simulator, "run_cell", run_cell_or_die)
    messages: list[str] = []
    runs = simulator.run_grid(*GRID, policies=POLICIES, profile=GPU_PROFILE, jobs=2, progress=messages.append)
    assert [r.policy for r in runs] == list(POLICIES)
    assert runs[0].error is None and runs[2].error is None and runs[2].num_requests > 0
    assert runs[1].error.startswith("ProcessDied: its simulation process died, also when it ran alone (killed: "
                                    "out of memory?")
    assert runs[1].summary is None
    assert any(m.startswith("fanout x2 round-robin: FAILED: ProcessDied") for m in messages), messages


@pytest.mark.parametrize("jobs", [1, 2])
def test_each_finished_cell_is_handed_out_with_those_before_in_grid_order(jobs):
    seen: list[list[str]] = []
    runs = simulator.run_grid(*GRID, policies=POLICIES, profile=GPU_PROFILE, jobs=jobs,
                              checkpoint=lambda finished: seen.append([r.policy for r in finished]))
    assert len(seen) == len(POLICIES) and [len(s) for s in seen] == [1, 2, 3]
    assert seen[-1] == [r.policy for r in runs] == list(POLICIES)
    assert all(s == [p for p in POLICIES if p in s] for s in seen)  # grid order, whichever finished first
