"""Discrete-event simulation of N replicas that routes with the production router code.

What is real and what is modelled:
- warmpath's decisions are made by `router.policy.PrefixAwarePolicy` over a
  `router.index.PrefixIndex`, exactly the objects `router.adapter` drives in
  Ray Serve. The index is fed the way vLLM feeds it: each simulated replica's
  block cache emits `BlockStored` / `BlockRemoved` events (the fields
  `PrefixIndex.apply` reads from vLLM's structs, dispatched on the type name),
  delivered `kv_event_lag_s` after the prefill that produced them. Pending
  placements, the load guard and the scorers all run unchanged.
- baselines are small functions of the same state: pow2 (two random replicas,
  fewer requests wins), round-robin, session-hash (consistent hash ring of 100
  virtual nodes per replica on the session id) and prefix-tree, an
  approximation of Ray's `PrefixCacheAffinityRouter` with its defaults (no load
  threshold, no eviction): the longest prefix any replica was *sent* (not
  cached), the least loaded of those replicas; below a 10% match, the replica
  that was sent the least. It matches whole KV blocks of the rendered prompt
  where Ray matches characters of the message contents.
- a replica is an FCFS queue, a block cache and a cost model (`CostProfile`,
  in `bench.sim_cost` with the CPU and GPU profiles):
  prefill time = overhead + per-token time * uncached prompt tokens, one
  prefill at a time; decode time = tokens * per-token time, either holding the
  replica (`is_decode_blocking`, the CPU engine) or running beside the next
  prefills (continuous batching on a GPU, batch effects folded into the
  per-token time). TTFT = queueing + prefill (the fitted prefill cost holds
  the step that samples the first token); the turn ends one decode step per
  output token but the first after that.
- the block cache (`BlockCache`, in `bench.sim_cache` with the KV events) is
  vLLM's prefix cache reduced to what decides hits: full blocks, hits =
  longest cached leading run (at most all but the last token), LRU eviction
  with a request's blocks freed tail first. Blocks of running requests are
  not pinned. With `is_output_reused`, the blocks of a step's generated
  tokens are cached too (a real agent's next prompt carries the model's own
  output); live runs of the small model do not reuse them.

- loads: routers see each replica's running plus queued requests at the
  instant of the decision (no routing-stats lag) and, for warmpath, the KV
  usage of running requests. Ray Serve's `max_ongoing_requests` backpressure is
  not modelled: the replica's FCFS queue stands in for the router's queue.
- KV events of one replica arrive in the order its cache changed, as on its
  ZMQ stream; the router applies them between decisions, never during one.

Sources: a `Workload` (closed loop: a session's next step is sent its tool
latency after the previous response) or a recorded trace (open loop: requests
at their recorded send times; `reproduce_live_run`).

Ordering: events at equal times run in the order they were scheduled.

Where the parts live: cost profiles in `bench.sim_cost`, the block cache and
its KV events in `bench.sim_cache`, the routers (warmpath and the baselines,
`make_router`) in `bench.sim_routers`. This module runs them: sources,
`Simulation`, `simulate`, the grid and the live-run check.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import multiprocessing
import os
import random
import signal
import sys
import time
from array import array
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Literal, Sequence

from bench.bounds_feed import BoundsFeed, BoundsProcess, SessionBounds
from bench.oracle import OracleBounds
from bench.report import error_line
from bench.sim_cache import BlockCache, BlockRemoved, BlockStored
from bench.sim_cost import CPU_PROFILE, GPU_PROFILE, CostProfile
from bench.sim_routers import POLICIES, SimRequest, WarmpathRouter, make_router
from bench.trace import RequestRecord, TraceSummary, live_replica_slots, summarize
from bench.workload_render import PromptRenderer, SyntheticRenderer
from bench.workloads import Session, Workload, WorkloadName, default_params, generate
from cluster.config import DEFAULT_MODEL_ID, RouterConfig, RouterPolicy
from router.hashing import BlockHash, RequestBlockHashes, reusable_blocks, root_hash


# --- sources --------------------------------------------------------------------------------------


class WorkloadSource:
    """Closed loop over a workload's sessions: each step is sent its tool latency after the previous response."""

    def __init__(self, workload: Workload, renderer: PromptRenderer, max_output_tokens: int | None = None) -> None:
        self._workload = workload
        self._renderer = renderer
        self._max_output_tokens = max_output_tokens

    def arrivals(self) -> Iterable[tuple[float, Session]]:
        """Sessions at their arrival times; one with no steps sends nothing (the generators make none)."""
        return ((s.arrival_s, s) for s in self._workload.sessions if s.steps)

    def request(self, session: Session, step_index: int, arrival_s: float) -> SimRequest:
        step = session.steps[step_index]
        num_output = step.num_output_tokens
        if self._max_output_tokens is not None:
            num_output = min(num_output, self._max_output_tokens)
        return SimRequest(
            session_id=session.session_id, step_index=step_index, arrival_s=arrival_s,
            token_ids=self._renderer.token_ids(session, step_index), num_output_tokens=num_output,
            is_last_of_session=step_index == len(session.steps) - 1, session=session,
        )

    def next_request(self, request: SimRequest, done_s: float) -> SimRequest | None:
        session = request.session
        if session is None or request.is_last_of_session:
            return None
        latency_s = session.steps[request.step_index].tool_latency_s
        return self.request(session, request.step_index + 1, done_s + latency_s)


def trace_requests(records: Sequence[RequestRecord], is_pinned: bool = False) -> list[SimRequest]:
    """Open-loop requests from a recorded trace (successful records with token ids), in send order.

    With `is_pinned`, each request is kept on the replica that served it live (`live_replica_slots`), so
    that the replay tests the cache model on the live run's own placement, not the simulated router's.
    """
    ok = sorted((r for r in records if r.error is None and r.token_ids is not None), key=lambda r: r.send_s)
    last_step: dict[str, int] = {}
    for r in ok:
        last_step[r.session_id] = max(last_step.get(r.session_id, r.step_index), r.step_index)
    slots = live_replica_slots(ok) if is_pinned else {}
    return [
        SimRequest(session_id=r.session_id, step_index=r.step_index, arrival_s=r.send_s, token_ids=r.token_ids,
                   num_output_tokens=r.output_tokens, is_last_of_session=r.step_index == last_step[r.session_id],
                   pinned_replica=slots.get(r.replica_id))
        for r in ok
    ]


# --- the simulation -------------------------------------------------------------------------------

_SESSION, _ARRIVE, _PREFILLED, _DONE, _KV = range(5)


@dataclass(frozen=True)
class SimulationResult:
    records: list[RequestRecord] = field(repr=False)
    replica_ids: list[str]
    summary: TraceSummary
    wall_s: float
    cpu_s: float
    num_decisions_by_route: dict[str, int]
    bounds: OracleBounds | None = None


class Simulation:
    """N replicas, one router, one source; `run` returns one record per request (see module docstring)."""

    def __init__(
        self,
        policy: RouterPolicy,
        num_replicas: int,
        profile: CostProfile,
        seed: int = 0,
        router_config: RouterConfig | None = None,
        model_id: str = DEFAULT_MODEL_ID,
        is_output_reused: bool = True,
        bounds: BoundsFeed | None = None,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        config = router_config or RouterConfig()
        self.profile = profile
        self.num_replicas = num_replicas
        self.is_output_reused = is_output_reused
        self._root = root_hash(model_id, None)
        self.router = make_router(policy, num_replicas, random.Random(seed + 1), config, profile.block_size_tokens,
                                  model_id, profile.kv_capacity_blocks)
        self._caches = [BlockCache(profile.kv_capacity_blocks) for _ in range(num_replicas)]
        self._queues: list[deque[SimRequest]] = [deque() for _ in range(num_replicas)]
        self._is_busy = [False] * num_replicas
        self._num_requests = [0] * num_replicas
        self._num_held_blocks = [0] * num_replicas
        self._last_delivery_s = [0.0] * num_replicas
        self._session_blocks: dict[str, RequestBlockHashes] = {}
        self._events: list = []
        self._seq = itertools.count()
        self.records: list[RequestRecord] = []
        self.bounds = bounds  # fed every request in send order, and every cached response

    def _push(self, at_s: float, kind: int, item) -> None:
        heapq.heappush(self._events, (at_s, next(self._seq), kind, item))

    def run(
        self,
        source: WorkloadSource | None = None,
        requests: Sequence[SimRequest] = (),
        progress: Callable[[str], None] | None = None,
        progress_every_s: float = 60.0,
    ) -> list[RequestRecord]:
        """Simulates until every request is done.

        Args:
            source: a closed-loop workload source, or None.
            requests: open-loop requests (a trace), sent at their `arrival_s`.
            progress: told how far the run got, every `progress_every_s` of wall time.
            progress_every_s: see `progress`.

        Returns:
            Records in send order.
        """
        if source is not None:
            for at_s, session in source.arrivals():
                self._push(at_s, _SESSION, session)
        for request in requests:
            self._push(request.arrival_s, _ARRIVE, request)
        events, records = self._events, self.records
        next_report_s = time.perf_counter() + progress_every_s
        while events:
            now_s, _, kind, item = heapq.heappop(events)
            if kind == _SESSION:
                self._arrive(source.request(item, 0, now_s), now_s)
            elif kind == _ARRIVE:
                self._arrive(item, now_s)
            elif kind == _PREFILLED:
                self._prefilled(item, now_s)
            elif kind == _DONE:
                self._done(item, now_s, source)
                if progress is not None and time.perf_counter() >= next_report_s:
                    next_report_s = time.perf_counter() + progress_every_s
                    progress(f"{len(records)} requests done, {now_s:.0f} s simulated")
            else:
                replica, batch = item
                self.router.on_kv_events(replica, batch, now_s)
        self.records.sort(key=lambda r: r.send_s)
        return self.records

    def snapshot(self) -> dict[str, int]:
        """Cached blocks per replica (`r0`, `r1`, ...), as the replicas' caches hold them now."""
        return {f"r{i}": len(cache) for i, cache in enumerate(self._caches)}

    def _blocks(self, request: SimRequest) -> RequestBlockHashes:
        """Block hashes of the request's prompt, reusing those of the session's previous request."""
        blocks = RequestBlockHashes(request.token_ids, self.profile.block_size_tokens, self._root)
        previous = self._session_blocks.get(request.session_id)
        if previous is not None:
            blocks.reuse_prefix(previous)
        return blocks

    def _set_load(self, replica: int) -> None:
        usage = self._num_held_blocks[replica] / self.profile.kv_capacity_blocks
        self.router.on_load(replica, self._num_requests[replica], usage)

    def _arrive(self, request: SimRequest, now_s: float) -> None:
        request.record = RequestRecord(request.session_id, request.step_index, request.arrival_s,
                                       prompt_tokens=len(request.token_ids), output_tokens=request.num_output_tokens)
        if request.pinned_replica is not None:  # a replay of where a live run served it
            request.blocks = self._blocks(request)
            replica = request.pinned_replica
        else:
            if not isinstance(self.router, WarmpathRouter):
                request.blocks = self._blocks(request)
            replica = self.router.route(request, now_s)
        if request.blocks is None:  # pragma: no cover - every router sets or receives blocks
            request.blocks = self._blocks(request)
        self._session_blocks[request.session_id] = request.blocks
        if self.bounds is not None:
            self.bounds.observe(request.session_id, request.blocks.hashes(), len(request.token_ids), replica)
        request.replica = replica
        request.record.replica_id = f"r{replica}"
        self._queues[replica].append(request)
        self._num_requests[replica] += 1
        self._set_load(replica)
        if not self._is_busy[replica]:
            self._start(replica, now_s)

    def _start(self, replica: int, now_s: float) -> None:
        queue = self._queues[replica]
        if not queue:
            return
        request = queue.popleft()
        profile = self.profile
        block_size = profile.block_size_tokens
        hashes = request.blocks.hashes()
        cache = self._caches[replica]
        num_cached_blocks = cache.longest_prefix(hashes)
        num_tokens = len(request.token_ids)
        cached = min(num_cached_blocks, reusable_blocks(num_tokens, block_size)) * block_size
        request.record.cached_tokens = cached
        first_new, evicted = cache.use(hashes, num_cached_blocks)
        self._is_busy[replica] = True
        request.num_blocks_held = len(hashes)
        self._num_held_blocks[replica] += len(hashes)
        self._set_load(replica)
        done_s = now_s + profile.prefill_s(num_tokens - cached)
        self._push(done_s, _PREFILLED, request)
        self._publish(replica, hashes, first_new, evicted, request.token_ids, done_s)

    def _publish(self, replica: int, hashes: Sequence[BlockHash], first_new: int, evicted: list[BlockHash],
                 token_ids: array, computed_s: float) -> None:
        """Schedules the KV events of one cache update for delivery after the computation that caused them."""
        if not self.router.wants_kv_events:
            return
        batch: list = []
        dropped_new: list[BlockHash] = []
        if len(hashes) > self.profile.kv_capacity_blocks and evicted:
            # A chain longer than the whole cache evicts some of its own new blocks, after storing them: their
            # removal follows the store, as the cache changed (announced before it, the index kept them).
            new = set(hashes[first_new:])
            dropped_new = [block_hash for block_hash in evicted if block_hash in new]
            evicted = [block_hash for block_hash in evicted if block_hash not in new]
        if evicted:
            batch.append(BlockRemoved(block_hashes=evicted))
        if first_new < len(hashes):
            block_size = self.profile.block_size_tokens
            batch.append(BlockStored(
                block_hashes=list(hashes[first_new:]),
                parent_block_hash=hashes[first_new - 1] if first_new else None,
                token_ids=token_ids[first_new * block_size: len(hashes) * block_size],
                block_size=block_size,
            ))
        if dropped_new:
            batch.append(BlockRemoved(block_hashes=dropped_new))
        if batch:
            # A replica's events reach the router in the order its cache changed (one ZMQ stream each).
            deliver_s = max(computed_s + self.profile.kv_event_lag_s, self._last_delivery_s[replica])
            self._last_delivery_s[replica] = deliver_s
            self._push(deliver_s, _KV, (replica, batch))

    def _prefilled(self, request: SimRequest, now_s: float) -> None:
        profile = self.profile
        # The step that ends the prefill samples the first token (its cost is in the prefill's overhead);
        # each later token is a decode step.
        request.record.ttft_s = now_s - request.arrival_s
        self._push(now_s + profile.decode_s_per_token * max(request.num_output_tokens - 1, 0), _DONE, request)
        if not profile.is_decode_blocking:
            self._is_busy[request.replica] = False
            self._start(request.replica, now_s)

    def _done(self, request: SimRequest, now_s: float, source: WorkloadSource | None) -> None:
        replica = request.replica
        request.record.latency_s = now_s - request.arrival_s
        self.records.append(request.record)
        self._num_requests[replica] -= 1
        self._num_held_blocks[replica] -= request.num_blocks_held
        self._set_load(replica)
        if self.profile.is_decode_blocking:
            self._is_busy[replica] = False
            self._start(replica, now_s)
        following = source.next_request(request, now_s) if source is not None else None
        if following is not None:
            if self.is_output_reused:
                self._cache_output(request, following, now_s)
            self._push(following.arrival_s, _ARRIVE, following)
        elif request.is_last_of_session:
            self._session_blocks.pop(request.session_id, None)
            if self.bounds is not None:
                self.bounds.end(request.session_id)

    def _cache_output(self, request: SimRequest, following: SimRequest, now_s: float) -> None:
        """Caches the blocks of the generated tokens: the part of the next prompt they cover.

        Only when the next prompt extends this one (not across a compression).
        """
        num_prompt = len(request.token_ids)
        if following.token_ids[:num_prompt] != request.token_ids:
            return
        # The last sampled token is never fed back, so the engine holds no KV for it.
        covered = min(num_prompt + max(request.num_output_tokens - 1, 0), len(following.token_ids))
        blocks = RequestBlockHashes(following.token_ids[:covered], self.profile.block_size_tokens, self._root)
        blocks.reuse_prefix(request.blocks)
        hashes = blocks.hashes()
        if len(hashes) <= len(request.blocks.computed):
            return
        first_new, evicted = self._caches[request.replica].use(hashes)
        self._publish(request.replica, hashes, first_new, evicted, following.token_ids, now_s)
        if self.bounds is not None:
            self.bounds.cache(request.session_id, hashes)


def simulate(
    policy: RouterPolicy,
    num_replicas: int,
    profile: CostProfile,
    workload: Workload | None = None,
    requests: Sequence[SimRequest] = (),
    renderer: PromptRenderer | None = None,
    seed: int = 0,
    router_config: RouterConfig | None = None,
    model_id: str = DEFAULT_MODEL_ID,
    is_output_reused: bool = True,
    max_output_tokens: int | None = None,
    with_bounds: bool = False,
    progress: Callable[[str], None] | None = None,
    bounds_process: bool = False,
) -> SimulationResult:
    """Runs one policy on one workload (closed loop) or one trace (open loop).

    Args:
        policy: routing policy.
        num_replicas: replicas simulated.
        profile: cost model and KV capacity.
        workload: sessions to run; or None with `requests`.
        requests: open-loop requests (`trace_requests`).
        renderer: token ids of workload steps (default `SyntheticRenderer`).
        seed: seeds tie-breaking and random choices.
        router_config: warmpath's config (default `RouterConfig()`).
        model_id: roots block hashes.
        is_output_reused: cache generated tokens' blocks (real agents: True).
        max_output_tokens: cap on generated tokens per step.
        with_bounds: also compute the oracle bounds of this run's own trace
            (`bench.oracle.StreamingBounds`, replicas of `profile`'s capacity).
        progress: told how far a long run got, about once a minute.
        bounds_process: compute the bounds in a child process, beside the
            simulation (`bench.bounds_feed.BoundsProcess`): same figures, less
            wall time where a core is spare.

    Returns:
        Records, summary and the wall time the simulation took.
    """
    start, start_cpu = time.perf_counter(), time.process_time()
    bounds: BoundsFeed | None = None
    if with_bounds:
        feed = BoundsProcess if bounds_process else SessionBounds
        bounds = feed(profile.block_size_tokens, num_replicas, profile.kv_capacity_blocks)
    sim = Simulation(policy, num_replicas, profile, seed, router_config, model_id, is_output_reused, bounds)
    source = None
    if workload is not None:
        source = WorkloadSource(workload, renderer or SyntheticRenderer(), max_output_tokens)
    # Millions of small, acyclic containers (cache nodes, index entries): the cyclic
    # collector would re-scan them all over and over, for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        records = sim.run(source, [replace(r) for r in requests], progress)
        oracle = bounds.result(len(records)) if bounds is not None else None
    finally:
        if was_enabled:
            gc.enable()
        if bounds is not None:
            bounds.close()
    cpu_s = time.process_time() - start_cpu + (bounds.cpu_s if bounds is not None else 0.0)
    replica_ids = [f"r{i}" for i in range(num_replicas)]
    routes: dict[str, int] = {}
    for r in records:
        if r.route is not None:
            routes[r.route] = routes.get(r.route, 0) + 1
    return SimulationResult(records, replica_ids, summarize(records, replica_ids, profile.block_size_tokens),
                            time.perf_counter() - start, cpu_s, routes, oracle)


# --- grids and the live-run check -----------------------------------------------------------------


@dataclass(frozen=True)
class GridRun:
    """One cell of a simulation grid."""

    workload: str
    num_replicas: int
    policy: str
    num_sessions: int
    num_requests: int | None  # None when the cell failed
    summary: dict | None  # None when the cell failed
    decisions_by_route: dict[str, int]
    wall_s: float
    cpu_s: float
    bounds: dict | None = None
    error: str | None = None  # why the cell failed (`Type: message`), None when it ran

    def to_json(self) -> dict:
        return asdict(self)


class GridInterrupted(KeyboardInterrupt):
    """Ctrl-C during a grid, carrying the runs that finished (grid order) so the caller can still write them."""

    def __init__(self, runs: list[GridRun]) -> None:
        super().__init__()
        self.runs = runs


def available_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def print_progress(message: str) -> None:
    """Progress of a grid cell in a worker process: straight to the inherited stderr."""
    print(f"[simulate] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GridCell:
    """One (workload, replica count, policy) of a grid, with what regenerates its sessions."""

    workload: WorkloadName
    num_replicas: int
    policy: RouterPolicy
    num_sessions: int
    seed: int
    scale: Literal["cpu", "gpu"]

    @property
    def label(self) -> str:
        """How progress lines and failures name the cell: `coding x64 warmpath`."""
        return f"{self.workload} x{self.num_replicas} {self.policy}"


def run_cell(
    cell: GridCell,
    profile: CostProfile,
    base: Workload | None = None,
    progress: Callable[[str], None] = print_progress,
    bounds_process: bool = False,
) -> GridRun:
    """Runs one cell; sessions arrive at the workload's per-replica rate times the replica count.

    Args:
        cell: what to run.
        profile: cost model and KV capacity.
        base: the cell's workload at one replica's rate, if the caller has it (else generated).
        progress: told how far a long run got, prefixed with the cell.
        bounds_process: warmpath's bounds in a child process (see `simulate`).
    """
    params = default_params(cell.workload, cell.scale)
    label = cell.label
    if base is None:
        base = generate_base(cell, lambda msg: progress(f"{label}: {msg}"))
    workload = base.with_arrival_rate(params.sessions_per_s_per_replica * cell.num_replicas)
    result = simulate(cell.policy, cell.num_replicas, profile, workload=workload, seed=cell.seed,
                      with_bounds=cell.policy == "warmpath", progress=lambda msg: progress(f"{label}: {msg}"),
                      bounds_process=bounds_process)
    return GridRun(cell.workload, cell.num_replicas, cell.policy, len(workload.sessions), len(result.records),
                   result.summary.to_json(), result.num_decisions_by_route, result.wall_s, result.cpu_s,
                   result.bounds.to_json() if result.bounds else None)


# Generating a workload of this many sessions or more gets a progress line first: coding's
# 10,000 sessions take about 18 s, so a big grid would otherwise sit silent before its first cell.
GENERATION_PROGRESS_MIN_SESSIONS = 1000


def generate_base(cell: GridCell, progress: Callable[[str], None]) -> Workload:
    """The cell's sessions at one replica's rate; says so first when that takes seconds (a large workload)."""
    if cell.num_sessions >= GENERATION_PROGRESS_MIN_SESSIONS:
        progress(f"generating {cell.num_sessions} {cell.workload} sessions")
    params = default_params(cell.workload, cell.scale)
    return generate(cell.workload, cell.seed, 1, params=params, num_sessions=cell.num_sessions)


def failed_run(cell: GridCell, err: BaseException) -> GridRun:
    """The grid's record of a cell that raised: its coordinates and the error, no figures.

    Why: one cell running out of memory must not lose the cells that finished.
    """
    return GridRun(cell.workload, cell.num_replicas, cell.policy, cell.num_sessions, None, None, {}, 0.0, 0.0,
                   error=error_line(err))


def run_grid(
    workload_names: Sequence[WorkloadName],
    replica_counts: Sequence[int],
    num_sessions: int,
    seed: int = 0,
    policies: Sequence[RouterPolicy] = POLICIES,
    profile: CostProfile = GPU_PROFILE,
    scale: Literal["cpu", "gpu"] = "gpu",
    progress: Callable[[str], None] = lambda _msg: None,
    jobs: int = 1,
    checkpoint: Callable[[list[GridRun]], None] = lambda _runs: None,
) -> list[GridRun]:
    """Every policy on every (workload, replica count), in that order.

    The same sessions (same seed) run at every replica count; only their arrival rate scales
    (the workload's per-replica rate times the replica count).
    warmpath's run also computes the oracle bounds of its own trace, in a
    process of its own when fewer cells run at once than there are cores. Cells
    are independent and deterministic, so `jobs` > 1 runs them in that many
    processes with the same results (each process holds one whole
    simulation: several GB at 10,000 sessions; see `_run_in_processes` for a
    process the kernel kills).

    A cell that raises is returned as a `failed_run` (its `error` set) and the
    others still run. `checkpoint` gets the runs finished so far, in grid
    order, after each cell, so a caller can keep them whatever ends the grid.
    Ctrl-C raises `GridInterrupted` with the runs that finished.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    cells = [GridCell(name, num_replicas, policy, num_sessions, seed, scale)
             for name in workload_names for num_replicas in replica_counts for policy in policies]
    bounds_process = min(jobs, len(cells)) < available_cores()
    done: dict[int, GridRun] = {}

    def finish(position: int, run: GridRun) -> None:
        done[position] = run
        label = cells[position].label
        if run.error is not None:
            progress(f"{label}: FAILED: {run.error}")
        else:
            hit = run.summary["hit_rate"]
            progress(f"{label}: {run.num_requests} requests, hit rate {hit if hit is None else round(hit, 3)}, "
                     f"{run.cpu_s:.1f} CPU-s")
        checkpoint(_in_grid_order(done))

    try:
        if jobs == 1 or len(cells) == 1:
            _run_serially(cells, profile, progress, bounds_process, finish)
        else:
            _run_in_processes(cells, profile, min(jobs, len(cells)), bounds_process, progress, finish)
    except KeyboardInterrupt:
        raise GridInterrupted(_in_grid_order(done)) from None
    return _in_grid_order(done)


def _in_grid_order(done: dict[int, GridRun]) -> list[GridRun]:
    return [done[position] for position in sorted(done)]


def _run_serially(cells: Sequence[GridCell], profile: CostProfile, progress: Callable[[str], None],
                  bounds_process: bool, finish: Callable[[int, GridRun], None]) -> None:
    """The grid in this process, each workload generated once; a failed cell is recorded and the rest run."""
    bases: dict[str, Workload] = {}
    for position, cell in enumerate(cells):
        try:
            if cell.workload not in bases:
                bases[cell.workload] = generate_base(cell, progress)
            run = run_cell(cell, profile, bases[cell.workload], progress, bounds_process)
        except Exception as err:  # MemoryError included: the finished cells are kept
            run = failed_run(cell, err)
        finish(position, run)


def _run_in_processes(cells: Sequence[GridCell], profile: CostProfile, num_processes: int, bounds_process: bool,
                      progress: Callable[[str], None], finish: Callable[[int, GridRun], None]) -> None:
    """The grid in up to `num_processes` worker processes; a failed cell is recorded and the rest run.

    A worker that dies (the kernel's out-of-memory killer, typically: each
    holds a whole simulation) takes the pool down with every cell running in
    it. Cells start only as workers free up, so that loses the cells running
    then, never the queued ones. Which of them died is unknown, so each runs
    again alone: one whose process dies alone is recorded as failed. The rest
    of the grid then runs with one process fewer.
    """
    queue = deque(range(len(cells)))
    while queue:
        lost = _run_pool(cells, queue, profile, num_processes, bounds_process, finish)
        if not lost:
            return
        num_processes = max(1, num_processes - 1)
        progress(f"a simulation process died (out of memory?) running {', '.join(cells[p].label for p in lost)}; "
                 f"running {'it' if len(lost) == 1 else 'each'} again alone"
                 + (f", then the other cells {num_processes} at a time" if queue else ""))
        for position in lost:
            if _run_pool(cells, deque([position]), profile, 1, bounds_process, finish):
                finish(position, failed_run(cells[position], ProcessDied(
                    "its simulation process died, also when it ran alone (killed: out of memory? "
                    "fewer --jobs leave each cell more memory)"
                )))


class ProcessDied(RuntimeError):
    """A grid cell's worker process ended without a result (killed, or crashed in C)."""


def _run_pool(cells: Sequence[GridCell], queue: deque[int], profile: CostProfile, num_processes: int,
              bounds_process: bool, finish: Callable[[int, GridRun], None]) -> list[int]:
    """Runs queued cells in one pool until the queue is empty or a worker died.

    Returns:
        The positions of the cells lost with a dead worker, in grid order (none when the pool held).
    """
    # "spawn": a fresh interpreter per worker, whatever threads the caller has started. Workers ignore a
    # terminal's Ctrl-C, which reaches the whole process group: this process ends them (`_stop_workers`).
    pool = ProcessPoolExecutor(num_processes, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_ignore_interrupts)
    running: dict[Future, int] = {}
    lost: list[int] = []
    try:
        while running or (queue and not lost):
            while queue and not lost and len(running) < num_processes:
                position = queue.popleft()
                future = pool.submit(run_cell, cells[position], profile, None, print_progress, bounds_process)
                running[future] = position
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                position = running.pop(future)
                try:
                    run = future.result()
                except BrokenProcessPool:  # a worker died; every cell in the pool fails with this
                    lost.append(position)
                    continue
                except Exception as err:  # the cell's own error, raised in the worker
                    run = failed_run(cells[position], err)
                finish(position, run)
    except KeyboardInterrupt:
        _stop_workers(pool)
        raise
    finally:
        pool.shutdown(cancel_futures=True)
    return sorted(lost)


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Cancels the cells not started and ends the running ones, so Ctrl-C does not wait minutes for them.

    ProcessPoolExecutor has no public way to end its workers before Python 3.14
    (`terminate_workers`); its `_processes` is what that method ends.
    """
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.terminate()


@dataclass(frozen=True)
class ReproductionCheck:
    """Simulated vs measured hit rate of one live run's trace, in all and request by request.

    Why both: on a workload whose routers' hit rates lie close together (shared-tools:
    pow2 0.85, warmpath 0.91, the bound 0.91) a tolerance of a few points passes
    almost any replay; the share of requests whose simulated cached tokens are within
    one block of vLLM's says whether the replay placed and cached them as the live run did.
    """

    policy: str
    measured_hit_rate: float
    simulated_hit_rate: float
    tolerance: float
    num_requests: int = 0
    num_within_block: int = 0
    # The same replay with each request kept on the replica that served it live: the cache and cost
    # model on the live run's own placement, where the routed replay's random choices (pow2's) differ.
    pinned_hit_rate: float | None = None
    num_pinned_within_block: int = 0

    @property
    def request_agreement(self) -> float | None:
        """Share of the run's successful requests whose simulated cached tokens are within one block of vLLM's."""
        return self.num_within_block / self.num_requests if self.num_requests else None

    @property
    def pinned_request_agreement(self) -> float | None:
        """`request_agreement` of the pinned replay."""
        return self.num_pinned_within_block / self.num_requests if self.num_requests else None

    @property
    def difference(self) -> float:
        return self.simulated_hit_rate - self.measured_hit_rate

    @property
    def is_within_tolerance(self) -> bool:
        return abs(self.difference) <= self.tolerance


def reproduce_live_run(bench: dict, policy: RouterPolicy = "warmpath", tolerance: float = 0.05,
                       seed: int = 0) -> ReproductionCheck:
    """Replays a live run's trace (the JSON `warmpath bench` writes) through the simulator.

    Requests are sent at their recorded times with their recorded token ids and
    output lengths, on the run's replica count, block size and KV capacity, with
    the CPU cost model; generated tokens are not reused (the live prompts carry
    the workload's tool calls, not the model's text).

    Args:
        bench: the parsed JSON of `warmpath bench`.
        policy: which policy's run to replay.
        tolerance: allowed |simulated - measured| hit rate.
        seed: seeds the simulated router's random choices.

    Returns:
        Both hit rates, and how many requests the replay cached within one block of vLLM's count.
    """
    run = bench["policies"][policy]
    records = [RequestRecord.from_json(r) for r in run["records"]]
    measured = run["summary"]["hit_rate"]
    if measured is None:
        raise ValueError(f"the {policy} run has no successful requests")
    if bench.get("kv_capacity_blocks") is None:
        raise ValueError("the run records no KV cache size per replica (the replicas reported none and the "
                         "model's shape gave no estimate), which the replay's caches need")
    profile = replace(CPU_PROFILE, block_size_tokens=bench["block_size_tokens"],
                      kv_capacity_blocks=bench["kv_capacity_blocks"])
    measured_cached = {(r.session_id, r.step_index): r.cached_tokens for r in records if r.error is None}

    def replay(is_pinned: bool) -> tuple[float, int]:
        # A replica replaced during the run served under a new id: pinned, it is one more replica.
        num_replicas = bench["num_replicas"]
        if is_pinned:
            num_replicas = max(num_replicas, len(live_replica_slots(records)))
        result = simulate(policy, num_replicas, profile, requests=trace_requests(records, is_pinned), seed=seed,
                          router_config=RouterConfig.model_validate(bench.get("router_config") or {}),
                          model_id=bench["model_id"], is_output_reused=False)
        num_within_block = sum(
            1 for r in result.records
            if (r.session_id, r.step_index) in measured_cached
            and abs(r.cached_tokens - measured_cached[(r.session_id, r.step_index)]) <= profile.block_size_tokens
        )
        return result.summary.hit_rate or 0.0, num_within_block

    routed_hit_rate, num_within_block = replay(is_pinned=False)
    pinned_hit_rate, num_pinned_within_block = replay(is_pinned=True)
    return ReproductionCheck(policy, measured, routed_hit_rate, tolerance, len(measured_cached), num_within_block,
                             pinned_hit_rate, num_pinned_within_block)


__all__ = [
    "GridInterrupted", "GridRun", "ReproductionCheck", "Simulation", "SimulationResult", "WorkloadSource", "available_cores",
    "reproduce_live_run", "run_grid", "simulate", "trace_requests",
]
