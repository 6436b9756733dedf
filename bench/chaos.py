"""`warmpath chaos`: fault scenarios against the running local cluster, and the fate of every turn.

Each scenario runs agent turns over the public HTTP API while it breaks a real
part (a vLLM replica, a replica's engine core, the orchestrator replica, Redis, a
tool, the client's connection), then audits every session's transcript in Redis through the API.
A turn ends in one of three ways:
- completed: the client was told the turn committed (after at most the retries
  a careful client makes: the same request with the same `Idempotency-Key`);
- failed cleanly: the client was told it failed, and the transcript holds no
  trace of it (or, for a turn cut off before any answer, nothing half-written);
- lost: anything else: a turn the client was told committed that the
  transcript lacks, a turn committed twice, or a half-written turn. Must be 0.

Fault injection uses sleeps to land a kill mid-turn; the audit never does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.server
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

from bench.report import error_line
from cluster.api_keys import bearer_headers
from cluster.config import ClusterConfig

Progress = Callable[[str], None]
SCENARIOS = ("replica-kill", "engine-kill", "orchestrator-kill", "redis-restart", "tool-faults", "client-disconnect")
# Statuses after which a careful client sends the same turn again under the same Idempotency-Key.
RETRYABLE_STATUSES = frozenset({409, 500, 502, 503, 504})
RETRY_DEADLINE_S = 180.0
TURN_TIMEOUT_S = 300.0
# A turn sent while Redis is down must fail within this: the store's connection is refused at once (its reply
# timeout is 5 s), and a call waiting longer holds its client, and the orchestrator, on a dead store.
OUTAGE_FAIL_FAST_S = 10.0
# The answer budget of the turns a kill lands among (see `_kill_mid_turn`).
KILL_TURN_OUTPUT_TOKENS = 512


@dataclass
class TurnFate:
    """One turn as the client saw it, then as the audit found it."""

    session_id: str
    content: str
    idempotency_key: str
    status: str = "failed"  # "completed" once the client was told the turn committed
    attempts: int = 0
    last_error: str = ""


@dataclass
class ScenarioResult:
    scenario: str
    num_attempted: int = 0
    num_completed: int = 0
    num_failed_cleanly: int = 0
    num_lost: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # What the scenario promises besides the turns' fates that did not hold (a 503 while Redis is down):
    # like a lost turn, it fails the run.
    broken_promises: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class ChaosClient:
    """The public API as a client with retries sees it."""

    def __init__(self, base_url: str, api_key: Optional[str]) -> None:
        self.http = httpx.Client(base_url=base_url, headers=bearer_headers(api_key), timeout=TURN_TIMEOUT_S)

    def create_session(self, model_id: str, tools: list[dict] | None = None, output_reserve_tokens: int = 32) -> str:
        body = {"model": model_id, "system_prompt": "You are a support agent for ACME. Answer briefly.",
                "tools": tools or [], "limits": {"output_reserve_tokens": output_reserve_tokens, "max_steps_per_turn": 2}}
        resp = self._retrying(lambda: self.http.post("/v1/sessions", json=body))
        resp.raise_for_status()
        return resp.json()["session_id"]

    def send_turn(self, fate: TurnFate, tool_choice: str = "auto", deadline_s: float = RETRY_DEADLINE_S) -> TurnFate:
        """Sends the turn, retrying under its idempotency key until it commits, fails for good, or time runs out."""
        stop_at = time.monotonic() + deadline_s
        while True:
            fate.attempts += 1
            try:
                resp = self.http.post(
                    f"/v1/sessions/{fate.session_id}/messages", headers={"idempotency-key": fate.idempotency_key},
                    json={"content": fate.content, "tool_choice": tool_choice},
                )
            except httpx.HTTPError as err:
                fate.last_error = f"{type(err).__name__}: {err}"
            else:
                body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
                if resp.status_code == 200 and body.get("status") in ("completed", "requires_action", "max_steps"):
                    fate.status = "completed"
                    return fate
                fate.last_error = f"{resp.status_code}: {json.dumps(body.get('error') or body)[:200]}"
                if resp.status_code not in RETRYABLE_STATUSES:
                    return fate
            if time.monotonic() > stop_at:
                return fate
            time.sleep(min(5.0, 0.5 * fate.attempts))

    def transcript(self, session_id: str) -> list[dict]:
        resp = self._retrying(lambda: self.http.get(f"/v1/sessions/{session_id}"))
        resp.raise_for_status()
        return resp.json()["transcript"]

    def _retrying(self, call: Callable[[], httpx.Response]) -> httpx.Response:
        stop_at = time.monotonic() + RETRY_DEADLINE_S
        while True:
            try:
                resp = call()
                if resp.status_code not in RETRYABLE_STATUSES or time.monotonic() > stop_at:
                    return resp
            except httpx.HTTPError:
                if time.monotonic() > stop_at:
                    raise
            time.sleep(1.0)


def turn_in_transcript(messages: list[dict], content: str) -> tuple[int, bool]:
    """How many user messages of the transcript carry `content`, and whether the one turn they start is whole:
    at least one assistant message before the next user message (a later turn's answer is not this one's)."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user" and m.get("content") == content]
    if len(starts) != 1:
        return len(starts), False
    following = messages[starts[0] + 1:]
    next_turn = next((i for i, m in enumerate(following) if m["role"] == "user"), len(following))
    return 1, any(m["role"] == "assistant" for m in following[:next_turn])


def audit(client: ChaosClient, fates: list[TurnFate], result: ScenarioResult) -> ScenarioResult:
    """Classifies every turn against its session's transcript (see the module docstring)."""
    by_session: dict[str, list[TurnFate]] = {}
    for fate in fates:
        by_session.setdefault(fate.session_id, []).append(fate)
    for session_id, session_fates in by_session.items():
        try:
            messages = client.transcript(session_id)
        except httpx.HTTPStatusError as err:
            if err.response.status_code != 404:
                raise
            messages = []  # the session itself is gone: every turn it was told committed is lost
            result.notes.append(f"session {session_id}: gone (404)")
        for fate in session_fates:
            result.num_attempted += 1
            num_starts, is_whole = turn_in_transcript(messages, fate.content)
            if fate.status == "completed" and is_whole:
                result.num_completed += 1
            elif fate.status != "completed" and not num_starts:
                result.num_failed_cleanly += 1
            else:
                result.num_lost += 1
                result.notes.append(
                    f"session {session_id}: turn {fate.content!r} told {fate.status}, found {num_starts} copies "
                    f"({'whole' if is_whole else 'not whole'}); last error {fate.last_error}"
                )
    return result


def _concurrent_turns(client: ChaosClient, fates: list[TurnFate], fault: Callable[[], None], fault_after_s: float,
                      tool_choice: str = "auto") -> int:
    """Runs the turns at once and `fault` after `fault_after_s`; returns how many turns were still running then."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(fates) + 1) as pool:
        futures = [pool.submit(client.send_turn, fate, tool_choice) for fate in fates]
        time.sleep(fault_after_s)  # fault injection: land the fault while turns are in flight
        num_running = sum(not future.done() for future in futures)
        fault()
        for future in futures:
            future.result()
    return num_running


def _fates(client: ChaosClient, cfg: ClusterConfig, num_sessions: int, label: str, **create) -> list[TurnFate]:
    return [
        TurnFate(session_id=client.create_session(cfg.model.model_id, **create), content=f"{label} turn {i}: where is ORD-{40000 + i}?",
                 idempotency_key=str(uuid.uuid4()))
        for i in range(num_sessions)
    ]


def _kill_serve_actor(name_part: str) -> str:
    import ray

    ray.init(address="auto", ignore_reinit_error=True, logging_level="ERROR")
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if name_part in a["name"])
    if not names:
        raise RuntimeError(f"no Serve replica actor matching {name_part!r}")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def _wait_replaced(cfg: ClusterConfig, killed_actor: str) -> None:
    """Waits until Serve runs as many replicas of the killed one's deployment as before, none of them it."""
    _, deployment, victim_id = killed_actor.split("#")[-3:]
    _wait_for_replicas(cfg, deployment, lambda running: victim_id not in running,
                       f"{deployment} did not get its replicas back")


def _running_replicas(cfg: ClusterConfig, deployment_part: str) -> tuple[set[str], int]:
    """The RUNNING replica ids of the deployment whose name holds `deployment_part`, and its target count."""
    from cluster import local

    state = local.LocalState.load(local.state_dir_of(cfg))
    deployments = local.serve_details(state)["applications"][cfg.app_name]["deployments"]
    (details,) = [details for name, details in deployments.items() if deployment_part in name]
    running = {r["replica_id"] for r in details.get("replicas", []) if r["state"] == "RUNNING"}
    return running, details.get("target_num_replicas", 1)


def _wait_for_replicas(cfg: ClusterConfig, deployment_part: str, is_replaced: Callable[[set[str]], bool], what: str,
                       timeout_s: float = 600) -> None:
    """Waits until the deployment runs its target count of replicas and `is_replaced` takes their ids; raises
    TimeoutError saying `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        running, target = _running_replicas(cfg, deployment_part)
        if is_replaced(running) and len(running) >= target:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s: {running}")
        time.sleep(1.0)  # polling Serve's controller, the readiness source


def _kill_mid_turn(scenario: str, actor_part: str, client: ChaosClient, cfg: ClusterConfig, progress: Progress,
                   num_sessions: int) -> ScenarioResult:
    """Kills the first Serve replica actor matching `actor_part` while `num_sessions` turns run, then audits them."""
    result = ScenarioResult(scenario)
    # Answers long enough to be running a second in (the small CPU model answers 32 tokens in well under one).
    fates = _fates(client, cfg, num_sessions, scenario, output_reserve_tokens=KILL_TURN_OUTPUT_TOKENS)
    killed: list[str] = []
    num_running = _concurrent_turns(client, fates, lambda: killed.append(_kill_serve_actor(actor_part)),
                                    fault_after_s=1.0)
    result.notes.append(f"killed {killed[0]} with {num_running} of {len(fates)} turns running")
    if not num_running:  # a kill on an idle cluster tests nothing the scenario claims
        result.broken_promises.append(f"every turn had ended before {killed[0]} was killed, so none ran through it")
    progress(f"chaos: waiting for Serve to replace {killed[0]}")
    _wait_replaced(cfg, killed[0])
    from cluster import local

    # A replica killed hard leaves its vLLM engine processes running (`reap_orphaned_engines`), holding
    # the model and its KV cache beside the replacement's.
    if reaped := local.reap_orphaned_engines():
        result.notes.append(f"stopped {len(reaped)} vLLM engine processes the killed replica left behind")
    return audit(client, fates, result)


def _kill_one_engine() -> int:
    """SIGKILLs one of this user's vLLM engine cores (as the kernel's out-of-memory killer would); returns its pid."""
    import os
    import signal

    from cluster import local

    for pid in sorted(local.processes_titled(lambda title: title.startswith(b"VLLM::EngineCore"))):
        try:
            os.kill(pid, signal.SIGKILL)
            return pid
        except OSError:  # gone meanwhile
            continue
    raise RuntimeError("no vLLM engine core of this user's runs")


def engine_kill(client: ChaosClient, cfg: ClusterConfig, progress: Progress, num_sessions: int = 8) -> ScenarioResult:
    """A replica's engine core dies (killed, out of memory) while its replica lives: the replica must leave at once,
    so the orchestrator's own retry lands on another replica and no client has to send a turn twice."""
    result = ScenarioResult("engine-kill")
    before, _ = _running_replicas(cfg, "WarmpathLLMServer")
    fates = _fates(client, cfg, num_sessions, "engine-kill", output_reserve_tokens=KILL_TURN_OUTPUT_TOKENS)
    killed: list[int] = []
    num_running = _concurrent_turns(client, fates, lambda: killed.append(_kill_one_engine()), fault_after_s=1.0)
    result.notes.append(f"killed engine core pid {killed[0]} with {num_running} of {len(fates)} turns running")
    if not num_running:
        result.broken_promises.append("every turn had ended before the engine was killed, so none ran through it")
    # Sent after the kill, before any replacement: each must land on the live replica at once.
    after = _fates(client, cfg, num_sessions, "engine-kill after")
    for fate in after:
        client.send_turn(fate)
    retried = [fate for fate in fates + after if fate.attempts > 1]
    if retried:
        result.broken_promises.append(
            f"{len(retried)} turns needed the client to send them again (last error: {retried[0].last_error}): the "
            "replica with the dead engine kept taking calls")
    progress("chaos: waiting for Serve to replace the replica whose engine died")
    _wait_for_replicas(cfg, "WarmpathLLMServer", lambda running: running != before,
                       "the replica whose engine died was not replaced")
    from cluster import local

    if reaped := local.reap_orphaned_engines():
        result.notes.append(f"stopped {len(reaped)} vLLM engine processes the replica left behind")
    return audit(client, fates + after, result)


def replica_kill(client: ChaosClient, cfg: ClusterConfig, progress: Progress, num_sessions: int = 20) -> ScenarioResult:
    return _kill_mid_turn("replica-kill", "WarmpathLLMServer", client, cfg, progress, num_sessions)


def orchestrator_kill(client: ChaosClient, cfg: ClusterConfig, progress: Progress, num_sessions: int = 6) -> ScenarioResult:
    return _kill_mid_turn("orchestrator-kill", "Orchestrator", client, cfg, progress, num_sessions)


def redis_restart(client: ChaosClient, cfg: ClusterConfig, progress: Progress, num_sessions: int = 4) -> ScenarioResult:
    """Committed turns survive a Redis restart; while Redis is down calls fail fast with 503, then recover."""
    from cluster import local

    result = ScenarioResult("redis-restart")
    state = local.LocalState.load(local.state_dir_of(cfg))
    if cfg.redis_url or not state.redis_pid:
        result.notes.append("skipped: Redis is not one `warmpath up` started (REDIS_URL is set)")
        return result
    before = _fates(client, cfg, num_sessions, "before-restart")
    for fate in before:
        client.send_turn(fate)
    if not any(fate.status == "completed" for fate in before):
        result.broken_promises.append("no turn committed before the restart, so none could be seen to survive it")
    during = [TurnFate(f.session_id, f.content.replace("before-restart", "during-outage"), str(uuid.uuid4()))
              for f in before]
    try:
        if not local.stop_redis(state, progress, timeout_s=30, data_dir=local.redis_dir_of(cfg)):
            result.broken_promises.append("Redis did not stop, so no outage was tried")
            during = []
        for fate in during:
            started = time.monotonic()
            client.send_turn(fate, deadline_s=0)  # one attempt: it must fail, and fast
            elapsed = time.monotonic() - started
            result.notes.append(f"during outage: {fate.last_error[:60]} in {elapsed:.2f}s")
            if not fate.last_error.startswith("503"):
                result.broken_promises.append(f"a turn while Redis was down got {fate.last_error[:60]!r}, not 503")
            elif elapsed > OUTAGE_FAIL_FAST_S:
                result.broken_promises.append(
                    f"a turn while Redis was down took {elapsed:.1f}s to fail (over {OUTAGE_FAIL_FAST_S:g}s)")
    finally:  # whatever happened, the cluster gets its Redis back
        local.start_redis(cfg, state, progress)
        local.LocalState.save(state, local.state_dir_of(cfg))
    after = [TurnFate(f.session_id, f.content.replace("before-restart", "after-restart"), str(uuid.uuid4()))
             for f in before]
    for fate in after:
        client.send_turn(fate)
    _every_turn_completes(after, "after the restart", result)
    return audit(client, before + during + after, result)


def _every_turn_completes(fates: list[TurnFate], when: str, result: ScenarioResult) -> None:
    """A broken promise unless every one of `fates` completed: the cluster did not recover."""
    if failed := [fate for fate in fates if fate.status != "completed"]:
        result.broken_promises.append(
            f"{len(failed)} of {len(fates)} turns {when} did not complete (last error {failed[0].last_error[:80]!r})")


class _FaultyTools(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server naming
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/hang":
            time.sleep(30)
        status, payload = (500, b"internal error") if self.path == "/fail" else (200, b"\x00\xffnot json")
        try:
            self.send_response(status)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the orchestrator gave up on the hanging call

    def log_message(self, *args):
        pass


def tool_faults(client: ChaosClient, cfg: ClusterConfig, progress: Progress) -> ScenarioResult:
    """A tool that hangs, one that answers 500, one that answers garbage: each turn still completes."""
    result = ScenarioResult("tool-faults")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FaultyTools)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    # A bounded argument (a short pattern) lets grammar-constrained decoding finish the call within the answer budget.
    schema = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{5}$"}},
              "required": ["order_id"], "additionalProperties": False}
    fates = []
    try:
        for path in ("/hang", "/fail", "/garbage"):
            tool = {"name": "lookup_order", "description": "Look up an order.", "parameters": schema,
                    "execution": {"kind": "http", "url": base + path, "timeout_s": 2}}
            session_id = client.create_session(cfg.model.model_id, tools=[tool], output_reserve_tokens=64)
            fate = TurnFate(session_id, f"tool {path}: find ORD-12345", str(uuid.uuid4()))
            started = time.monotonic()
            client.send_turn(fate, tool_choice="required", deadline_s=0)
            results = [m["content"] for m in client.transcript(session_id) if m["role"] == "tool"]
            is_seen = bool(results) and all('"error"' in r for r in results)
            seen = "the model saw an error result" if is_seen else f"NO error result reached the model: {results[:1]}"
            result.notes.append(f"{path}: {fate.status} in {time.monotonic() - started:.1f}s; {seen}")
            if not is_seen:
                result.broken_promises.append(f"{path}: no error result reached the model")
            fates.append(fate)
    finally:
        server.shutdown()
    return audit(client, fates, result)


def client_disconnect(client: ChaosClient, cfg: ClusterConfig, progress: Progress, num_sessions: int = 3) -> ScenarioResult:
    """A streaming client that hangs up after the first event: the turn aborts and commits nothing.

    If the turn had already committed (its `final` or `requires_action` event
    was sent), it stands: the audit accepts either, never a half-written turn.
    """
    result = ScenarioResult("client-disconnect")
    fates = _fates(client, cfg, num_sessions, "disconnect", output_reserve_tokens=128)
    for fate in fates:
        with client.http.stream("POST", f"/v1/sessions/{fate.session_id}/messages",
                                json={"content": fate.content, "stream": True}) as resp:
            is_hung_up = False
            for line in resp.iter_lines():
                if line.startswith("event:"):
                    is_hung_up = resp.status_code == 200
                    break  # hang up after the first event
        if not is_hung_up:  # a refused turn streams no event: the client read it whole and never hung up
            result.broken_promises.append(f"session {fate.session_id}: the turn streamed no event to hang up after "
                                          f"(status {resp.status_code})")
    # A fresh turn on each session must start (the aborted turn released its lock); its fate is audited too.
    followups = [TurnFate(f.session_id, f"after disconnect {i}", str(uuid.uuid4())) for i, f in enumerate(fates)]
    for fate in followups:
        client.send_turn(fate)
    _every_turn_completes(followups, "after the hang-ups", result)
    audited = audit(client, followups, result)
    for fate in fates:  # the abandoned turns: whole or absent, never half
        num_starts, is_whole = turn_in_transcript(client.transcript(fate.session_id), fate.content)
        if num_starts and not is_whole:
            audited.num_lost += 1
            audited.notes.append(f"session {fate.session_id}: abandoned turn half-written")
        else:
            audited.notes.append(f"abandoned turn {'committed' if num_starts else 'aborted'}")
    return audited


RUNNERS = {
    "replica-kill": replica_kill,
    "engine-kill": engine_kill,
    "orchestrator-kill": orchestrator_kill,
    "redis-restart": redis_restart,
    "tool-faults": tool_faults,
    "client-disconnect": client_disconnect,
}


def run_chaos(cfg: ClusterConfig, base_url: str, api_key: Optional[str], scenarios: list[str],
              progress: Progress, on_result: Callable[[list[ScenarioResult]], None] = lambda results: None,
              ) -> list[ScenarioResult]:
    """Runs each scenario in turn; `on_result` gets the results so far after each (a scenario that raises is one
    broken promise, and the others run)."""
    client = ChaosClient(base_url, api_key)
    results = []
    for name in scenarios:
        progress(f"chaos: {name}")
        started = time.monotonic()
        try:
            result = RUNNERS[name](client, cfg, progress)
        except Exception as err:  # noqa: BLE001 - one scenario's failure must not lose the others' results
            result = ScenarioResult(name, broken_promises=[f"the scenario failed: {error_line(err)}"])
        result.wall_s = round(time.monotonic() - started, 1)
        progress(f"chaos: {name}: {result.num_completed}/{result.num_attempted} completed, "
                 f"{result.num_failed_cleanly} failed cleanly, {result.num_lost} lost ({result.wall_s}s)")
        results.append(result)
        on_result(results)
    return results


def report(results: list[ScenarioResult]) -> str:
    rows = [("scenario", "attempted", "completed", "failed cleanly", "lost", "seconds")]
    rows += [(r.scenario, str(r.num_attempted), str(r.num_completed), str(r.num_failed_cleanly), str(r.num_lost),
              f"{r.wall_s:.0f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        lines += [f"{r.scenario}: {note}" for note in r.notes]
        lines += [f"{r.scenario}: BROKEN: {promise}" for promise in r.broken_promises]
    return "\n".join(lines)
