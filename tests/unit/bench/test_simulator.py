"""bench.simulator on tiny cases: cache model, production router wiring, oracle agreement, live-run check."""

from __future__ import annotations

import dataclasses
import random
from array import array

import pytest

from bench.oracle import LruBlockCache, oracle_bounds
from bench.report import simulation_report
from bench.sim_cache import BlockCache
from bench.sim_cost import CPU_PROFILE, GPU_PROFILE, fit_cost
from bench.sim_routers import POLICIES, SimRequest
from bench.simulator import (
    Simulation,
    WorkloadSource,
    reproduce_live_run,
    run_grid,
    simulate,
    trace_requests,
)
from bench.trace import RequestRecord, summarize
from bench.workload_render import SyntheticRenderer
from bench.workloads import generate
from cluster.config import DEFAULT_MODEL_ID, RouterConfig
from router.hashing import hash_request_blocks, root_hash

TINY = dataclasses.replace(CPU_PROFILE, block_size_tokens=4, kv_capacity_blocks=10_000)


def _random_chains(rng: random.Random, num_chains: int) -> list[list[str]]:
    """Chains that share prefixes with earlier ones (like sessions over a shared system prompt)."""
    chains: list[list[str]] = []
    for i in range(num_chains):
        base = rng.choice(chains)[: rng.randint(0, 6)] if chains and rng.random() < 0.8 else []
        chains.append(base + [f"{i}-{j}" for j in range(rng.randint(0, 6))])
    return chains


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("capacity", [3, 8, 25])
def test_block_cache_matches_the_reference_lru(seed, capacity):
    rng = random.Random(seed)
    fast, reference = BlockCache(capacity), LruBlockCache(capacity)
    chains = _random_chains(rng, 120)
    for i, chain in enumerate(chains):
        # Chains must be paths of one tree: every block names its whole prefix.
        assert fast.longest_prefix(chain) == reference.longest_prefix(chain)
        _, evicted = fast.use(chain, stamp=i + 1)
        assert evicted == reference.use(chain, i + 1)  # the same blocks, in the same order
        assert len(fast) == len(reference) <= capacity
        assert fast.lru_stamp() == reference.lru_stamp()  # the next to go was last used at the same use
        for earlier in rng.sample(chains[: i + 1], min(5, i + 1)):
            assert fast.longest_prefix(earlier) == reference.longest_prefix(earlier)


def test_block_cache_stamps_come_from_a_shared_clock():
    cache = BlockCache(2)
    assert cache.lru_stamp() is None
    cache.use(["a"], stamp=5)
    cache.use(["b"], stamp=9)
    assert cache.lru_stamp() == 5
    assert cache.use(["c"], stamp=12) == (0, ["a"])
    assert cache.lru_stamp() == 9
    with pytest.raises(ValueError, match="not after"):
        cache.use(["d"], stamp=12)


def test_block_cache_reports_first_new_block():
    cache = BlockCache(100)
    assert cache.use(["a", "b"]) == (0, [])
    assert cache.use(["a", "b", "c", "d"]) == (2, [])
    assert cache.use(["a", "b"]) == (2, [])
    assert cache.longest_prefix(["a", "b", "c", "x"]) == 3


def _tiny_workload(name="shared-tools", num_sessions=4):
    return generate(name, 0, 2, num_sessions=num_sessions)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_is_simulated_once_with_sane_figures(policy):
    workload = _tiny_workload()
    result = simulate(policy, 2, CPU_PROFILE, workload=workload, seed=1)
    assert len(result.records) == workload.num_requests
    assert {(r.session_id, r.step_index) for r in result.records} == {
        (s.session_id, k) for s in workload.sessions for k in range(len(s.steps))
    }
    for r in result.records:
        assert 0 <= r.cached_tokens <= r.prompt_tokens - 1
        assert r.cached_tokens % CPU_PROFILE.block_size_tokens == 0
        assert 0 < r.ttft_s <= r.latency_s
        assert r.replica_id in ("r0", "r1")
    assert 0 < result.summary.hit_rate < 1
    if policy == "warmpath":
        assert all(r.route is not None and r.predicted_cached_tokens is not None for r in result.records)
        assert result.summary.prediction_accuracy is not None
    if policy == "session-hash":
        by_session = {}
        for r in result.records:
            by_session.setdefault(r.session_id, set()).add(r.replica_id)
        assert all(len(replicas) == 1 for replicas in by_session.values())


def test_same_seed_same_simulation():
    workload = _tiny_workload("fanout", 6)
    first = simulate("warmpath", 2, CPU_PROFILE, workload=workload, seed=3)
    again = simulate("warmpath", 2, CPU_PROFILE, workload=workload, seed=3)
    assert [dataclasses.astuple(r) for r in first.records] == [dataclasses.astuple(r) for r in again.records]


# 60: shorter than most prompts, whose chains evict some of their own new blocks as they are stored.
@pytest.mark.parametrize("capacity_blocks", [CPU_PROFILE.kv_capacity_blocks, 300, 60])
def test_warmpath_index_mirrors_the_simulated_caches_through_kv_events(capacity_blocks):
    workload = _tiny_workload("coding", 2)
    profile = dataclasses.replace(CPU_PROFILE, kv_capacity_blocks=capacity_blocks)
    sim = Simulation("warmpath", 2, profile, seed=0)
    sim.run(WorkloadSource(workload, SyntheticRenderer()))
    index = sim.router.index.snapshot(now_s=1e9)  # far future: every pending placement has expired
    cached = sim.snapshot()
    assert sum(cached.values()) > 0
    assert {r: index.num_blocks_by_replica.get(r, 0) for r in cached} == cached
    if capacity_blocks == 300:  # small enough that the caches evict (and the index hears of it)
        prompt_blocks = sum(r.prompt_tokens for r in sim.records) // profile.block_size_tokens
        assert prompt_blocks > 5 * 2 * capacity_blocks
        assert max(cached.values()) == capacity_blocks
    # The caches evict a block's extensions first, as vLLM does, so the index's bisected lookups
    # see what each cache holds.
    renderer, root = SyntheticRenderer(), root_hash(DEFAULT_MODEL_ID, None)
    num_held = 0
    for session in workload.sessions:
        for step in range(len(session.steps)):
            chain = hash_request_blocks(renderer.token_ids(session, step), profile.block_size_tokens, root)
            held = sim.router.index.longest_prefix(chain, 1e9)
            assert held == {f"r{i}": n for i, c in enumerate(sim._caches) if (n := c.longest_prefix(chain))}
            num_held += sum(held.values())
    assert num_held > 0


def test_a_long_run_reports_its_progress():
    messages: list[str] = []
    sim = Simulation("pow2", 2, CPU_PROFILE, seed=0)
    records = sim.run(WorkloadSource(_tiny_workload("coding", 1), SyntheticRenderer()), progress=messages.append,
                      progress_every_s=0.0)
    assert len(messages) == len(records) > 0  # due after every request here
    assert messages[-1].startswith(f"{len(records)} requests done, ")


def _one_replica_trace_records(workload, renderer):
    records = []
    for session in workload.sessions:
        for k in range(len(session.steps)):
            ids = renderer.token_ids(session, k)
            records.append(RequestRecord(session.session_id, k, session.arrival_s + 100.0 * k,
                                         prompt_tokens=len(ids), output_tokens=4, token_ids=ids))
    return records


@pytest.mark.parametrize("policy", POLICIES)
def test_one_big_replica_reaches_the_infinite_cache_oracle(policy):
    # One replica, capacity for everything, FCFS: every request sees exactly the blocks
    # of all requests sent before it, which is the oracle's infinite shared cache.
    records = _one_replica_trace_records(_tiny_workload("fanout", 5), SyntheticRenderer())
    result = simulate(policy, 1, TINY, requests=trace_requests(records), is_output_reused=False)
    bound = oracle_bounds(records, TINY.block_size_tokens, "warmpath-tiny", 1, TINY.kv_capacity_blocks)
    assert result.summary.hit_rate == pytest.approx(bound.infinite_hit_rate)


@pytest.mark.parametrize("is_output_reused", [False, True])
def test_a_run_with_bounds_sees_the_same_cache_as_one_big_replica(is_output_reused):
    # The streaming oracle of a closed-loop run caches what the replicas cache (responses
    # included): with one replica big enough for everything, both bounds equal the run's hit rate.
    result = simulate("warmpath", 1, TINY, workload=_tiny_workload("coding", 3), with_bounds=True,
                      is_output_reused=is_output_reused)
    assert result.bounds is not None and result.bounds.num_requests == len(result.records)
    assert result.bounds.infinite_hit_rate == pytest.approx(result.summary.hit_rate)
    assert result.bounds.placed_hit_rate == pytest.approx(result.summary.hit_rate)


# The live run these traces stand for kept both sessions on one replica: a router configured
# without session-balance (which would spread the two sessions), recorded in the run's JSON.
STICKY = RouterConfig(scorer_weights={"prefix-cache": 1.0, "load": 1.0, "session-affinity": 1.0})


def _fake_bench(records, block_size, measured_hit_rate=None):
    summary = summarize(records, ["a", "b"], block_size).to_json()
    if measured_hit_rate is not None:
        summary["hit_rate"] = measured_hit_rate
    return {
        "num_replicas": 2, "block_size_tokens": block_size, "kv_capacity_blocks": 10_000,
        "model_id": "warmpath-tiny", "router_config": STICKY.model_dump(mode="json"),
        "policies": {"warmpath": {"summary": summary, "records": [r.to_json() for r in records]}},
    }


def test_reproduces_a_live_run_hit_rate_from_its_trace():
    # A live-like trace: two sessions over one 256-token prefix, spaced so that no
    # requests overlap; the "measured" cached tokens are what one warm replica gives.
    rng = random.Random(0)
    prefix = [rng.randrange(8192) for _ in range(256)]
    histories = {s: list(prefix) for s in ("a", "b")}
    records = []
    for step in range(3):
        for j, session in enumerate(("a", "b")):
            histories[session] += [rng.randrange(8192) for _ in range(300)]
            ids = array("I", histories[session])
            records.append(RequestRecord(session, step, 20.0 * (2 * step + j), prompt_tokens=len(ids),
                                         output_tokens=8, token_ids=ids, replica_id="a"))
    bound = oracle_bounds(records, 32, "warmpath-tiny", 1, 10_000)
    measured = bound.infinite_hit_rate  # a sticky single replica, as the live warmpath run placed them
    check = reproduce_live_run(_fake_bench(records, 32, measured), "warmpath", tolerance=0.03)
    assert check.is_within_tolerance, check
    wrong = reproduce_live_run(_fake_bench(records, 32, measured_hit_rate=0.0), "warmpath")
    assert not wrong.is_within_tolerance
    # Request by request: the replay's cached tokens against each record's own count.
    replayed = {(r.session_id, r.step_index): r.cached_tokens
                for r in simulate("warmpath", 2, dataclasses.replace(CPU_PROFILE, block_size_tokens=32),
                                  requests=trace_requests(records), router_config=STICKY,
                                  model_id="warmpath-tiny", is_output_reused=False).records}
    assert any(replayed.values())
    for i, record in enumerate(records):  # half as the replay cached them, half three blocks off
        record.cached_tokens = replayed[(record.session_id, record.step_index)] + (96 if i % 2 else 0)
    check = reproduce_live_run(_fake_bench(records, 32, measured), "warmpath")
    assert (check.num_requests, check.num_within_block, check.request_agreement) == (6, 3, 0.5)


def test_a_pinned_replay_keeps_each_request_where_the_live_run_served_it():
    """The live run moved one session between two replicas (x, y, x): routed again, the replay kept it on
    one replica and described another placement; pinned, it reproduces the live count request by request."""
    rng = random.Random(1)
    history = [rng.randrange(8192) for _ in range(256)]
    records = []
    for step, (replica, cached) in enumerate([("x", 0), ("y", 0), ("x", 544)]):  # x holds step 0's 17 blocks
        history += [rng.randrange(8192) for _ in range(300)]
        ids = array("I", history)
        records.append(RequestRecord("a", step, 20.0 * step, prompt_tokens=len(ids), cached_tokens=cached,
                                     output_tokens=8, token_ids=ids, replica_id=replica))
    assert [r.pinned_replica for r in trace_requests(records, is_pinned=True)] == [0, 1, 0]
    assert [r.pinned_replica for r in trace_requests(records)] == [None, None, None]
    measured = 544 / sum(r.prompt_tokens for r in records)
    check = reproduce_live_run(_fake_bench(records, 32, measured), "warmpath")
    assert check.pinned_hit_rate == pytest.approx(measured)
    assert check.pinned_request_agreement == 1.0
    assert check.simulated_hit_rate > measured + 0.2 and check.request_agreement < 1.0  # routed: kept on one


def test_a_live_run_without_a_kv_cache_size_is_refused_in_words():
    ids = array("I", range(300))
    records = [RequestRecord("a", 0, 0.0, prompt_tokens=300, output_tokens=8, token_ids=ids, replica_id="a")]
    bench = {**_fake_bench(records, 32, 0.5), "kv_capacity_blocks": None}  # a GPU run whose replicas reported none
    with pytest.raises(ValueError, match="records no KV cache size per replica"):
        reproduce_live_run(bench, "warmpath")


def test_grid_runs_every_policy_at_every_replica_count():
    runs = run_grid(["fanout"], [2, 4], num_sessions=6, policies=("warmpath", "pow2"), profile=GPU_PROFILE)
    assert [(r.num_replicas, r.policy) for r in runs] == [(2, "warmpath"), (2, "pow2"), (4, "warmpath"), (4, "pow2")]
    assert all(r.num_requests == runs[0].num_requests for r in runs)
    assert all(len(r.summary["prefill_tokens_by_replica"]) == r.num_replicas for r in runs)
    # warmpath's runs carry the oracle bounds of their own trace, and the report prints them.
    assert [r.bounds is not None for r in runs] == [True, False, True, False]
    assert all(0 < r.bounds["infinite_hit_rate"] <= 1 and r.bounds["num_requests"] == r.num_requests
               for r in runs if r.bounds)
    text = simulation_report([r.to_json() for r in runs])
    assert text.count("of the infinite shared cache") == 2


def test_a_grid_in_parallel_processes_gives_the_serial_results_in_the_same_order():
    kwargs = dict(num_sessions=2, policies=("warmpath", "session-hash"), profile=GPU_PROFILE)
    serial = run_grid(["coding"], [2, 3], **kwargs)
    messages: list[str] = []
    parallel = run_grid(["coding"], [2, 3], progress=messages.append, jobs=2, **kwargs)

    def figures(run):
        return {k: v for k, v in run.to_json().items() if k not in ("wall_s", "cpu_s")}

    assert [figures(r) for r in parallel] == [figures(r) for r in serial]
    assert len(messages) == len(serial) == 4


def test_a_grid_needs_at_least_one_job():
    with pytest.raises(ValueError, match="jobs"):
        run_grid(["fanout"], [2], num_sessions=1, jobs=0)


HAND = dataclasses.replace(CPU_PROFILE, block_size_tokens=4, kv_capacity_blocks=1000, prefill_overhead_s=0.1,
                           prefill_s_per_token=0.01, decode_s_per_token=0.02, is_decode_blocking=True,
                           kv_event_lag_s=0.0)


def _hand_request(session_id: str, step_index: int, arrival_s: float, tokens: list[int], num_output_tokens: int,
                  is_last: bool = True) -> SimRequest:
    return SimRequest(session_id, step_index, arrival_s, array("I", tokens), num_output_tokens, is_last)


def test_ttft_is_the_fitted_prefill_cost_and_each_later_token_one_decode_step():
    """The step that ends a prefill samples the first token: TTFT = overhead + per-token cost, then 4 decode steps."""
    (record,) = simulate("pow2", 1, HAND, requests=[_hand_request("s", 0, 0.0, list(range(1, 10)), 5)]).records
    assert record.ttft_s == pytest.approx(0.1 + 0.01 * 9)
    assert record.latency_s == pytest.approx(0.1 + 0.01 * 9 + 4 * 0.02)


def test_a_fit_of_idle_simulated_records_gives_back_the_profile():
    requests = [_hand_request(f"x{n}", 0, 100.0 * i, [n * 1000 + k for k in range(n)], 5)
                for i, n in enumerate(range(5, 200, 13))]
    fit = fit_cost(simulate("pow2", 1, HAND, requests=requests, is_output_reused=False).records)
    assert (fit.prefill_overhead_s, fit.prefill_s_per_token, fit.decode_s_per_token) == pytest.approx((0.1, 0.01, 0.02))


def test_generated_tokens_cached_for_the_next_step_leave_out_the_last_one():
    """vLLM never computes KV for the last sampled token: a 9-token prompt and 3 output tokens hold 11, 2 blocks of 4."""
    from bench.workloads import Message, Part, Session, SharedToolsParams, Step, Workload

    system, task = Message("system", (Part("sys", 2),)), Message("user", (Part("task", 1),))
    call = Message("assistant", (Part("call", 2),), tool_name="t", call_id="c0")
    result = Message("tool", (Part("res", 20),), call_id="c0")
    session = Session("s0", 0.0, (), ((system, task, call, result),), (Step(0, 2, 3, 1.0), Step(0, 4, 5, 0.0, "final")))
    workload = Workload("shared-tools", 0, SharedToolsParams(), 1.0, (session,))
    renderer = SyntheticRenderer()
    first, following = renderer.token_ids(session, 0), renderer.token_ids(session, 1)
    assert following[: len(first)] == first and len(first) % 4 == 1
    records = simulate("pow2", 1, HAND, workload=workload, renderer=renderer).records
    held = len(first) + 3 - 1
    assert [r.cached_tokens for r in records] == [0, held // 4 * 4]


def test_a_session_without_steps_sends_nothing():
    """A hand-built workload's session with no steps failed the run (IndexError) at its arrival."""
    workload = _tiny_workload("fanout", 2)
    empty = dataclasses.replace(workload.sessions[0], steps=())
    workload = dataclasses.replace(workload, sessions=(empty, *workload.sessions[1:]))
    result = simulate("warmpath", 2, CPU_PROFILE, workload=workload)
    assert result.records and all(r.session_id != empty.session_id for r in result.records)
