"""`warmpath bench`: one workload against the real local cluster, once per routing policy.

Order, per policy: redeploy the Serve application with `router.policy` set to
that policy (`cluster.local.up(..., redeploy=True)`), then replay the workload
over HTTP, then read `GET /v1/router`. Redeploying deletes the application
first, so every policy starts on freshly started vLLM engines: prefix caches
empty, router index and statistics empty. The cache reset between policies is
that restart; nothing else clears caches.

Replay: every session is an asyncio task. It waits for its arrival time, then
sends its steps one after another: a streamed chat completion (`"stream":
true`; the server forces `include_usage`, so the last chunk carries vLLM's
`prompt_tokens_details.cached_tokens`), then waits the step's tool latency.
Arrival times and tool latencies are multiplied by `time_scale`. Each prompt
is the workload's (never the model's text), so every policy sees identical
prompts; generation is capped at `max_output_tokens` with `ignore_eos` so every
call decodes the same number of tokens. TTFT is the time from sending the
request to the first streamed chunk that has choices (vLLM sends it after the
prefill and the first token). The x-warmpath-* headers give the replica, and
with warmpath's router the route and predicted cached tokens.

A policy whose run raises (a redeploy that fails, a lost connection) is kept
in the result as `{"error": "Type: message"}` and the next policy runs; Ctrl-C
raises `BenchInterrupted` carrying the policies that finished, so the caller
can still write them.

Rounds: with `rounds` > 1 the policy list runs that many times, each round
starting one policy later in the list (pow2,warmpath then warmpath,pow2, ...)
so no policy always runs first after the warm-up or last on a machine that
slowed down. Why: run-to-run spread on a shared 2-core machine is as large as
the differences between routers (pow2's TTFT p50 moved 0.29-0.45 s between
runs of one build), and a ratio taken within one round, where both policies
ran minutes apart, is steadier than one taken across runs. Round 1 keeps
everything (records, oracle bounds, simulator replay); every round keeps each
policy's summary in `rounds`, and `paired_ratios` (`bench.report`) has the
median and range of each round's ratio to the baseline.

Prompt token ids are rendered before the run with the model's tokenizer and
chat template (`TokenizerRenderer`, identical to what the engines compute),
kept in the trace for the oracle and the simulator, and checked against
vLLM's `usage.prompt_tokens`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

from bench.oracle import oracle_bounds
from bench.report import error_line
from bench.trace import RequestRecord, summarize
from bench.workload_render import TokenizerRenderer, openai_request
from bench.workloads import Workload, WorkloadName, WorkloadParams, default_params, generate
from cluster.api_keys import bearer_headers
from cluster.config import ClusterConfig, RouterPolicy

# Header names set by `serve_apps.ingress_http` (not imported: it pulls in Ray Serve).
REPLICA_HEADER = "x-warmpath-replica"
ROUTE_HEADER = "x-warmpath-route"
PREDICTED_CACHED_HEADER = "x-warmpath-predicted-cached-tokens"
SESSION_HEADER = "x-session-id"  # Ray Serve's session id header (session-hash, warmpath affinity)

DEFAULT_MAX_OUTPUT_TOKENS = 16  # CPU sizes: decode is what routing does not save, so keep it short
GPU_MAX_OUTPUT_TOKENS = 4096  # GPU sizes: each step decodes the workload's own output length
# GPU sizes run this many seconds of session arrivals unless `num_sessions` says otherwise: the
# workloads' 10,000 sessions are a simulation's size, hours of arrivals on a few replicas.
GPU_ARRIVAL_WINDOW_S = 300.0
REQUEST_TIMEOUT_S = 600.0

Progress = Callable[[str], None]


def live_workload(name: WorkloadName, scale: Literal["cpu", "gpu"], seed: int, num_replicas: int,
                  num_sessions: int | None) -> Workload:
    """The workload a live bench replays: `cpu()` sizes, or `gpu()` sizes over `GPU_ARRIVAL_WINDOW_S` of arrivals.

    Why a window at GPU sizes: the per-step sizes are the point (tool results of
    hundreds to thousands of tokens, long contexts); the session count is whatever
    keeps the run to minutes on the replicas at hand.
    """
    params: WorkloadParams = default_params(name, scale)
    if num_sessions is None and scale == "gpu":
        num_sessions = max(1, round(params.sessions_per_s_per_replica * num_replicas * GPU_ARRIVAL_WINDOW_S))
    return generate(name, seed, num_replicas, params=params, num_sessions=num_sessions)


def reported_kv_capacity_blocks(router_state: dict) -> int | None:
    """The smallest KV cache, in blocks, that a replica reported through the prefix-aware router (`/v1/router`).

    None where no router answered (another policy, no request routed yet) or no
    replica reported its size. The smallest, because the placed bound gives every
    replica one capacity: a bound from the largest would be one no router could reach.
    """
    sizes = [
        kv_cache.get("capacity_blocks")
        for router in router_state.get("routers") or []
        for kv_cache in (router.get("kv_cache") or {}).values()
    ]
    sizes = [size for size in sizes if isinstance(size, int) and size > 0]
    return min(sizes) if sizes else None


def kv_capacity_blocks(cfg: ClusterConfig) -> int | None:
    """KV blocks per replica of a CPU cluster: `kv_cache_space_gib` over the model's bytes per block.

    The estimate for when the replicas report no size (`bench_kv_capacity`); the
    same division vLLM's CPU engine makes. Reads the model's config (layers, KV
    heads, head size, dtype): `config.json` of a folder, or the hub's through
    transformers' cache. Returns None on GPU, where the engine sizes its cache from
    free memory at start-up, and where the config cannot be read or has no plain
    attention shape.
    """
    if cfg.replicas.accelerator != "cpu":
        return None
    try:
        model_config = _model_config(cfg.model_source())
        num_heads = model_config["num_attention_heads"]
        head_dim = model_config.get("head_dim") or model_config["hidden_size"] // num_heads
        num_kv_heads = model_config.get("num_key_value_heads") or num_heads
        bytes_per_token = 2 * model_config["num_hidden_layers"] * num_kv_heads * head_dim * _kv_bytes_per_element(cfg)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return (cfg.replicas.kv_cache_space_gib << 30) // (bytes_per_token * cfg.replicas.block_size_tokens)


def _kv_bytes_per_element(cfg: ClusterConfig) -> int:
    """Bytes of one cached key or value element, as vLLM picks them: `kv_cache_dtype`, else the model's dtype,
    which `dtype: auto` (the default) takes from the checkpoint but for float32, run in 16 bits."""
    engine = cfg.replicas.engine_kwargs
    kv_dtype = str(engine.get("kv_cache_dtype") or "auto")
    if kv_dtype.startswith("fp8"):
        return 1
    if kv_dtype in ("bfloat16", "float16", "half"):
        return 2
    dtype = str(engine.get("dtype") or "auto")
    return 4 if dtype in ("float32", "float") else 2


def _model_config(source: str) -> dict:
    """The model's `config.json` as a dict, from a folder or (transformers' cache of) the hub."""
    folder = Path(source)
    if folder.is_dir():
        return json.loads((folder / "config.json").read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source).to_dict()


def bench_kv_capacity(cfg: ClusterConfig, router_state: dict, progress: Progress) -> tuple[int | None, str | None]:
    """The KV blocks per replica for the oracle's placed bound, and where the figure came from.

    The replicas' own (what their engines allocated at start-up, from `router_state`);
    otherwise, on CPU, `kv_capacity_blocks`'s estimate from the model's shape;
    otherwise none, and the bench reports the infinite-cache bound alone.
    """
    reported = reported_kv_capacity_blocks(router_state)
    if reported is not None:
        progress(f"bench: the replicas' KV caches hold {reported} blocks each (as their engines report)")
        return reported, "replicas"
    if cfg.router.policy != "warmpath":
        why = f"router.policy={cfg.router.policy}: no prefix-aware router to report it"
    else:
        why = f"GET /v1/router: {router_state['error']}" if router_state.get("error") else "none reported"
    estimated = kv_capacity_blocks(cfg)
    if estimated is not None:
        progress(f"bench: no KV cache size from the replicas ({why}); {estimated} blocks each from the model's "
                 "shape and replicas.kv_cache_space_gib")
        return estimated, "model config"
    progress(f"bench: no KV cache size from the replicas ({why}), and none can be worked out for "
             f"{cfg.model_source()} on {cfg.replicas.accelerator}: the infinite-cache bound alone")
    return None, None


def router_state(http_url: str, api_key: str | None) -> dict:
    """`GET /v1/router`, or `{"error": ...}` where it could not be read."""
    import httpx

    try:
        return httpx.get(f"{http_url}/v1/router", timeout=30, headers=bearer_headers(api_key)).json()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


@dataclass(frozen=True)
class PreparedRequest:
    """One step's HTTP body and the token ids the engine will compute for it."""

    session_id: str
    step_index: int
    body: dict
    token_ids: object
    tool_latency_s: float


def prepare_requests(workload: Workload, renderer: TokenizerRenderer, model_id: str,
                     max_output_tokens: int) -> dict[str, list[PreparedRequest]]:
    """Bodies and token ids of every step, per session (rendered before the timed run)."""
    out: dict[str, list[PreparedRequest]] = {}
    for session in workload.sessions:
        steps = []
        for k, step in enumerate(session.steps):
            messages, tools = openai_request(session, k)
            body = {
                "model": model_id, "messages": messages, "tools": tools, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True,
                "max_tokens": max(1, min(step.num_output_tokens, max_output_tokens)),
            }
            steps.append(PreparedRequest(session.session_id, k, body, renderer.chat_token_ids(messages, tools),
                                         step.tool_latency_s))
        out[session.session_id] = steps
    return out


class WorkloadTooLong(ValueError):
    """A workload's longest call (prompt and output) does not fit the model's context window."""


def _check_window(prepared: dict[str, list[PreparedRequest]], window_tokens: int, name: WorkloadName,
                  scale: str) -> None:
    """Raises `WorkloadTooLong` before the run when a call would not fit the window.

    Why before: the engines would refuse those calls one by one (HTTP 400), and every
    policy would be measured on a workload with its longest sessions cut short.
    """
    longest = max((len(r.token_ids) + r.body["max_tokens"] for steps in prepared.values() for r in steps), default=0)
    if longest > window_tokens:
        raise WorkloadTooLong(
            f"the longest {name} call at {scale.upper()} sizes needs {longest} tokens (prompt and output), over "
            f"model.max_model_len_tokens={window_tokens}: serve a model with a longer window"
            + (", or use --scale cpu" if scale == "gpu" else "")
        )


async def _send(client, url: str, prepared: PreparedRequest, start_s: float) -> RequestRecord:
    record = RequestRecord(prepared.session_id, prepared.step_index, time.monotonic() - start_s,
                           prompt_tokens=len(prepared.token_ids), token_ids=prepared.token_ids)
    sent = time.monotonic()
    try:
        async with client.stream("POST", url, json=prepared.body,
                                 headers={SESSION_HEADER: prepared.session_id}) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            record.replica_id = response.headers.get(REPLICA_HEADER)
            record.route = response.headers.get(ROUTE_HEADER)
            predicted = response.headers.get(PREDICTED_CACHED_HEADER)
            record.predicted_cached_tokens = int(predicted) if predicted is not None else None
            usage = None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:300]}"
                    return record
                if chunk.get("choices") and record.ttft_s is None:
                    record.ttft_s = time.monotonic() - sent
                if chunk.get("usage"):
                    usage = chunk["usage"]
            record.latency_s = time.monotonic() - sent
    except Exception as err:  # a failed request is recorded, never fatal to the run
        record.error = f"{type(err).__name__}: {err}"
        return record
    finally:
        if record.latency_s is None:  # failed: how long it was in flight (`sim_cost.alone_in_flight` reads it)
            record.latency_s = time.monotonic() - sent
    if usage is None:
        record.error = "no usage in the stream"
        return record
    details = usage.get("prompt_tokens_details") or {}
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.cached_tokens = int(details.get("cached_tokens") or 0)
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    return record


async def replay(base_url: str, workload: Workload, prepared: dict[str, list[PreparedRequest]],
                 time_scale: float, api_key: str | None) -> list[RequestRecord]:
    """Runs every session of `workload` concurrently against `base_url`; returns records in send order."""
    import httpx

    url = f"{base_url}/v1/chat/completions"
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=len(workload.sessions) + 8, max_keepalive_connections=len(workload.sessions))
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, headers=bearer_headers(api_key)) as client:
        start_s = time.monotonic()

        async def run_session(session) -> None:
            await asyncio.sleep(max(0.0, start_s + session.arrival_s * time_scale - time.monotonic()))
            for request in prepared[session.session_id]:
                record = await _send(client, url, request, start_s)
                records.append(record)
                if record.error is not None:
                    return  # the session's later prompts assume this step succeeded
                if request.tool_latency_s:
                    await asyncio.sleep(request.tool_latency_s * time_scale)

        await asyncio.gather(*(run_session(s) for s in workload.sessions))
    records.sort(key=lambda r: r.send_s)
    return records


def _replica_ids(state, app_name: str, seen: set[str], num_replicas: int) -> list[str]:
    """Every LLM replica of the run (those that served nothing count in the imbalance)."""
    from cluster import local

    ids = set(seen)
    try:
        for deployment in local.serve_details(state)["applications"][app_name]["deployments"].values():
            deployment_ids = {r["replica_id"] for r in deployment.get("replicas", [])}
            if deployment_ids & seen:
                ids |= deployment_ids
    except Exception:
        pass  # the records still name every replica that served something
    out = sorted(ids)
    out += [f"unseen-{i}" for i in range(num_replicas - len(out))]
    return out


WARMUP_SESSIONS = 2


def warm_up(cfg: ClusterConfig, workload: Workload, prepared: dict[str, list[PreparedRequest]],
            time_scale: float, progress: Progress) -> dict:
    """Replays a few sessions, unmeasured, before the first policy; returns the router state after them.

    Why: a freshly started Ray cluster is slower for its first minutes; without
    this the first policy of every run was measured at a disadvantage (its TTFT
    p50 came out 1.45x pow2 run first, 1.05x run second). The router state
    carries the replicas' KV cache sizes (`bench_kv_capacity`).
    """
    from cluster import local

    sessions = workload.sessions[:WARMUP_SESSIONS]
    progress(f"bench: warming up the cluster with {len(sessions)} unmeasured sessions")
    state = local.up(cfg, progress)
    api_key = local.local_api_key(cfg)
    asyncio.run(replay(state.http_url, dataclasses.replace(workload, sessions=sessions), prepared, time_scale, api_key))
    return router_state(state.http_url, api_key)


def run_policy(cfg: ClusterConfig, policy: RouterPolicy, workload: Workload,
               prepared: dict[str, list[PreparedRequest]], time_scale: float, progress: Progress) -> dict:
    """Redeploys with `policy`, replays the workload, and returns the run's records, summary and router state."""
    from cluster import local

    policy_cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={"policy": policy})})
    progress(f"bench: redeploying with router.policy={policy} (fresh engines, empty caches)")
    state = redeploy(policy_cfg, progress)
    progress(f"bench: {policy}: replaying {len(workload.sessions)} sessions ({workload.num_requests} requests)")
    started = time.monotonic()
    api_key = local.local_api_key(cfg)
    records = asyncio.run(replay(state.http_url, workload, prepared, time_scale, api_key))
    wall_s = time.monotonic() - started
    routers = router_state(state.http_url, api_key)
    seen = {r.replica_id for r in records if r.replica_id}
    replica_ids = _replica_ids(state, cfg.app_name, seen, cfg.replicas.num_replicas)
    summary = summarize(records, replica_ids, cfg.replicas.block_size_tokens)
    # Rendered ids that differ in length from vLLM's count would make the oracle and the
    # simulator replay other prompts than the engines saw.
    mismatches = sum(1 for r in records if r.error is None and len(r.token_ids) != r.prompt_tokens)
    hit_rate = summary.hit_rate if summary.hit_rate is None else round(summary.hit_rate, 3)
    progress(f"bench: {policy}: {summary.num_requests} ok, {summary.num_errors} failed, hit rate {hit_rate}, "
             f"{wall_s:.0f}s" + (f", {mismatches} prompt token mismatches" if mismatches else ""))
    return {"summary": summary.to_json(), "wall_s": wall_s, "replica_ids": replica_ids,
            "num_prompt_token_mismatches": mismatches, "router_state": routers,
            "records": [r.to_json() for r in records]}


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during the policies, carrying the result of those that finished (marked `interrupted`)."""

    def __init__(self, result: dict) -> None:
        super().__init__()
        self.result = result


def failures(result: dict) -> list[str]:
    """`policy: error` for every part of the result that failed: a policy's run, its bounds, its replay check,
    and (`round N policy: error`) a run of a later round."""
    failed = [f"{policy}: {part['error']}"
              for key in ("policies", "oracle", "simulator_check")
              for policy, part in result.get(key, {}).items() if part.get("error")]
    for number, round_ in enumerate(result.get("rounds", [])[1:], start=2):
        failed += [f"round {number} {policy}: {run['error']}" for policy, run in round_["runs"].items()
                   if run.get("error")]
    if result.get("restore_error"):
        failed.append(f"redeploying the configured policy: {result['restore_error']}")
    return failed


def round_order(policies: Sequence[RouterPolicy], round_index: int) -> list[RouterPolicy]:
    """The policies of round `round_index` (0-based): the list rotated to start `round_index` places later."""
    shift = round_index % len(policies) if policies else 0
    return [*policies[shift:], *policies[:shift]]


@dataclasses.dataclass(frozen=True)
class PreparedWorkload:
    """A workload rendered for the cluster's model and checked against its window: what a run sends."""

    name: WorkloadName
    scale: Literal["cpu", "gpu"]
    workload: Workload
    requests: dict[str, list[PreparedRequest]]
    max_output_tokens: int


def prepare_workload(
    cfg: ClusterConfig,
    workload_name: WorkloadName,
    seed: int,
    num_sessions: int | None,
    progress: Progress,
    max_output_tokens: int | None = None,
    scale: Literal["cpu", "gpu"] = "cpu",
) -> PreparedWorkload:
    """Renders a workload with the model's tokenizer and checks that every call fits the model's window.

    Separate from `run_bench` so that a bench of several workloads checks them all before any
    cluster work (`bench --workload all`).

    Raises:
        WorkloadTooLong: a call would not fit the model's window.
    """
    workload = live_workload(workload_name, scale, seed, cfg.replicas.num_replicas, num_sessions)
    if max_output_tokens is None:
        max_output_tokens = GPU_MAX_OUTPUT_TOKENS if scale == "gpu" else DEFAULT_MAX_OUTPUT_TOKENS
    renderer = _renderer(cfg, progress)
    progress(f"bench: rendering {workload.num_requests} prompts of {workload_name} with the model's tokenizer")
    prepared = prepare_requests(workload, renderer, cfg.model.model_id, max_output_tokens)
    _check_window(prepared, cfg.model.max_model_len_tokens, workload_name, scale)
    return PreparedWorkload(workload_name, scale, workload, prepared, max_output_tokens)


def run_bench(
    cfg: ClusterConfig,
    workload_name: WorkloadName,
    policies: Sequence[RouterPolicy],
    seed: int,
    num_sessions: int | None,
    time_scale: float,
    progress: Progress,
    max_output_tokens: int | None = None,
    rounds: int = 1,
    checkpoint: Callable[[dict], None] = lambda _result: None,
    scale: Literal["cpu", "gpu"] = "cpu",
    prepared_workload: PreparedWorkload | None = None,
) -> dict:
    """Runs one workload under every policy on the local cluster, then the oracle bounds of each trace.

    Args:
        cfg: the cluster config (the policy is overridden per run).
        workload_name: which workload.
        policies: routing policies, each run once on fresh replicas.
        seed: workload seed.
        num_sessions: overrides the workload's session count (`live_workload`).
        time_scale: multiplies arrival times and tool latencies (finite, > 0).
        progress: one line per step.
        max_output_tokens: generation cap per call (default: 16 at CPU sizes, the workload's own at GPU sizes).
        rounds: times the policy list runs, rotated each round (module docstring); >= 1.
        checkpoint: gets the result so far after each policy of the first round and after each round.
        scale: the workload's sizes, `cpu()` (2 CPU replicas of the small model) or `gpu()` (`live_workload`).
        prepared_workload: the workload `prepare_workload` rendered with these arguments (else rendered here).

    Returns:
        The result document `bench.report` prints, plots and `bench.simulator.reproduce_live_run` reads;
        a policy that failed has only an `error` (see `failures`). With `rounds` > 1 it also holds
        `rounds` (each round's order and per-policy summaries) and `paired_ratios`.

    Raises:
        WorkloadTooLong: a call would not fit the model's window (before any cluster work).
        BenchInterrupted: Ctrl-C after the warm-up, with the policies that finished.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if prepared_workload is None:
        prepared_workload = prepare_workload(cfg, workload_name, seed, num_sessions, progress, max_output_tokens, scale)
    workload, prepared = prepared_workload.workload, prepared_workload.requests
    max_output_tokens = prepared_workload.max_output_tokens
    result = {
        "kind": "warmpath-bench",
        "workload": workload_name,
        "scale": scale,
        "workload_params": dataclasses.asdict(workload.params),
        "seed": seed,
        "num_sessions": len(workload.sessions),
        "num_requests": workload.num_requests,
        "time_scale": time_scale,
        "max_output_tokens": max_output_tokens,
        "model_id": cfg.model.model_id,
        "num_replicas": cfg.replicas.num_replicas,
        "block_size_tokens": cfg.replicas.block_size_tokens,
        "kv_capacity_blocks": None,
        "kv_capacity_source": None,
        "router_config": cfg.router.model_dump(mode="json"),
        "policies": {},
        "oracle": {},
        "simulator_check": {},
    }
    if rounds > 1:
        result["rounds"] = []
    capacity, result["kv_capacity_source"] = bench_kv_capacity(
        cfg, warm_up(cfg, workload, prepared, time_scale, progress), progress
    )
    result["kv_capacity_blocks"] = capacity
    try:
        for policy in policies:
            _run_and_bound(result, cfg, policy, workload, prepared, time_scale, capacity, progress)
            checkpoint(result)
        if rounds > 1:
            _record_round(result, policies, {p: result["policies"][p] for p in policies})
            checkpoint(result)
            for round_index in range(1, rounds):
                _run_round(result, cfg, round_order(policies, round_index), workload, prepared, time_scale,
                           progress, f"round {round_index + 1} of {rounds}")
                checkpoint(result)
        last_policy = round_order(policies, rounds - 1)[-1] if policies else cfg.router.policy
        last_run = (result["rounds"][-1]["runs"] if rounds > 1 else result["policies"]).get(last_policy, {})
        # The configured policy run last left the cluster as configured, unless its run failed (its redeploy).
        if last_policy != cfg.router.policy or last_run.get("error"):
            _restore_configured_policy(result, cfg, progress)
        if capacity is not None and cfg.replicas.accelerator == "cpu":
            _check_simulator(result, progress)
    except KeyboardInterrupt:
        result["interrupted"] = True
        raise BenchInterrupted(result) from None
    return result


def _renderer(cfg: ClusterConfig, progress: Progress) -> TokenizerRenderer:
    """The model's tokenizer, building the default model first if it is missing (as `warmpath up` would).

    Raises:
        cluster.local.BringUpError: a model folder that is not there, or a tokenizer that cannot be loaded
            (a hub id out of reach, say) or has no chat template, in one line.
    """
    from cluster import local

    local.ensure_model(cfg, progress)
    try:
        renderer = TokenizerRenderer(cfg.model_source())
    except (OSError, ValueError) as err:
        raise local.BringUpError(f"cannot load the tokenizer of {cfg.model_source()}: {error_line(err)}") from None
    try:  # a tokenizer without a chat template failed later, rendering the workload, with a traceback
        renderer.chat_token_ids([{"role": "user", "content": "hello"}], [])
    except ValueError as err:
        raise local.BringUpError(f"cannot render chat prompts with the tokenizer of {cfg.model_source()}: "
                                 f"{error_line(err)}") from None
    return renderer


def redeploy(cfg: ClusterConfig, progress: Progress):
    """Redeploys the Serve application as `cfg` says (fresh engines); returns `cluster.local.up`'s state."""
    from cluster import local

    return local.up(cfg, progress, redeploy=True)


def _restore_configured_policy(result: dict, cfg: ClusterConfig, progress: Progress) -> None:
    """Leaves the cluster routing as its config says, not with the policy the bench ran last.

    Why: the cluster is the user's, and the default policy list ends with prefix-tree; traffic sent
    after a bench would otherwise go through a baseline router. A failed redeploy is recorded
    (`restore_error`, listed by `failures`), not raised: the figures are already measured.
    """
    progress(f"bench: redeploying with the configured router.policy={cfg.router.policy}")
    try:
        redeploy(cfg, progress)
    except Exception as err:
        result["restore_error"] = error_line(err)
        progress(f"bench: the configured policy could not be redeployed: {result['restore_error']}")


def _record_round(result: dict, order: Sequence[RouterPolicy], runs: dict[str, dict]) -> None:
    """Appends one round (its order, each policy's summary or error) and recomputes the paired ratios."""
    from bench.report import paired_ratios, warmpath_ttft_over_each

    kept = {p: {"error": run["error"]} if run.get("error") else {"summary": run["summary"], "wall_s": run["wall_s"]}
            for p, run in runs.items()}
    result["rounds"].append({"order": list(order), "runs": kept})
    result["paired_ratios"] = paired_ratios(result["rounds"])
    result["warmpath_ttft_p50_over"] = warmpath_ttft_over_each(result["rounds"])


def _run_round(result: dict, cfg: ClusterConfig, order: Sequence[RouterPolicy], workload: Workload,
               prepared: dict[str, list[PreparedRequest]], time_scale: float, progress: Progress,
               label: str) -> None:
    """Runs a later round into `result["rounds"]`: summaries only; a policy that fails is recorded, the rest run.

    A Ctrl-C keeps the policies of this round that finished (the round is recorded first).
    """
    progress(f"bench: {label}: {', '.join(order)}")

    def labelled(message: str) -> None:
        progress(message.replace("bench: ", f"bench: {label}: ", 1))

    runs: dict[str, dict] = {}
    try:
        for policy in order:
            runs[policy] = _run_or_error(cfg, policy, workload, prepared, time_scale, labelled)
    finally:
        if runs:
            _record_round(result, [p for p in order if p in runs], runs)


def _run_or_error(cfg: ClusterConfig, policy: RouterPolicy, workload: Workload,
                  prepared: dict[str, list[PreparedRequest]], time_scale: float, progress: Progress) -> dict:
    """`run_policy`'s result, or `{"error": "Type: message"}` where it raised (said as a FAILED line).

    Why the catch: a policy that fails (its redeploy, the replay) must not lose
    the policies that finished, nor stop the ones after it.
    """
    try:
        return run_policy(cfg, policy, workload, prepared, time_scale, progress)
    except Exception as err:
        failed = {"error": error_line(err)}
        progress(f"bench: {policy}: FAILED: {failed['error']}")
        return failed


def _run_and_bound(result: dict, cfg: ClusterConfig, policy: RouterPolicy, workload: Workload,
                   prepared: dict[str, list[PreparedRequest]], time_scale: float, capacity: int | None,
                   progress: Progress) -> None:
    """Runs one policy into `result`, with its trace's oracle bounds.

    Without the replicas' KV capacity (GPU engines size their caches at start-up)
    only the infinite-cache bound is computed. A policy that fails keeps its error
    instead of figures (`_run_or_error`).
    """
    run = result["policies"][policy] = _run_or_error(cfg, policy, workload, prepared, time_scale, progress)
    if run.get("error"):
        return
    try:
        records = [RequestRecord.from_json(r) for r in run["records"]]
        bounds = oracle_bounds(records, cfg.replicas.block_size_tokens, cfg.model.model_id,
                               cfg.replicas.num_replicas, capacity)
        result["oracle"][policy] = bounds.to_json()
    except Exception as err:
        result["oracle"][policy] = {"error": error_line(err)}


def _check_simulator(result: dict, progress: Progress) -> None:
    """Replays each finished trace in the simulator with the CPU cost model; a failed replay is recorded.

    The simulated hit rate should land within a few points of the measured one; the report prints both.
    """
    from bench.simulator import reproduce_live_run

    for policy, run in result["policies"].items():
        if run.get("error") or run["summary"]["hit_rate"] is None:
            continue
        try:
            check = reproduce_live_run(result, policy)
        except Exception as err:
            result["simulator_check"][policy] = {"error": error_line(err)}
            progress(f"bench: {policy}: simulator replay FAILED: {result['simulator_check'][policy]['error']}")
            continue
        result["simulator_check"][policy] = {
            "measured_hit_rate": check.measured_hit_rate, "simulated_hit_rate": check.simulated_hit_rate,
            "difference": check.difference, "tolerance": check.tolerance,
            "is_within_tolerance": check.is_within_tolerance, "request_agreement": check.request_agreement,
            "pinned_hit_rate": check.pinned_hit_rate, "pinned_request_agreement": check.pinned_request_agreement,
        }
