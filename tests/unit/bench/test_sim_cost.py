"""bench.sim_cost's fit of live records, on records drawn from a known line."""

from __future__ import annotations

import itertools
import json

import pytest

from bench.sim_cost import fit_cost, main
from bench.trace import RequestRecord


_SEND_TIMES = itertools.count(0.0, 100.0)  # far apart: each record runs alone unless a test says otherwise


def _record(uncached: int, ttft_s: float, output_tokens: int = 5, decode_s: float = 0.01, send_s: float | None = None,
            **fields) -> RequestRecord:
    return RequestRecord("s", 0, next(_SEND_TIMES) if send_s is None else send_s, prompt_tokens=uncached + 64,
                         cached_tokens=64, output_tokens=output_tokens, ttft_s=ttft_s,
                         latency_s=ttft_s + decode_s * (output_tokens - 1), **fields)


def test_fit_recovers_the_line_and_the_decode_time():
    records = [_record(n, 0.05 + 0.0002 * n) for n in (100, 400, 900, 2000)]
    records.append(_record(300, 9.0, error="HTTP 500"))  # failed: not fitted
    fit = fit_cost(records)
    assert fit.num_requests == 4
    assert fit.prefill_overhead_s == pytest.approx(0.05)
    assert fit.prefill_s_per_token == pytest.approx(0.0002)
    assert fit.decode_s_per_token == pytest.approx(0.01)


def test_a_failed_request_in_flight_beside_one_makes_it_not_alone():
    """A request that failed after a while held its engine meanwhile (it was prefilling, say): the one it
    overlapped paid for both and is no measure of its own cost."""
    from bench.sim_cost import alone_in_flight

    fine = _record(400, 0.1, send_s=10_000.0)
    failed = RequestRecord("t", 0, 10_000.05, prompt_tokens=3000, latency_s=2.0, error="HTTP 500")
    later = _record(400, 0.1, send_s=20_000.0)
    assert alone_in_flight([fine, failed, later]) == [later]
    never_timed = RequestRecord("u", 0, 10_000.05, prompt_tokens=3000, error="ConnectError: refused")
    assert alone_in_flight([fine, never_timed, later]) == [fine, later]


def test_fit_leaves_out_requests_that_overlapped_others():
    alone = [_record(n, 0.05 + 0.0002 * n) for n in (100, 400, 900, 2000)]
    # Two requests in flight together, each waiting behind the other: their TTFTs hold queueing, not cost.
    queued = [_record(3000, 0.2, send_s=5000.0), _record(50, 3.0, send_s=5000.1)]
    fit = fit_cost(alone + queued)
    assert fit.num_requests == 4
    assert fit.prefill_overhead_s == pytest.approx(0.05)
    assert fit.prefill_s_per_token == pytest.approx(0.0002)


def test_a_line_that_is_no_cost_model_is_refused():
    with pytest.raises(ValueError, match="no cost model"):
        fit_cost([_record(100, 0.5), _record(2000, 0.1)])


def test_fit_needs_two_distinct_sizes():
    with pytest.raises(ValueError, match="two distinct"):
        fit_cost([_record(100, 0.1), _record(100, 0.2)])


def test_fit_from_a_bench_file(tmp_path, capsys):
    runs = {"pow2": [_record(n, 0.1 + 0.001 * n) for n in (10, 20)],
            "warmpath": [_record(n, 0.05 + 0.0002 * n) for n in (100, 400)]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"policies": {p: {"records": [r.to_json() for r in rs]} for p, rs in runs.items()}}))
    main([str(path), "--policy", "warmpath"])
    fitted = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert fitted["prefill_overhead_s"] == pytest.approx(0.05) and fitted["num_requests"] == 2
    with pytest.raises(SystemExit):
        main([str(path), "--policy", "fastest"])


def _error_of(argv: list[str], capsys) -> str:
    """The one error line `main` exits 2 with (argparse's usage line aside)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage:") and len(lines) == 2
    return lines[1]


def _bad_files(tmp_path) -> dict[str, tuple[object, str]]:
    """name -> (file content, or a folder, or nothing; what the error must say)."""
    ok_run = {"records": [_record(100, 0.1).to_json()]}
    return {
        "missing": (None, "does not exist: run `warmpath bench` first"),
        "folder": ("folder", "is a directory"),
        "text": ("not json {", "is not JSON"),
        "binary": (b"\xff\xfe\x00", "is not JSON"),
        "list": ([1, 2], "is not a `warmpath bench` result"),
        "simulate": ({"kind": "warmpath-simulate", "runs": []}, "is a `warmpath simulate` result"),
        "no-requests": ({"policies": {"pow2": {"records": [_record(100, 0.1, error="HTTP 500").to_json()]}}},
                        "cannot fit"),
        "one-size": ({"policies": {"pow2": ok_run}}, "at least two distinct uncached token counts"),
        "all-failed": ({"policies": {"pow2": {"error": "RuntimeError: boom"}}}, "has no run that finished"),
        "malformed": ({"policies": {"pow2": {"records": [{"send_s": 1.0}]}}}, "has malformed records"),
        "text-figure": ({"policies": {"pow2": {"records": [{**_record(100, 0.1).to_json(), "prompt_tokens": "abc"}]}}},
                        "prompt_tokens is 'abc', not a number"),
        "records-object": ({"policies": {"pow2": {"records": {"a": 1}}}}, "records is not a list"),
        # Only a first token and a latency may be missing (null) from a record: the fit did arithmetic on None.
        "null-figure": ({"policies": {"pow2": {"records": [{**_record(100, 0.1).to_json(), "send_s": None}]}}},
                        "send_s is None, not a number"),
    }


@pytest.mark.parametrize("name", ["missing", "folder", "text", "binary", "list", "simulate", "no-requests",
                                  "one-size", "all-failed", "malformed", "text-figure", "records-object",
                                  "null-figure"])
def test_a_file_that_cannot_be_fitted_is_one_error_line_naming_it(tmp_path, capsys, name):
    content, message = _bad_files(tmp_path)[name]
    path = tmp_path / f"{name}.json"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_text(json.dumps(content))
    line = _error_of([str(path)], capsys)
    assert str(path) in line and message in line


def test_a_failed_policy_is_skipped_by_default_and_named_when_chosen(tmp_path, capsys):
    runs = {"pow2": {"error": "RuntimeError: boom"},
            "warmpath": {"records": [_record(n, 0.05 + 0.0002 * n).to_json() for n in (100, 400)]}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"policies": runs}))
    main([str(path)])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["num_requests"] == 2
    line = _error_of([str(path), "--policy", "pow2"], capsys)
    assert "the pow2 run in" in line and "failed (RuntimeError: boom)" in line


def test_runs_are_looked_at_apart_for_requests_that_ran_alone(tmp_path, capsys):
    """Each run's send times count from its own start: pooled, every request overlapped its twin of the other run."""
    sizes = (100, 400, 900, 2000)
    runs = {policy: [_record(n, 0.05 + 0.0002 * n, send_s=100.0 * i) for i, n in enumerate(sizes)]
            for policy in ("pow2", "warmpath")}
    assert fit_cost(*runs.values()).num_requests == 8
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"policies": {p: {"records": [r.to_json() for r in rs]} for p, rs in runs.items()}}))
    main([str(path)])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["num_requests"] == 8


@pytest.mark.parametrize("status", [500, 0], ids=["refused", "connection-failed"])
def test_a_failed_live_request_keeps_how_long_it_was_in_flight(status):
    import asyncio

    import httpx

    from bench import live

    def answer(request):
        if not status:
            raise httpx.ConnectError("refused")
        return httpx.Response(status, text="engine died")

    prepared = live.PreparedRequest("s", 0, {"model": "m"}, [1, 2, 3], 0.0)

    async def send():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await live._send(client, "http://cluster/v1/chat/completions", prepared, 0.0)

    record = asyncio.run(send())
    assert record.error and record.latency_s is not None and record.latency_s >= 0
