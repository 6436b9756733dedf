"""One record per request of a run (live or simulated), and the figures a run is judged by.

A trace is the list of `RequestRecord`s of one run of one policy, in send
order. The live driver fills every field from the HTTP response (headers and
vLLM's usage); the simulator fills the same fields from its model, so both are
summarised by the same `summarize`.

Definitions (`TraceSummary`):
- hit rate: sum of cached prompt tokens / sum of prompt tokens (vLLM's own
  `usage.prompt_tokens_details.cached_tokens` on a live run);
- prefill tokens: prompt tokens minus cached tokens, i.e. what was computed;
- load imbalance: max / mean prefill tokens per replica, over all replicas
  (a replica that served nothing counts as 0);
- TTFT: request sent -> first streamed chunk; turn latency: request sent ->
  last chunk (one turn = one model call of an agent);
- turns per second: completed requests / (last completion - first send);
- prediction accuracy: fraction of warmpath-routed requests whose predicted
  cached tokens are within one KV block of vLLM's count.
Failed requests (`error` set) count only in `num_errors`.

Serialisation: `to_json`/`from_json` keep token ids as base64 of little-endian
u32 values (`token_ids_b64`), a quarter of the size of a JSON list of ints.
"""

from __future__ import annotations

import base64
import sys
from array import array
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    session_id: str
    step_index: int
    send_s: float
    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    replica_id: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None  # to the last token; a failed request's, to its failure
    predicted_cached_tokens: int | None = None
    route: str | None = None
    error: str | None = None
    token_ids: array | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "token_ids"}
        if self.token_ids is not None:
            out["token_ids_b64"] = encode_token_ids(self.token_ids)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "RequestRecord":
        fields = {k: v for k, v in data.items() if k in cls.__slots__ and k != "token_ids"}
        encoded = data.get("token_ids_b64")
        return cls(**fields, token_ids=decode_token_ids(encoded) if encoded is not None else None)


def encode_token_ids(token_ids: Iterable[int]) -> str:
    tokens = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
    if sys.byteorder == "big":  # pragma: no cover - no supported host is big-endian
        tokens = array("I", tokens)
        tokens.byteswap()
    return base64.b64encode(tokens.tobytes()).decode("ascii")


def decode_token_ids(encoded: str) -> array:
    tokens = array("I")
    tokens.frombytes(base64.b64decode(encoded))
    if sys.byteorder == "big":  # pragma: no cover
        tokens.byteswap()
    return tokens


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class TraceSummary:
    """Figures of one run (see module docstring for definitions)."""

    num_requests: int
    num_errors: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    hit_rate: float | None
    load_imbalance: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    turns_per_s: float | None
    prediction_accuracy: float | None
    num_predictions: int
    prefill_tokens_by_replica: dict[str, int]

    def to_json(self) -> dict:
        return asdict(self)


def live_replica_slots(records: Sequence[RequestRecord]) -> dict[str, int]:
    """The run's replica ids (`x-warmpath-replica`), numbered in the order they first served a request: where a
    replay puts each request back (the simulator's pinned replay, the oracle's own-placement bound)."""
    slots: dict[str, int] = {}
    for record in records:
        if record.replica_id and record.replica_id not in slots:
            slots[record.replica_id] = len(slots)
    return slots


def summarize(records: Sequence[RequestRecord], replica_ids: Sequence[str], block_size_tokens: int) -> TraceSummary:
    """Summarises one run.

    Args:
        records: the run's requests.
        replica_ids: every replica of the run (those that served nothing count as 0 work).
        block_size_tokens: KV block size, the tolerance of a correct prediction.

    Returns:
        The run's figures.
    """
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    by_replica = dict.fromkeys(replica_ids, 0)
    for r in ok:
        if r.replica_id is not None:
            by_replica[r.replica_id] = by_replica.get(r.replica_id, 0) + r.prompt_tokens - r.cached_tokens
    work = list(by_replica.values())
    mean_work = sum(work) / len(work) if work else 0.0
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    ends = [r.send_s + r.latency_s for r in ok if r.latency_s is not None]
    span_s = (max(ends) - min(r.send_s for r in ok)) if ends else 0.0
    predicted = [r for r in ok if r.predicted_cached_tokens is not None]
    num_within = sum(abs(r.predicted_cached_tokens - r.cached_tokens) <= block_size_tokens for r in predicted)
    return TraceSummary(
        num_requests=len(ok),
        num_errors=len(records) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        prefill_tokens=prompt - cached,
        hit_rate=cached / prompt if prompt else None,
        load_imbalance=max(work) / mean_work if mean_work > 0 else None,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        turns_per_s=len(ends) / span_s if span_s > 0 else None,
        prediction_accuracy=num_within / len(predicted) if predicted else None,
        num_predictions=len(predicted),
        prefill_tokens_by_replica=by_replica,
    )
