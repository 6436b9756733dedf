"""`warmpath bench`'s report: the PNG (with or without oracle bounds), strict JSON, and tables that mark
the policies that failed."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import pytest

from bench import report
from bench.report import error_line, live_report, plot_live, ratio_table, write_json


def _result(with_oracle: bool) -> dict:
    def run(ttfts, hit_rate):
        records = [{"ttft_s": t, "error": None} for t in ttfts] + [{"ttft_s": None, "error": "HTTP 503"}]
        return {"records": records, "summary": {"hit_rate": hit_rate}}

    result = {
        "workload": "shared-tools", "num_replicas": 2,
        "policies": {"pow2": run([0.4, 0.5, 1.2], 0.84), "warmpath": run([0.2, 0.3, 0.9], 0.91),
                     "round-robin": run([], None)},
    }
    if with_oracle:
        result["oracle"] = {"warmpath": {"infinite_hit_rate": 0.93, "placed_hit_rate": 0.92}}
    return result


@pytest.mark.parametrize("with_oracle", [True, False])
def test_plot_is_a_png_of_the_figures_size(tmp_path, with_oracle):
    path = tmp_path / "plots" / "bench-shared-tools.png"
    plot_live(_result(with_oracle), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (12 * 110, int(4.5 * 110))


def test_each_policys_oracle_bounds_are_drawn_across_its_own_bar(tmp_path, monkeypatch):
    """Each bound is of that policy's own trace: drawn across every bar, warmpath's looked like everyone's."""
    from matplotlib.axes import Axes

    drawn = []
    real = Axes.hlines
    monkeypatch.setattr(Axes, "hlines", lambda self, y, xmin, xmax, **kw: drawn.append((y, xmin, xmax)) or real(
        self, y, xmin, xmax, **kw))
    result = _result(with_oracle=True)
    result["oracle"]["pow2"] = {"infinite_hit_rate": 0.9, "placed_hit_rate": None}
    plot_live(result, tmp_path / "bench.png")
    # Bars in the policies' order: pow2 at 0, warmpath at 1.
    assert sorted(drawn) == [(0.9, -0.4, 0.4), (0.92, 0.6, 1.4), (0.93, 0.6, 1.4)]


def test_plot_skips_a_policy_that_failed(tmp_path):
    result = _result(with_oracle=False)
    result["policies"]["pow2"] = {"error": "RuntimeError: redeploy failed"}  # no records, no summary
    path = tmp_path / "bench.png"
    plot_live(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_that_fails_midway_leaves_the_previous_png(tmp_path, monkeypatch):
    """It was drawn over the file in place: a full disk left a PNG cut short where the last good one was."""
    from matplotlib.figure import Figure

    path = tmp_path / "bench.png"
    plot_live(_result(with_oracle=False), path)
    before = path.read_bytes()

    def fill_the_disk(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", fill_the_disk)
    with pytest.raises(OSError):
        plot_live(_result(with_oracle=True), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["bench.png"]


def test_json_is_strict_non_finite_figures_become_null(tmp_path):
    path = tmp_path / "out" / "result.json"
    write_json(path, {"time_scale": float("nan"), "runs": [{"turns_per_s": float("inf"), "hit": 0.5}],
                      "pair": (float("-inf"), 1)})

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "time_scale": None, "runs": [{"turns_per_s": None, "hit": 0.5}], "pair": [None, 1]
    }


def test_json_replaces_a_file_whole_and_through_a_link(tmp_path):
    target = tmp_path / "results" / "sim.json"
    write_json(target, {"runs": [1]})
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_json(link, {"runs": [1, 2]})
    assert link.is_symlink() and json.loads(target.read_text()) == {"runs": [1, 2]}
    assert sorted(p.name for p in target.parent.iterdir()) == ["sim.json"]  # nothing half-written left beside it


def test_json_that_cannot_be_encoded_leaves_the_previous_file(tmp_path):
    path = tmp_path / "sim.json"
    write_json(path, {"runs": [1]})
    with pytest.raises(TypeError):
        write_json(path, {"runs": [object()]})
    assert json.loads(path.read_text()) == {"runs": [1]} and [p.name for p in tmp_path.iterdir()] == ["sim.json"]


def test_json_to_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_json(fifo, {"runs": []})
        assert json.loads(os.read(reader, 1 << 16)) == {"runs": []}
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # still the pipe, not replaced by a file


def _summary(hit_rate: float) -> dict:
    return {"hit_rate": hit_rate, "ttft_p50_s": 1.0}


def test_table_marks_a_failed_policy_and_falls_back_to_the_first_that_finished():
    text = ratio_table({"pow2": None, "warmpath": _summary(0.8), "round-robin": _summary(0.4)}, "title",
                       {"pow2": "MemoryError"})
    lines = text.splitlines()
    assert lines[:2] == ["title", "(ratio to warmpath, value in parentheses)"]
    assert [line.split()[0] for line in lines[4:]] == ["pow2", "warmpath", "round-robin"]  # the given order
    assert lines[4] == "pow2         FAILED: MemoryError"
    assert "0.50 (0.400)" in lines[6]


def test_table_whose_baseline_served_no_request_takes_the_first_run_that_did():
    """Ray's default with every request failed still has a summary, all its figures None: every ratio was blank."""
    from bench.trace import RequestRecord, summarize

    served = [RequestRecord("a", 0, 0.0, 100, cached_tokens=50, replica_id="r0", ttft_s=1.0, latency_s=2.0)]
    failed = [RequestRecord("a", 0, 0.0, 100, error="HTTP 500")]
    summaries = {policy: summarize(records, ["r0", "r1"], 32).to_json()
                 for policy, records in (("pow2", failed), ("warmpath", served))}
    lines = ratio_table(summaries, "title", num_planned=1).splitlines()
    assert lines[1] == "(ratio to warmpath, value in parentheses)"
    assert "1.00 (" in next(line for line in lines if line.startswith("warmpath"))


def test_table_of_runs_that_all_failed_says_so():
    text = ratio_table({"pow2": None, "warmpath": None}, "title", {"pow2": "MemoryError", "warmpath": "OSError: x"})
    assert text.splitlines() == ["title", "(no run finished)", "pow2  FAILED: MemoryError",
                                 "warmpath  FAILED: OSError: x"]


def test_live_report_marks_a_failed_policy_and_a_failed_replay():
    result = {
        "workload": "fanout", "num_sessions": 2, "num_requests": 6, "num_replicas": 2, "time_scale": 1.0,
        "policies": {"pow2": {"error": "RuntimeError: boom"}, "warmpath": {"summary": _summary(0.8)}},
        "oracle": {"warmpath": {"error": "MemoryError"}},
        "simulator_check": {"warmpath": {"error": "ValueError: bad trace"}},
    }
    text = live_report(result)
    assert "pow2      FAILED: RuntimeError: boom" in text
    assert "warmpath: bounds FAILED: MemoryError" in text
    assert "warmpath: FAILED: ValueError: bad trace" in text


def test_live_report_gives_the_routed_and_the_pinned_replay():
    result = {
        "workload": "fanout", "num_sessions": 2, "num_requests": 6, "num_replicas": 2, "time_scale": 1.0,
        "policies": {"pow2": {"summary": _summary(0.8)}},
        "simulator_check": {"pow2": {
            "measured_hit_rate": 0.8, "simulated_hit_rate": 0.9, "tolerance": 0.05, "is_within_tolerance": False,
            "request_agreement": 0.5, "pinned_hit_rate": 0.81, "pinned_request_agreement": 0.97,
        }},
    }
    assert ("pow2: measured 0.800, simulated 0.900 (OUTSIDE +-0.05); 50% of requests cached within one block of "
            "vLLM's count; on the live run's own replicas: simulated 0.810, 97% of requests within one block"
            ) in live_report(result)


def test_error_line_is_one_short_line():
    assert error_line(MemoryError()) == "MemoryError"
    assert error_line(RuntimeError("a\n  b")) == "RuntimeError: a b"
    assert len(error_line(ValueError("x" * 1000))) == 300


def test_rows_that_completed_other_requests_say_so():
    full = {"num_requests": 8, "num_errors": 0, "prefill_tokens": 1000.0, "ttft_p50_s": 0.5}
    short = {"num_requests": 5, "num_errors": 1, "prefill_tokens": 620.0, "ttft_p50_s": 0.43}
    text = ratio_table({"pow2": full, "warmpath": short}, "title", num_planned=8)
    header = text.splitlines()[2]
    assert "requests" in header
    warmpath_row = next(line for line in text.splitlines() if line.startswith("warmpath"))
    assert "5 (+1 failed)" in warmpath_row
    notes = [line for line in text.splitlines() if line.startswith("note:")]
    assert notes == ["note: warmpath completed 5 of 8 requests (1 failed, 2 never sent): its figures cover other "
                     "requests than a full run's, so its ratios compare unlike sets"]
    assert not [line for line in ratio_table({"pow2": full, "warmpath": full}, "t", num_planned=8).splitlines()
                if line.startswith("note:")]


def _round(order, ttfts):
    return {"order": order, "runs": {p: {"error": "X"} if t is None else {"summary": {"ttft_p50_s": t}}
                                     for p, t in zip(order, ttfts)}}


def test_paired_ratios_without_pow2_take_the_first_policy_of_the_first_round():
    rounds = [_round(["warmpath", "prefix-tree"], [0.5, 1.0]), _round(["prefix-tree", "warmpath"], [0.8, 0.4])]
    ratios = report.paired_ratios(rounds)
    assert report.rounds_baseline(rounds) == "warmpath"
    assert ratios["prefix-tree"]["ttft_p50_s"] == {"median": 2.0, "min": 2.0, "max": 2.0, "num_rounds": 2}
    assert "ttft_p99_s" not in ratios["prefix-tree"]  # no round has the figure


def test_rounds_section_marks_figures_some_rounds_lack():
    rounds = [_round(["pow2", "warmpath"], [1.0, 0.5]), _round(["warmpath", "pow2"], [0.7, None])]
    section = report.rounds_section({"rounds": rounds})
    assert "ratio to pow2 within each of 2 rounds" in section
    assert "0.50 [0.50-0.50] n=1" in section
    assert "warmpath TTFT p50 within each round over" not in section  # pow2 is the only other policy


def test_rounds_section_puts_warmpath_over_every_other_policy():
    rounds = [_round(["pow2", "warmpath", "prefix-tree"], [1.0, 0.5, 0.8]),
              _round(["warmpath", "prefix-tree", "pow2"], [0.6, 0.6, 1.2])]
    section = report.rounds_section({"rounds": rounds})
    assert "warmpath TTFT p50 within each round over: prefix-tree 0.81 [0.62-1.00]" in section
    assert report.rounds_section({"rounds": rounds[:1]}) == ""


def test_a_round_whose_runs_cover_other_requests_is_left_out_of_the_paired_ratios():
    """A live session stops at its first failure: a round where warmpath completed 150 of 203 requests entered
    the median and range of its sums (prefill tokens) like a full run."""
    from bench.report import paired_ratios

    def round_(done: int, errors: int, prefill: float) -> dict:
        return {"order": ["pow2", "warmpath"], "runs": {
            "pow2": {"summary": {"num_requests": 203, "num_errors": 0, "prefill_tokens": 1000.0}},
            "warmpath": {"summary": {"num_requests": done, "num_errors": errors, "prefill_tokens": prefill}}}}

    ratios = paired_ratios([round_(203, 0, 600.0), round_(150, 3, 440.0), round_(203, 0, 500.0)])
    prefill = ratios["warmpath"]["prefill_tokens"]
    assert (prefill["num_rounds"], prefill["min"], prefill["max"]) == (2, 0.5, 0.6)
