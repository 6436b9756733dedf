"""bench.sim_cost's fit of live records, on records drawn from a known line."""

from __future__ import annotations

import json

import pytest

from bench.sim_cost import fit_cost, main
from bench.trace import RequestRecord


def _record(uncached: int, ttft_s: float, output_tokens: int = 5, decode_s: float = 0.01, **fields) -> RequestRecord:
    return RequestRecord("s", 0, 0.0, prompt_tokens=uncached + 64, cached_tokens=64, output_tokens=output_tokens,
                         ttft_s=ttft_s, latency_s=ttft_s + decode_s * (output_tokens - 1), **fields)


def test_fit_recovers_the_line_and_the_decode_time():
    records = [_record(n, 0.05 + 0.0002 * n) for n in (100, 400, 900, 2000)]
    records.append(_record(300, 9.0, error="HTTP 500"))  # failed: not fitted
    fit = fit_cost(records)
    assert fit.num_requests == 4
    assert fit.prefill_overhead_s == pytest.approx(0.05)
    assert fit.prefill_s_per_token == pytest.approx(0.0002)
    assert fit.decode_s_per_token == pytest.approx(0.01)


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
