"""warmpath's prefix-aware router on the real 2-replica cluster (KV events from real vLLM engines)."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import pytest

from bench.live import kv_capacity_blocks
from router.prompt_tokens import PromptTokenizer
from tests.integration.test_openai_api import LOOKUP_TOOL, WEATHER_TOOL

pytestmark = pytest.mark.integration

SYSTEM = "\n".join(
    f"Policy {i}: refunds for order ORD-{4000 + i} close on 2026-10-{i % 28 + 1:02d}; limit {i * 37} EUR."
    for i in range(60)
)


@pytest.fixture(scope="module")
def warmpath_router(cluster):
    if cluster.cfg.router.policy != "warmpath":
        pytest.skip("the cluster runs another routing policy")
    return cluster


def _chat(cluster, messages, session_id=None, tools=None, max_tokens=2):
    body = {"model": cluster.model_id, "messages": messages, "max_tokens": max_tokens}
    if tools:
        body["tools"] = tools
    headers = {"x-session-id": session_id} if session_id else {}
    resp = cluster.client.post("/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp


def _tool_conversation(cluster, with_tools: bool) -> dict:
    body = {
        "model": cluster.model_id,
        "messages": [
            {"role": "system", "content": "You help with orders."},
            {"role": "user", "content": "Where is ORD-1234?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup_order", "arguments": "{\"order_id\":\"ORD-1234\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"status\":\"shipped\",\"eta\":\"2026-12-04\"}"},
        ],
    }
    if with_tools:
        body["tools"] = [WEATHER_TOOL, LOOKUP_TOOL]
    return body


def _prefilled_ids(cluster, body: dict) -> list[int]:
    """The prompt token ids the engine prefilled (vLLM returns them under `return_token_ids`)."""
    resp = cluster.client.post(
        "/v1/chat/completions", json={**body, "max_tokens": 1, "return_token_ids": True}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["prompt_token_ids"]


def _router_ids(cluster, body: dict) -> list[int]:
    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest

    return PromptTokenizer(cluster.cfg.model_source()).chat_token_ids(ChatCompletionRequest(**body))


@pytest.mark.parametrize("with_tools", [False, True], ids=["plain", "tools"])
def test_router_tokens_equal_the_engine_tokens(cluster, with_tools):
    body = _tool_conversation(cluster, with_tools)
    # `echo` makes vLLM render the messages itself even when the router forwards its ids.
    assert _router_ids(cluster, body) == _prefilled_ids(cluster, {**body, "echo": True})


def test_the_engine_prefills_the_router_ids_and_renders_what_the_router_cannot(warmpath_router):
    body = _tool_conversation(warmpath_router, with_tools=True)
    assert _prefilled_ids(warmpath_router, body) == _router_ids(warmpath_router, body)
    # Content parts are not forwarded (the router renders text-only messages); the engine renders them.
    parts = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "Where is ORD-1234?"}]}]}
    assert _prefilled_ids(warmpath_router, parts) == _prefilled_ids(warmpath_router, {**parts, "echo": True})


def test_second_turn_goes_where_the_first_went_and_prediction_matches(warmpath_router):
    cluster = warmpath_router
    block = cluster.cfg.replicas.block_size_tokens
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Refund ORD-4007 please."}]
    first = _chat(cluster, messages, session_id="sess-affinity")
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"] or "ok"},
                 {"role": "user", "content": "And ORD-4011?"}]
    second = _chat(cluster, messages, session_id="sess-affinity")
    assert second.headers["x-warmpath-replica"] == first.headers["x-warmpath-replica"]
    assert second.headers["x-warmpath-route"] == "prefix-hit"
    predicted = int(second.headers["x-warmpath-predicted-cached-tokens"])
    actual = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert actual > 0
    assert abs(predicted - actual) <= block, (predicted, actual)


def test_sessions_sharing_a_system_prompt_spread_within_the_load_guard(warmpath_router):
    cluster = warmpath_router
    _chat(cluster, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "warm up"}])

    def session(i: int) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i} about ORD-{4000 + i}"}]
        return _chat(cluster, messages, session_id=f"spread-{i}", max_tokens=24).headers["x-warmpath-replica"]

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        replicas = list(pool.map(session, range(8)))
    counts = {r: replicas.count(r) for r in set(replicas)}
    assert len(counts) == 2, counts
    mean = len(replicas) / 2
    assert max(counts.values()) <= cluster.cfg.router.load_guard_factor * mean + 1, counts


def test_every_routed_response_names_a_reason(warmpath_router):
    resp = _chat(warmpath_router, [{"role": "user", "content": "reason?"}])
    assert resp.headers["x-warmpath-route"] in {"prefix-hit", "session-affinity", "least-loaded", "load-guard", "cold", "fallback"}
    assert int(resp.headers["x-warmpath-predicted-cached-tokens"]) >= 0


def _router_state(cluster) -> dict:
    resp = cluster.client.get("/v1/router", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_router_state_and_prediction_accuracy(warmpath_router):
    cluster = warmpath_router
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "accuracy check"}]
    _chat(cluster, messages, session_id="acc")
    _chat(cluster, messages, session_id="acc")
    state = _router_state(cluster)
    (router,) = [r for r in state["routers"] if r["policy"] == "warmpath"][:1] or [None]
    assert router is not None
    assert len(router["subscribed_replicas"]) == 2
    assert sum(router["index"]["num_blocks_by_replica"].values()) > 0
    # The session is active on the replica its requests went to; idle sessions are only remembered.
    assert router["num_active_sessions"] >= 1 and router["num_remembered_sessions"] >= router["num_active_sessions"]
    assert sum(router["active_sessions_by_replica"].values()) == router["num_active_sessions"]
    assert set(router["active_sessions_by_replica"]) <= set(router["replicas"])
    streams = router["event_streams"]
    assert set(streams) == set(router["subscribed_replicas"])
    assert sum(s["num_batches"] for s in streams.values()) > 0
    assert all(s["num_stalls"] == 0 and s["num_unreachable"] == 0 for s in streams.values()), streams
    # Each replica reports the KV blocks its engine allocated: on CPU, kv_cache_space_gib over the bytes per block.
    assert set(router["kv_cache"]) == set(router["replicas"])
    capacities = {kv_cache["capacity_blocks"] for kv_cache in router["kv_cache"].values()}
    assert capacities == {kv_capacity_blocks(cluster.cfg)} and None not in capacities, router["kv_cache"]
    # The served template renders as the router does: every replica takes its token ids.
    assert router["renders_like_router"] == {replica: True for replica in router["replicas"]}
    stats = state["stats"]
    assert stats["num_predictions"] >= 2
    assert stats["prediction_accuracy"] >= 0.5, stats
    assert set(stats["decisions_by_reason"]) <= {
        "prefix-hit", "session-affinity", "least-loaded", "load-guard", "cold", "fallback"}


def test_streamed_responses_count_toward_prediction_accuracy(warmpath_router):
    cluster = warmpath_router
    before = _router_state(cluster)["stats"]["num_predictions"]
    body = {"model": cluster.model_id, "messages": [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": "streamed"}],
            "max_tokens": 4, "stream": True}
    with cluster.client.stream("POST", "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        frames = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    assert _router_state(cluster)["stats"]["num_predictions"] == before + 1


def test_requests_that_prefill_nothing_or_skip_the_cache_record_no_placement(warmpath_router):
    """/tokenize and prompt-logprob requests must not count as cached prompts for the next request."""
    cluster = warmpath_router
    text = f"placement check {cluster.model_id} " * 60  # a few hundred tokens, several blocks
    before = sum(_router_state(cluster)["stats"]["decisions_by_reason"].values())
    tokens = cluster.client.post("/tokenize", json={"model": cluster.model_id, "prompt": text}, timeout=60)
    assert tokens.status_code == 200, tokens.text
    assert sum(_router_state(cluster)["stats"]["decisions_by_reason"].values()) == before  # no decision made
    logprobs = cluster.client.post("/v1/completions", json={
        "model": cluster.model_id, "prompt": text, "max_tokens": 1, "prompt_logprobs": 1}, timeout=120)
    assert logprobs.status_code == 200, logprobs.text
    assert logprobs.headers.get("x-warmpath-route") is None  # routed by load: no cache is worth aiming at
    assert sum(_router_state(cluster)["stats"]["decisions_by_reason"].values()) == before


def test_a_request_the_engine_refuses_leaves_no_placement(warmpath_router):
    """A prompt over the window is refused before prefill; its prefix must not then count as cached."""
    cluster = warmpath_router
    prompt = f"refused placement {uuid.uuid4().hex} " * 40
    padding = " pad" * (cluster.cfg.model.max_model_len_tokens + 100)
    over = cluster.client.post("/v1/completions", json={
        "model": cluster.model_id, "prompt": prompt + padding, "max_tokens": 1}, timeout=120)
    assert over.status_code == 400, over.text
    follow = cluster.client.post("/v1/completions", json={"model": cluster.model_id, "prompt": prompt, "max_tokens": 1},
                                 timeout=120)
    assert follow.status_code == 200, follow.text
    assert follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert int(follow.headers["x-warmpath-predicted-cached-tokens"]) == 0, follow.headers


def test_a_router_created_later_loads_what_the_replicas_cached_before(warmpath_router, ray_connection):
    """A new handle (here, in the test process) gets its own router, which must not start blind."""
    from ray import serve

    from router import decision_log
    from serve_apps.builders import llm_deployment_name

    cluster = warmpath_router
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "cached before the new router"}]
    served = _chat(cluster, messages).headers["x-warmpath-replica"]
    handle = serve.get_deployment_handle(llm_deployment_name(cluster.cfg), app_name=cluster.cfg.app_name)
    handle.replica_info.remote().result(timeout_s=120)  # the first call creates this process's router
    deadline = time.monotonic() + 120
    while True:  # until its subscription to `served` has loaded the replay buffer (no new events come)
        snapshots = [r.snapshot() for r in list(decision_log.LIVE_ROUTERS)]
        streams = [s["event_streams"].get(served) for s in snapshots]
        if any(stream and stream["last_seq"] is not None for stream in streams):
            break
        assert time.monotonic() < deadline, snapshots
        time.sleep(0.2)
    snapshot = next(s for s, stream in zip(snapshots, streams) if stream and stream["last_seq"] is not None)
    assert snapshot["index"]["num_blocks_by_replica"][served] > 0
    assert snapshot["event_streams"][served]["num_stored_blocks"] > 0


@pytest.mark.disrupts_replicas
def test_killing_a_replica_drops_its_index_and_routing_continues(warmpath_router, ray_connection):
    from cluster import local

    ray = ray_connection
    cluster = warmpath_router
    _chat(cluster, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "before the kill"}])
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "WarmpathLLMServer" in a["name"]]
    assert len(actors) == 2, actors
    victim = actors[0]
    victim_id = victim.rsplit("#", 1)[-1]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    # Every request still gets an answer while Serve replaces the replica.
    served = [_chat(cluster, [{"role": "user", "content": f"after the kill {i}"}]).headers["x-warmpath-replica"] for i in range(4)]
    assert victim_id not in served[-1:]
    state = local.LocalState.load(local.state_dir_of(cluster.cfg))
    deadline = time.monotonic() + 600
    while True:  # the controller reports two RUNNING replicas, none of them the victim
        app = local.serve_details(state)["applications"][cluster.cfg.app_name]
        replicas = [r for name, d in app["deployments"].items() if "WarmpathLLMServer" in name for r in d["replicas"]]
        running = {r["replica_id"] for r in replicas if r["state"] == "RUNNING"}
        if len(running) == 2 and victim_id not in running:
            break
        assert time.monotonic() < deadline, replicas
        time.sleep(1)
    while True:  # the ingress's router learns it through Serve's long poll and the event pump
        router = _router_state(cluster)["routers"][0]
        if set(router["subscribed_replicas"]) == running:
            break
        assert time.monotonic() < deadline, router
        time.sleep(0.5)
    assert victim_id not in router["replicas"]
    assert victim_id not in router["index"]["num_blocks_by_replica"]
    # The replacement rejoins routing once it advertises its event endpoint.
    resp = _chat(cluster, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "after the restart"}])
    assert resp.status_code == 200


def test_a_router_blind_to_a_cached_prefix_learns_it_from_its_own_request(warmpath_router, ray_connection):
    """A prefix cached before a router subscribed (its history held no more) reaches it as orphans: adopted
    from the prompt it placed, with every block before it, from a real engine's events."""
    from ray import serve

    from router.events import ZmqEventSource
    from router.hashing import RequestBlockHashes, root_hash
    from router.index import PrefixIndex
    from serve_apps.builders import llm_deployment_name

    cluster = warmpath_router
    handle = serve.get_deployment_handle(llm_deployment_name(cluster.cfg), app_name=cluster.cfg.app_name)
    endpoints: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while len(endpoints) < cluster.cfg.replicas.num_replicas:  # each call reaches one replica
        info = handle.replica_info.remote().result(timeout_s=120)
        endpoints[info["replica_id"]] = info["kv_events_endpoint"]
        assert time.monotonic() < deadline, endpoints
    system = SYSTEM + f"\nCase {uuid.uuid4()}."
    seeded = _chat(cluster, [{"role": "system", "content": system}, {"role": "user", "content": "seed"}])
    holder = seeded.headers["x-warmpath-replica"]
    block_size = cluster.cfg.replicas.block_size_tokens
    index = PrefixIndex(block_size, 100_000, cluster.model_id)
    sources = {replica: ZmqEventSource(endpoint) for replica, endpoint in endpoints.items()}
    try:
        deadline = time.monotonic() + 120
        while True:  # subscribed: a prompt of its own stored on the holder comes through (the system's came before)
            _chat(cluster, [{"role": "user", "content": f"warm-up {uuid.uuid4()} " * 8}], max_tokens=1)
            if any(sources[holder].poll_batches(256)):
                break
            assert time.monotonic() < deadline
        probe = {"model": cluster.model_id, "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": "probe " * 40}]}
        sibling = {**probe, "messages": [probe["messages"][0], {"role": "user", "content": "another question"}]}
        probe_ids, sibling_ids = _router_ids(cluster, probe), _router_ids(cluster, sibling)
        root = root_hash(cluster.model_id, None)
        blocks = RequestBlockHashes(probe_ids, block_size, root)
        index.note_placed_prompt(holder, blocks, time.monotonic())
        assert _chat(cluster, probe["messages"]).headers["x-warmpath-replica"] == holder  # the prefix is there
        shared = next(i for i, (a, b) in enumerate(zip(probe_ids, sibling_ids)) if a != b) // block_size
        deadline = time.monotonic() + 60
        while index.longest_prefix(blocks.hashes(), time.monotonic()).get(holder, 0) < blocks.num_blocks - 1:
            for _, batch in sources[holder].poll_batches(256):
                index.apply(holder, batch.events)
            assert time.monotonic() < deadline, index.snapshot()
            time.sleep(0.05)
        sibling_blocks = RequestBlockHashes(sibling_ids, block_size, root).hashes()
        assert index.longest_prefix(sibling_blocks, time.monotonic()).get(holder, 0) >= shared > 10
    finally:
        for source in sources.values():
            source.close()
