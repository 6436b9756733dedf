"""bench/router_decision.py's flags: counts below 1 and an --out it cannot write are argparse errors
before the benchmark starts (they were an IndexError, a ZeroDivisionError, and a failed write at the end)."""

from __future__ import annotations

import pytest

router_decision = pytest.importorskip("bench.router_decision")  # imports vLLM's event types


@pytest.fixture
def never_runs(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the benchmark started before its flags were checked")

    monkeypatch.setattr(router_decision, "fill_frames", never)


def _error_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        router_decision.main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--iterations", "--index-blocks"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_counts_below_one_are_refused(tmp_path, capsys, never_runs, flag, value):
    line = _error_of([flag, value, "--out", str(tmp_path / "r.json")], capsys)
    assert f"argument {flag}: must be >= 1, got {value}" in line


def test_a_count_that_is_not_a_number_is_refused(tmp_path, capsys, never_runs):
    assert "not an integer: 'many'" in _error_of(["--iterations", "many", "--out", str(tmp_path / "r.json")], capsys)


def test_an_out_it_cannot_write_is_refused_before_the_run(tmp_path, capsys, never_runs):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert "is a directory" in _error_of(["--out", str(tmp_path)], capsys)
    assert "is not a directory" in _error_of(["--out", str(a_file / "r.json")], capsys)


def test_the_out_probe_leaves_no_file_behind(tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise SystemExit(3)

    monkeypatch.setattr(router_decision, "fill_frames", stop)
    out = tmp_path / "new" / "r.json"
    with pytest.raises(SystemExit):
        router_decision.main(["--out", str(out)])
    assert not out.exists() and out.parent.is_dir()


def test_a_tiny_run_writes_its_results(tmp_path, monkeypatch):
    monkeypatch.setattr(router_decision, "PROMPT_SIZES", (8192,))  # the targets read 8k
    monkeypatch.setattr(router_decision, "REPLICA_COUNTS", (16,))
    out = tmp_path / "r.json"
    assert router_decision.main(["--iterations", "1", "--index-blocks", "1", "--out", str(out)]) == 0
    assert out.read_text().startswith("{")


def test_calls_sharing_an_index_share_one_clock_so_earlier_pending_entries_expire(monkeypatch):
    """Each call restarted its clock (8,192,000 s for 8k tokens, below the 32k-token call's end): the
    by-replica runs carried every earlier call's pending entries, which never expired there."""
    import random

    from cluster.config import RouterConfig
    from router.index import PrefixIndex

    times = []
    real_choose = router_decision.PrefixAwarePolicy.choose
    monkeypatch.setattr(router_decision.PrefixAwarePolicy, "choose", lambda self, *args: times.append(args[-1])
                        or real_choose(self, *args))
    index, rng = PrefixIndex(router_decision.BLOCK_SIZE, 500_000, router_decision.MODEL), random.Random(0)
    clock = router_decision.DecisionClock()
    router_decision.bench_decisions(rng, index, 2048, 5, cases=("session",), clock=clock)
    first = list(times)
    router_decision.bench_decisions(rng, index, 512, 5, num_replicas=4, cases=("session",), clock=clock)
    assert min(times[len(first):]) > max(first) + RouterConfig().pending_ttl_s
