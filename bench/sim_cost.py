"""Replica cost models of the simulator, kept apart from the event loop that uses them.

The numbers are what a simulated result rests on, each with where it comes from
(a fit of live runs, or an estimate stated step by step): they are refitted and
cited (the README points here) without reading the simulation. `fit_cost`
refits the CPU numbers from a `warmpath bench` JSON:
`python -m bench.sim_cost bench/results/bench-shared-tools.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from bench.trace import RequestRecord


@dataclass(frozen=True)
class CostProfile:
    """Replica speed and KV capacity. `source` says where the numbers come from."""

    name: str
    block_size_tokens: int
    kv_capacity_blocks: int
    prefill_overhead_s: float
    prefill_s_per_token: float
    decode_s_per_token: float
    is_decode_blocking: bool
    kv_event_lag_s: float
    source: str

    def prefill_s(self, num_uncached_tokens: int) -> float:
        return self.prefill_overhead_s + self.prefill_s_per_token * num_uncached_tokens


# Measured on 2 CPU cores, 2 replicas of the small model (6 layers, hidden 384), from
# `warmpath bench --workload shared-tools --policies pow2,warmpath` (40 sessions, 203 requests a
# policy), refitted with `fit_cost` on the 42 requests that ran alone within their run: TTFT = 39 ms
# (HTTP, routing, the engine step) + 0.282 ms per uncached token; decode a median 10.2 ms per output
# token, counting the stream's 50 ms chunk gathering (Ray Serve LLM) that the last chunk waits for.
# The previous fit (89 ms + 0.177 ms per token, decode 11.6 ms) pooled both runs' records, so that
# requests overlapping their twin of the other run counted as alone, their queueing as cost.
# Capacity: VLLM_CPU_KVCACHE_SPACE=1 GiB / (32 tokens
# * 3,072 bytes per token: 2 (K, V) * 6 layers * 2 KV heads * 64 dims * 2 bytes).
CPU_PROFILE = CostProfile(
    name="cpu-small-model",
    block_size_tokens=32,
    kv_capacity_blocks=(1 << 30) // (32 * 3072),
    prefill_overhead_s=0.039,
    prefill_s_per_token=0.000282,
    decode_s_per_token=0.0102,
    is_decode_blocking=True,
    kv_event_lag_s=0.05,
    source=(
        "measured on 2 CPU cores: TTFT of the 42 live shared-tools requests that ran alone (of 406) "
        "fitted as 39 ms + 0.282 ms per uncached token, decode 10.2 ms per token (median); "
        "KV capacity 1 GiB per replica at 3,072 bytes per token"
    ),
)

# Assumed, not measured: one H100 80GB per replica serving Qwen2.5-7B-Instruct in bf16 with vLLM.
# Prefill: ~15 GFLOP per token (2 x 7.6B parameters) at ~30% of 989 dense bf16 TFLOP/s is
# ~20k tokens/s, i.e. 0.05 ms per token, plus 15 ms scheduling and first-step overhead.
# Decode: ~12 ms per output token at a moderate batch (15 GB of weights read per step at
# 3.35 TB/s is 4.5 ms; KV reads and batching roughly double it). KV: 0.9 * 80 GB minus
# 15.2 GB of weights and ~3 GB of activations leaves ~53 GB, at 57,344 bytes per token
# (2 * 28 layers * 4 KV heads * 128 dims * 2 bytes) ~900k tokens = 56,250 blocks of 16.
GPU_PROFILE = CostProfile(
    name="gpu-h100-qwen2.5-7b",
    block_size_tokens=16,
    kv_capacity_blocks=56_250,
    prefill_overhead_s=0.015,
    prefill_s_per_token=0.00005,
    decode_s_per_token=0.012,
    is_decode_blocking=False,
    kv_event_lag_s=0.01,
    source=(
        "assumed: H100 80GB, Qwen2.5-7B bf16; prefill 0.05 ms/token (~30% MFU) + 15 ms, "
        "decode 12 ms/token with continuous batching, ~900k KV tokens per replica"
    ),
)


@dataclass(frozen=True)
class CostFit:
    """Replica speed fitted from live records: TTFT = overhead + per-token time * uncached tokens."""

    num_requests: int
    prefill_overhead_s: float
    prefill_s_per_token: float
    decode_s_per_token: float | None

    def to_json(self) -> dict:
        return asdict(self)


def alone_in_flight(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The successful requests no other request overlapped, from sending to their last token.

    Why: a request that waited behind others counts the wait as its own cost, and
    on a few shared cores any other request in flight slows it; only these show
    what a request costs by itself. A failed request overlaps for as long as it
    was in flight (its engine may have been prefilling it all along).
    """
    timed = sorted((r for r in records if r.latency_s is not None), key=lambda r: r.send_s)
    ends = [r.send_s + r.latency_s for r in timed]
    alone = []
    latest_end = float("-inf")  # of the requests sent before this one
    for i, record in enumerate(timed):
        next_start = timed[i + 1].send_s if i + 1 < len(timed) else float("inf")
        if latest_end <= record.send_s and ends[i] <= next_start and record.error is None and record.ttft_s is not None:
            alone.append(record)
        latest_end = max(latest_end, ends[i])
    return alone


def fit_cost(records: Sequence[RequestRecord], *more_runs: Sequence[RequestRecord]) -> CostFit:
    """Least-squares line of TTFT against uncached prompt tokens; median decode time per output token.

    Fits only the requests that ran alone (`alone_in_flight`): the intercept then
    holds what a request pays besides its prefill (HTTP, routing, the engine
    step) and no queueing. A run at low load has enough of them. Each run's
    records (`records`, then `more_runs`) are looked at apart: their send times
    count from their own run's start, so pooled, every request overlapped its
    twin of the other run and almost none was alone.

    Raises:
        ValueError: fewer than two such requests with distinct uncached token counts, or a line
            whose cost does not grow with the tokens (not a cost model).
    """
    ok = [record for run in (records, *more_runs) for record in alone_in_flight(run)]
    xs = [r.prompt_tokens - r.cached_tokens for r in ok]
    if len(set(xs)) < 2:
        raise ValueError(
            f"need requests that ran alone with at least two distinct uncached token counts, got {len(ok)} "
            "such requests: fit a run at lower load (fewer sessions, or one policy)"
        )
    ys = [r.ttft_s for r in ok]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    if slope <= 0 or mean_y - slope * mean_x < 0:
        raise ValueError(
            f"the {len(ok)} requests that ran alone give TTFT = {(mean_y - slope * mean_x) * 1e3:.1f} ms + "
            f"{slope * 1e3:.4f} ms per uncached token, which is no cost model: fit a run with more of them"
        )
    decode = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1)
              for r in ok if r.latency_s is not None and r.output_tokens > 1]
    return CostFit(len(ok), mean_y - slope * mean_x, slope, statistics.median(decode) if decode else None)


def _read_bench_runs(parser: argparse.ArgumentParser, path: Path) -> dict:
    """The `policies` of a `warmpath bench` JSON; anything else is a one-line `parser.error` naming the file.

    Why: the file is often missing (it exists only after a live bench) or another
    JSON (`warmpath simulate` writes figures, not the records a fit needs).
    """
    if not path.exists():
        parser.error(f"{path} does not exist: run `warmpath bench` first (it writes bench/results/bench-<workload>.json)")
    if path.is_dir():
        parser.error(f"{path} is a directory: give a `warmpath bench` JSON file")
    try:
        document = json.loads(path.read_text())
    except OSError as err:
        parser.error(f"cannot read {path} ({err.strerror or err})")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        parser.error(f"{path} is not JSON ({' '.join(str(err).split())})")
    kind = document.get("kind") if isinstance(document, dict) else None
    if kind == "warmpath-simulate":
        parser.error(f"{path} is a `warmpath simulate` result, which has no request records: "
                     "give a `warmpath bench` JSON")
    runs = document.get("policies") if isinstance(document, dict) else None
    if not isinstance(runs, dict) or not all(isinstance(run, dict) for run in runs.values()):
        parser.error(f"{path} is not a `warmpath bench` result (no \"policies\" with runs)")
    return runs


def _records(
    parser: argparse.ArgumentParser, path: Path, runs: dict, chosen: Sequence[str]
) -> list[list[RequestRecord]]:
    """The request records of each `chosen` run; a failed or malformed run is a one-line `parser.error`."""
    records = []
    for policy in chosen:
        run = runs[policy]
        if run.get("error"):
            parser.error(f"the {policy} run in {path} failed ({run['error']}): it has no records")
        try:
            if not isinstance(run.get("records"), list):
                raise TypeError("records is not a list")
            records.append([_record(r) for r in run["records"]])
        except (KeyError, TypeError, ValueError) as err:
            parser.error(f"the {policy} run in {path} has malformed records ({type(err).__name__}: {err})")
    return records


_NUMBERS = ("step_index", "send_s", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_s", "latency_s")
# The figures a record may lack (null): a request that failed has no first token, and may have no latency.
_MAY_BE_NULL = ("ttft_s", "latency_s")


def _record(data: object) -> RequestRecord:
    """One record of a bench file, its figures numbers (the fit did arithmetic on a `"abc"`, with a traceback)."""
    if not isinstance(data, dict):
        raise TypeError(f"a record is {type(data).__name__}, not an object")
    for name in _NUMBERS:
        if name not in data:  # left to the record's default
            continue
        value = data[name]
        if value is None and name in _MAY_BE_NULL:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} is {value!r}, not a number")
    return RequestRecord.from_json(data)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fit the CPU cost profile from a `warmpath bench` JSON.")
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--policy", action="append", help="policies whose records to pool (default: all that ran)")
    args = parser.parse_args(argv)
    runs = _read_bench_runs(parser, args.bench_json)
    chosen = args.policy or [p for p, run in runs.items() if not run.get("error")]
    unknown = [p for p in chosen if p not in runs]
    if unknown:
        parser.error(f"no run of {', '.join(unknown)} in {args.bench_json} (has {', '.join(runs)})")
    if not chosen:
        parser.error(f"{args.bench_json} has no run that finished")
    try:
        fit = fit_cost(*_records(parser, args.bench_json, runs, chosen))
    except ValueError as err:
        parser.error(f"cannot fit {args.bench_json}: {err}")
    decode = "n/a" if fit.decode_s_per_token is None else f"{fit.decode_s_per_token * 1e3:.2f} ms"
    print(f"{fit.num_requests} requests of {', '.join(chosen)}: TTFT = {fit.prefill_overhead_s * 1e3:.1f} ms + "
          f"{fit.prefill_s_per_token * 1e3:.4f} ms per uncached token; decode {decode} per output token (median)")
    print(json.dumps(fit.to_json()))


if __name__ == "__main__":
    main()
