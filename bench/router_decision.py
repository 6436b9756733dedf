"""Router decision benchmark: pure Python, no Ray, no engines.

Measures, at block size 32 with 16 replicas and an index of about 200k blocks:
- decision latency (p50/p99, microseconds) of `PrefixAwarePolicy.choose` for
  1k/8k/32k-token prompts, in three cases:
  cold: a prompt no replica holds (hashing stops at block 0, but recording
        the placement hashes the whole prompt for its pending entries);
  warm: a prompt whose first N-256 tokens one replica holds, no session
        (the hashes of the latest request with the same first block are taken
        over, as for a shared system prompt; the lookup bisects);
  session: the same, but the previous turn of the same session went through
        this policy, so the shared prefix's hashes are reused.
  A decision includes hashing, lookup, load guard, scoring, ranking and
  recording; it excludes tokenisation and building the `RoutingRequest`
  (list -> array), reported on its own as `request_build_us`, and the expiry
  of earlier pending placements, which the router's event thread sweeps
  between decisions (`expire_pending`), reported as `expiry_sweep_p50_us`.
- the session case at 8k tokens with 16, 64 and 256 candidate replicas: the
  policy's passes over every candidate (load guard, scorers, ranking) grow
  with the replica count while hashing and the lookup do not.
- index memory per (replica, block) entry, with tracemalloc.
- event ingest rate: msgpack frames -> `decode_event_message` ->
  `ReplicaEventStream.accept` -> `PrefixIndex.apply`.

Usage: python bench/router_decision.py [--out PATH] [--iterations N] [--seed S]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import tracemalloc
from array import array
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402
from vllm.distributed.kv_events import BlockStored, KVEventBatch  # noqa: E402

from cluster.config import RouterConfig  # noqa: E402
from router.events import ReplicaEventStream, decode_event_message, make_batch_decoder  # noqa: E402
from router.index import PrefixIndex  # noqa: E402
from router.policy import PrefixAwarePolicy  # noqa: E402
from router.types import ReplicaId, ReplicaLoad, RoutingRequest  # noqa: E402

BLOCK_SIZE = 32
NUM_REPLICAS = 16
MODEL = "warmpath-tiny"
PROMPT_SIZES = (1024, 8192, 32768)
CASES = ("cold", "warm", "session")
REPLICA_COUNTS = (16, 64, 256)
SUFFIX_TOKENS = 256
TARGET_P99_US_AT_8K = 200.0
TARGET_INGEST_BLOCKS_PER_S = 50_000.0


def random_tokens(rng: random.Random, num_tokens: int) -> array:
    tokens = array("I")
    tokens.frombytes(rng.randbytes(4 * num_tokens))
    return tokens


def percentile_us(samples_ns: list[int], fraction: float) -> float:
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, int(fraction * (len(ordered) - 1) + 0.5))] / 1000.0


def stored_event(tokens: array, first_block: int, num_blocks: int, engine_hashes: list[bytes]) -> BlockStored:
    return BlockStored(
        block_hashes=engine_hashes[first_block : first_block + num_blocks],
        parent_block_hash=engine_hashes[first_block - 1] if first_block else None,
        token_ids=tokens[first_block * BLOCK_SIZE : (first_block + num_blocks) * BLOCK_SIZE].tolist(),
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def fill_frames(rng: random.Random, target_blocks: int) -> tuple[list[tuple[ReplicaId, list[bytes]]], int]:
    """Multipart messages that fill the index: agent conversations of 64 blocks
    (a 16-block system prompt shared by one of 8 agent types, then 48 own blocks),
    8 events per batch, one sequence per replica. As vLLM publishes them: a replica
    stores a system prompt once (its first conversation of that type; later ones hit
    it and store only their own blocks, an extension naming the prompt's last block)."""
    encoder = msgspec.msgpack.Encoder()
    system_prompts = [random_tokens(rng, 16 * BLOCK_SIZE) for _ in range(8)]
    # (replica, agent type) -> the engine hashes of the system prompt that replica stored.
    stored_prompts: dict[tuple[ReplicaId, int], list[bytes]] = {}
    pending: dict[ReplicaId, list[BlockStored]] = {ReplicaId(f"replica-{i}"): [] for i in range(NUM_REPLICAS)}
    seqs = dict.fromkeys(pending, 0)
    frames: list[tuple[ReplicaId, list[bytes]]] = []
    num_blocks = 0

    def flush(replica_id: ReplicaId) -> None:
        batch = KVEventBatch(ts=time.time(), events=pending[replica_id])
        frames.append((replica_id, [b"", seqs[replica_id].to_bytes(8, "big"), encoder.encode(batch)]))
        seqs[replica_id] += 1
        pending[replica_id] = []

    while num_blocks < target_blocks:
        replica_id = ReplicaId(f"replica-{rng.randrange(NUM_REPLICAS)}")
        agent_type = rng.randrange(8)
        tokens = system_prompts[agent_type] + random_tokens(rng, 48 * BLOCK_SIZE)
        prompt_hashes = stored_prompts.get((replica_id, agent_type))
        if prompt_hashes is None:
            prompt_hashes = stored_prompts[(replica_id, agent_type)] = [rng.randbytes(32) for _ in range(16)]
            pending[replica_id].append(stored_event(tokens, 0, 16, prompt_hashes))
            num_blocks += 16
        engine_hashes = prompt_hashes + [rng.randbytes(32) for _ in range(48)]
        pending[replica_id].append(stored_event(tokens, 16, 48, engine_hashes))
        num_blocks += 48
        if len(pending[replica_id]) >= 8:
            flush(replica_id)
    for replica_id in pending:
        if pending[replica_id]:
            flush(replica_id)
    return frames, num_blocks


def ingest(frames, index: PrefixIndex) -> float:
    """Seconds to decode and apply every frame."""
    decoder = make_batch_decoder()
    streams = {}
    start = time.perf_counter()
    for replica_id, message in frames:
        stream = streams.get(replica_id) or streams.setdefault(replica_id, ReplicaEventStream(replica_id, index))
        seq, batch = decode_event_message(message, decoder)
        stream.accept(seq, batch)
    return time.perf_counter() - start


def index_bytes(frames) -> tuple[int, int, int]:
    """(traced bytes, (replica, block) entries, unique blocks) of an index built from `frames`."""
    decoder = make_batch_decoder()
    decoded = [(replica_id, decode_event_message(message, decoder)[1]) for replica_id, message in frames]
    gc.collect()
    tracemalloc.start()
    index = PrefixIndex(BLOCK_SIZE, 500_000, MODEL)
    for replica_id, batch in decoded:
        index.apply(replica_id, batch.events)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    snap = index.snapshot()
    return current, sum(snap.num_blocks_by_replica.values()), snap.num_unique_blocks


@dataclass
class DecisionClock:
    """The decisions' time, one clock across `bench_decisions` calls sharing an index: a call that started
    its own clock below an earlier call's end found that call's pending entries never expiring."""

    now_s: float = 0.0


def bench_decisions(
    rng: random.Random, index: PrefixIndex, num_tokens: int, iterations: int,
    num_replicas: int = NUM_REPLICAS, cases: tuple[str, ...] = CASES, clock: DecisionClock | None = None,
) -> dict[str, dict]:
    policy = PrefixAwarePolicy(RouterConfig(), BLOCK_SIZE, rng=random.Random(rng.random()))
    replica_ids = [ReplicaId(f"replica-{i}") for i in range(num_replicas)]
    loads = {r: ReplicaLoad(rng.randrange(4), 0, rng.random() * 0.5) for r in replica_ids}
    sessions: dict[str, ReplicaId] = {}
    decoder = make_batch_decoder()
    encoder = msgspec.msgpack.Encoder()
    # Warm bases: the first num_tokens - SUFFIX_TOKENS tokens, stored on one replica each.
    bases = [random_tokens(rng, num_tokens - SUFFIX_TOKENS) for _ in range(4)]
    for i, base in enumerate(bases):
        num_blocks = len(base) // BLOCK_SIZE
        event = stored_event(base, 0, num_blocks, [rng.randbytes(32) for _ in range(num_blocks)])
        payload = encoder.encode(KVEventBatch(ts=0.0, events=[event]))
        index.apply(replica_ids[i], decode_event_message([b"", bytes(8), payload], decoder)[1].events)
    clock = clock or DecisionClock()
    # Each call starts after every earlier call's pending entries expired.
    now_s = clock.now_s + RouterConfig().pending_ttl_s + 1.0
    results: dict[str, dict] = {}
    for case in cases:
        samples: list[int] = []
        sweeps: list[int] = []
        reasons: dict[str, int] = {}
        for i in range(iterations):
            now_s += 0.5
            if case == "cold":
                request = RoutingRequest(random_tokens(rng, num_tokens), MODEL)
            else:
                base = bases[i % len(bases)]
                session_id = f"{case}-{num_tokens}-{i}" if case == "session" else None
                if session_id is not None:  # the previous turn, not timed
                    policy.choose(RoutingRequest(base, MODEL, session_id), replica_ids, loads, index, sessions, now_s)
                request = RoutingRequest(base + random_tokens(rng, SUFFIX_TOKENS), MODEL, session_id)
            sweep_start = time.perf_counter_ns()
            index.expire_pending(now_s)  # the router's event thread does this between decisions
            sweeps.append(time.perf_counter_ns() - sweep_start)
            start = time.perf_counter_ns()
            decision = policy.choose(request, replica_ids, loads, index, sessions, now_s)
            samples.append(time.perf_counter_ns() - start)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        results[case] = {
            "p50_us": round(percentile_us(samples, 0.50), 1),
            "p99_us": round(percentile_us(samples, 0.99), 1),
            "expiry_sweep_p50_us": round(percentile_us(sweeps, 0.50), 1),
            "reasons": reasons,
        }
    clock.now_s = now_s
    token_list = random_tokens(rng, num_tokens).tolist()
    build = []
    for _ in range(50):
        start = time.perf_counter_ns()
        RoutingRequest(token_list, MODEL)
        build.append(time.perf_counter_ns() - start)
    results["request_build_us"] = round(percentile_us(build, 0.5), 1)
    return results


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (0 iterations left no samples to rank; 0 blocks divided by zero)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def check_writable(parser: argparse.ArgumentParser, out: Path) -> None:
    """`parser.error` unless `out` can be written as a file; runs before the benchmark, not after it."""
    from cluster.writable import unwritable_file_problem

    if problem := unwritable_file_problem(out):
        parser.error(problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/router_decision.json", help="JSON results path")
    parser.add_argument("--iterations", type=positive_int, default=1000, help="decisions per (size, case)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index-blocks", type=positive_int, default=200_000, help="(replica, block) entries to fill")
    args = parser.parse_args(argv)
    out = Path(args.out)
    check_writable(parser, out)
    rng = random.Random(args.seed)

    frames, num_event_blocks = fill_frames(rng, args.index_blocks)
    traced_bytes, num_entries, num_unique = index_bytes(frames)
    index = PrefixIndex(BLOCK_SIZE, 500_000, MODEL)
    ingest_s = ingest(frames, index)
    clock = DecisionClock()
    decisions = {n: bench_decisions(rng, index, n, args.iterations, clock=clock) for n in PROMPT_SIZES}
    by_replicas = {
        n: bench_decisions(rng, index, 8192, args.iterations, num_replicas=n, cases=("session",), clock=clock)["session"]
        for n in REPLICA_COUNTS
    }

    result = {
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_average_1m": round(os.getloadavg()[0], 2)},
        "setup": {"block_size": BLOCK_SIZE, "num_replicas": NUM_REPLICAS, "index_entries": num_entries,
                  "index_unique_blocks": num_unique, "iterations": args.iterations},
        "index_bytes_per_entry": round(traced_bytes / num_entries, 1),
        "index_bytes_per_unique_block": round(traced_bytes / num_unique, 1),
        "ingest_blocks_per_s": round(num_event_blocks / ingest_s),
        "decisions": {str(n): r for n, r in decisions.items()},
        "session_8k_by_replicas": {str(n): r for n, r in by_replicas.items()},
    }
    p99_8k = max(decisions[8192][case]["p99_us"] for case in CASES)
    result["targets"] = {
        "p99_decision_us_at_8k": {"target": TARGET_P99_US_AT_8K, "worst_case": p99_8k,
                                  "met": p99_8k <= TARGET_P99_US_AT_8K},
        "ingest_blocks_per_s": {"target": TARGET_INGEST_BLOCKS_PER_S, "value": result["ingest_blocks_per_s"],
                                "met": result["ingest_blocks_per_s"] >= TARGET_INGEST_BLOCKS_PER_S},
    }

    print(f"index: {num_entries} entries ({num_unique} unique blocks) over {NUM_REPLICAS} replicas, "
          f"{result['index_bytes_per_entry']} B/entry; ingest {result['ingest_blocks_per_s']} blocks/s")
    print(f"{'tokens':>7} {'case':>8} {'p50 us':>9} {'p99 us':>9} {'sweep us':>9}  reasons")
    for n, per_case in decisions.items():
        for case in CASES:
            row = per_case[case]
            print(f"{n:>7} {case:>8} {row['p50_us']:>9} {row['p99_us']:>9} {row['expiry_sweep_p50_us']:>9}  {row['reasons']}")
        print(f"{n:>7} {'build':>8} {per_case['request_build_us']:>9}  (RoutingRequest from a list, excluded above)")
    print(f"{'replicas':>8} {'p50 us':>9} {'p99 us':>9}  (session, 8k tokens)")
    for n, row in by_replicas.items():
        print(f"{n:>8} {row['p50_us']:>9} {row['p99_us']:>9}")
    for name, target in result["targets"].items():
        print(f"target {name}: {'met' if target['met'] else 'NOT met'} {target}")

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
