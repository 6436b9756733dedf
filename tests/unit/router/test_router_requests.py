"""router.adapter.PrefixKVRouter inside Ray Serve's request router: which request gets which replica,
what it hands the engine, and where its decision is logged.

A real `PrefixKVRouter` with stand-in replicas; the event pump is stopped and
the tokenizer is a stand-in, so nothing leaves the process.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_events import BlockStored

from cluster.config import RouterConfig
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest
from router import decision_log
from router.adapter import PrefixKVRouter
from router.hashing import hash_request_blocks, root_hash
from router.prompt_tokens import FORWARDED_IDS_KEY, EngineRendering, PromptTokenizer
from router.types import ReplicaId

BS = 4
DEPLOYMENT = DeploymentID(name="llm", app_name="warmpath")


class StandInReplica:
    """A running replica as Serve's router sees it; `answer_probes` holds back its queue-length answers."""

    def __init__(self, name: str, routing_stats: dict | None = None) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats = routing_stats or {}
        self.max_ongoing_requests = 64
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set = set()
        self.is_cross_language = False
        self.answer_probes = asyncio.Event()
        self.answer_probes.set()

    async def get_queue_len(self, deadline_s: float) -> int:
        await self.answer_probes.wait()
        return 0


class TemplateRecorder:
    """Stands in for the HF tokenizer: renders by joining contents, records the template's arguments."""

    def __init__(self) -> None:
        self.template_calls: list[dict] = []

    def apply_chat_template(self, messages, tools=None, tokenize=True, **kwargs):
        self.template_calls.append(kwargs)
        return "|".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


@pytest.fixture
def new_router(monkeypatch):
    """Makes routers whose tokenizer loads nothing and whose event pump is stopped."""
    monkeypatch.setattr(PromptTokenizer, "start_loading", lambda self: None)
    routers: list[PrefixKVRouter] = []

    def make() -> PrefixKVRouter:
        router = PrefixKVRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
        router.initialize_state(router=RouterConfig().model_dump(mode="json"), model_id="m",
                                model_source="unused", block_size_tokens=BS)
        router._pump.is_stopped = True
        router._pump.join(timeout=30)
        # A probe waits as long as a test holds it back, never timing out.
        router.queue_len_response_deadline_s = router.max_queue_len_response_deadline_s = 600.0
        routers.append(router)
        return router

    yield make


def cache_on(router: PrefixKVRouter, replica: str, tokens: list[int], first_hash: int) -> None:
    """Indexes `tokens` (whole blocks) as cached on `replica`."""
    router.index.apply(replica, [BlockStored(
        block_hashes=[(first_hash + i).to_bytes(32, "big") for i in range(len(tokens) // BS)],
        parent_block_hash=None, token_ids=tokens, block_size=BS, lora_id=None, medium="GPU", lora_name=None,
    )])


def pending(body, call_method: str = "completions", request_id: str | None = None) -> PendingRequest:
    metadata = RequestMetadata(request_id=request_id or uuid.uuid4().hex, internal_request_id=uuid.uuid4().hex,
                               call_method=call_method)
    return PendingRequest(args=[body], kwargs={}, metadata=metadata)


def test_each_request_gets_the_replica_chosen_for_its_prefix(new_router):
    """The request whose replica answers its probe first must not hand that replica to an older request."""

    async def route() -> None:
        router = new_router()
        r1, r2 = StandInReplica("R1"), StandInReplica("R2")
        r1.answer_probes.clear()  # R1's queue length comes late (another node, a busy actor)
        router.update_replicas([r1, r2])
        tokens_a, tokens_b = list(range(64)), list(range(1000, 1064))
        cache_on(router, "R1", tokens_a, 0)
        cache_on(router, "R2", tokens_b, 100)
        request_a, request_b = pending(SimpleNamespace(prompt=tokens_a)), pending(SimpleNamespace(prompt=tokens_b))
        routed_a = asyncio.ensure_future(router._choose_replica_for_request(request_a))
        routed_b = asyncio.ensure_future(router._choose_replica_for_request(request_b))
        await asyncio.wait([routed_a, routed_b], return_when=asyncio.FIRST_COMPLETED)
        r1.answer_probes.set()
        got_a, got_b = await routed_a, await routed_b
        assert (got_a.replica_id.unique_id, got_b.replica_id.unique_id) == ("R1", "R2")

    asyncio.run(route())


def test_two_requests_with_one_client_request_id_each_find_their_own_decision(new_router):
    async def route() -> None:
        router = new_router()
        r1, r2 = StandInReplica("R1"), StandInReplica("R2")
        router.update_replicas([r1, r2])
        cache_on(router, "R1", list(range(64)), 0)
        cached = pending(SimpleNamespace(prompt=list(range(64))), request_id="client-id")
        cold = pending(SimpleNamespace(prompt=list(range(5000, 5064))), request_id="client-id")
        await router.choose_replicas([r1, r2], cached)
        await router.choose_replicas([r1, r2], cold)
        assert decision_log.DECISIONS.pop("client-id") is None  # ambiguous: nobody gets another's headers
        got_cold = decision_log.DECISIONS.pop("client-id", cold.metadata.internal_request_id)
        got_cached = decision_log.DECISIONS.pop("client-id", cached.metadata.internal_request_id)
        assert (got_cached.decision.reason, got_cold.decision.reason) == ("prefix-hit", "cold")

    asyncio.run(route())


class StandInRequest(SimpleNamespace):
    """A request's fields; weakly referable, as the requests' pydantic models are (`ForwardedTokenIds`)."""


def chat(content: str = "hi", **fields) -> StandInRequest:
    return StandInRequest(messages=[{"role": "user", "content": content}], kv_transfer_params=None, **fields)


def with_stand_in_tokenizer(router: PrefixKVRouter) -> TemplateRecorder:
    recorder = TemplateRecorder()
    router.tokenizer = PromptTokenizer("unused", load=lambda source: recorder)
    router.tokenizer.load_until_loaded(wait=lambda seconds: True)
    return recorder


@pytest.mark.parametrize(
    ("routing_stats", "is_forwarded"),
    [
        ({}, False),  # the replica has not said how it renders (its first routing stats are still to come)
        (EngineRendering({"enable_thinking": False}, renders_like_router=False).routing_stats(), False),
        (EngineRendering({"enable_thinking": False}, renders_like_router=True).routing_stats(), True),
    ],
)
def test_chat_ids_are_forwarded_only_to_replicas_that_render_as_the_router(new_router, routing_stats, is_forwarded):
    async def route() -> None:
        router = new_router()
        recorder = with_stand_in_tokenizer(router)
        replica = StandInReplica("R1", routing_stats)
        router.update_replicas([replica])
        body = chat("hello")
        await router.choose_replicas([replica], pending(body, "chat"))
        forwarded = (body.kv_transfer_params or {}).get(FORWARDED_IDS_KEY)
        assert forwarded == ([ord(c) for c in "hello"] if is_forwarded else None)
        # The server's template defaults reach the router's rendering wherever the replica advertised them.
        assert recorder.template_calls[-1].get("enable_thinking") is (False if routing_stats else None)

    asyncio.run(route())


@pytest.mark.parametrize(
    "other_rendering",
    [
        EngineRendering({"enable_thinking": False}, renders_like_router=False),  # a server-side template, say
        EngineRendering({"enable_thinking": True}, renders_like_router=True),  # other template defaults
        None,  # its first routing stats are still to come
    ],
    ids=["renders-otherwise", "other-defaults", "not-said-yet"],
)
def test_chat_ids_are_forwarded_only_where_every_candidate_renders_alike(new_router, other_rendering):
    """Serve may send the request to any candidate (the chosen one full), and an engine given ids does not
    render: during a rolling update that changes how replicas render, ids rendered for one version went to
    the other, which ran a prompt it would never have rendered."""
    alike = EngineRendering({"enable_thinking": False}, renders_like_router=True)

    async def route(second: EngineRendering | None):
        router = new_router()
        with_stand_in_tokenizer(router)
        replicas = [StandInReplica("old", alike.routing_stats()),
                    StandInReplica("new", second.routing_stats() if second is not None else {})]
        router.update_replicas(replicas)
        body = chat("hello")
        await router.choose_replicas(replicas, pending(body, "chat"))
        return (body.kv_transfer_params or {}).get(FORWARDED_IDS_KEY)

    assert asyncio.run(route(other_rendering)) is None
    assert asyncio.run(route(alike)) == [ord(c) for c in "hello"]  # a fleet that agrees still gets them


def test_until_the_tokenizer_loads_chat_requests_are_routed_by_load(new_router):
    async def route() -> None:
        router = new_router()
        busy, idle = StandInReplica("busy"), StandInReplica("idle")
        router.update_replicas([busy, idle])
        router._inflight.place("earlier", "busy", time.monotonic(), is_dispatched=True)
        body = chat()
        tiers = await router.choose_replicas([busy, idle], pending(body, "chat"))
        assert [[r.replica_id.unique_id for r in tier] for tier in tiers] == [["idle"], ["busy"]]
        assert body.kv_transfer_params is None and not router._decisions

    asyncio.run(route())


def test_a_burst_routed_by_load_spreads_over_replicas_serve_lists_as_equally_loaded(new_router):
    """Routed by load (no tokenizer yet), each request counts in flight where it goes: a burst whose
    queue lengths Serve had to probe all went to the replica it listed first."""

    async def route() -> None:
        router = new_router()
        replicas = [StandInReplica(name) for name in ("r1", "r2", "r3")]
        router.update_replicas(replicas)
        chosen = []
        for _ in range(6):
            tiers = await router.choose_replicas(replicas, pending(chat(), "chat"))
            chosen.append(tiers[0][0].replica_id.unique_id)
        assert sorted(chosen) == ["r1", "r1", "r2", "r2", "r3", "r3"], chosen
        assert router._inflight.counts(time.monotonic()) == {"r1": 2, "r2": 2, "r3": 2}

    asyncio.run(route())


def test_ties_in_load_are_broken_at_random_not_in_serves_order(new_router):
    async def route() -> set:
        router = new_router()
        replicas = [StandInReplica(name) for name in ("r1", "r2", "r3")]
        router.update_replicas(replicas)
        firsts = set()
        for _ in range(40):
            tiers = await router.choose_replicas(replicas, pending(chat(), "tokenize"))
            firsts.add(tiers[0][0].replica_id.unique_id)
            router._inflight = type(router._inflight)()  # every replica equally loaded again
        return firsts

    assert asyncio.run(route()) == {"r1", "r2", "r3"}


def test_a_completion_from_a_replica_that_rejected_the_request_keeps_it_in_flight_where_it_runs(new_router):
    async def route() -> dict:
        router = new_router()
        r1, r2 = StandInReplica("R1"), StandInReplica("R2")
        router.update_replicas([r1, r2])
        request = pending(SimpleNamespace(prompt=list(range(64))))
        request_id = request.metadata.internal_request_id
        router._inflight.place(request_id, "R1", time.monotonic(), True)
        router.on_request_routed(request, r2.replica_id, None)  # R1 was full: Serve placed the retry on R2
        router.on_request_completed(r1.replica_id, request_id)  # R1's rejected attempt
        still_running = router._inflight.counts(time.monotonic())
        router.on_request_completed(r2.replica_id, request_id)
        return still_running, router._inflight.counts(time.monotonic())

    assert asyncio.run(route()) == ({"R2": 1}, {})


class _Result:
    """A result as Serve hands `on_request_routed`: its done callbacks run, as Serve's, from another thread."""

    def __init__(self) -> None:
        self._callbacks = []

    def add_done_callback(self, callback) -> None:
        self._callbacks.append(callback)

    def finish(self) -> None:
        thread = threading.Thread(target=lambda: [callback(self) for callback in self._callbacks])
        thread.start()
        thread.join()


@pytest.mark.parametrize("accepted_on, late_completion_first", [("R1", False), ("R2", True), ("R1", True)])
def test_a_retry_placed_where_its_rejected_attempt_was_counts_in_flight_until_its_own_result_is_done(
        new_router, accepted_on, late_completion_first):
    """Serve reports the rejected attempt complete from another thread, after the retry was placed on the same
    replica: that completion ended the retry's placement, and the retry, sent there or elsewhere, ran uncounted."""
    async def route():
        router = new_router()
        r1, r2 = StandInReplica("R1"), StandInReplica("R2")
        router.update_replicas([r1, r2])
        router.tokenizer.token_ids = lambda request, rendering: list(request.prompt)
        cache_on(router, "R1", list(range(64)), 0)  # R1 holds the prompt: chosen every time
        request = pending(SimpleNamespace(prompt=list(range(64))))
        request_id = request.metadata.internal_request_id
        await router.choose_replicas([r1, r2], request)  # attempt 1: sent to R1, which rejects it (full)
        await router.choose_replicas([r1, r2], request)  # Serve routes the retry: R1 again
        served, result = {"R1": r1, "R2": r2}[accepted_on], _Result()
        if late_completion_first:
            router.on_request_completed(r1.replica_id, request_id)
        router.on_request_routed(request, served.replica_id, result)
        if not late_completion_first:
            router.on_request_completed(r1.replica_id, request_id)
        running = router._inflight.counts(time.monotonic())
        router.on_request_completed(served.replica_id, request_id)  # Serve's report of the retry itself
        result.finish()
        await asyncio.sleep(0)  # the callback's hop onto the router's loop
        return running, router._inflight.counts(time.monotonic())

    assert asyncio.run(route()) == ({accepted_on: 1}, {})


def test_a_request_the_engine_refused_at_once_stops_counting_though_reported_complete_before_routed(new_router):
    """Serve may report such a request complete before it reports it routed: counted again when routed, it held
    its count for INFLIGHT_TIMEOUT_S; its own result, already done, ends it."""
    async def route():
        router = new_router()
        r1 = StandInReplica("R1")
        router.update_replicas([r1])
        request = pending(SimpleNamespace(prompt=list(range(64))))
        await router.choose_replicas([r1], request)
        result = _Result()
        result.finish()
        result.add_done_callback = lambda callback: callback(result)  # done already: called at once
        router.on_request_completed(r1.replica_id, request.metadata.internal_request_id)
        router.on_request_routed(request, r1.replica_id, result)
        await asyncio.sleep(0)
        return router._inflight.counts(time.monotonic())

    assert asyncio.run(route()) == {}


def test_serves_backoff_asking_again_for_one_request_counts_one_decision(new_router):
    async def route() -> int:
        router = new_router()
        router.update_replicas([StandInReplica("R1"), StandInReplica("R2")])
        router.tokenizer.token_ids = lambda request, rendering: list(request.prompt)
        before = sum(decision_log.STATS.num_decisions_by_reason.values())
        request = pending(SimpleNamespace(prompt=list(range(64))))
        for _ in range(3):  # every replica full: Serve's backoff loop calls choose_replicas again
            await router.choose_replicas(list(router.curr_replicas.values()), request)
        return sum(decision_log.STATS.num_decisions_by_reason.values()) - before

    assert asyncio.run(route()) == 1


def test_serve_backs_off_while_every_replica_is_full(new_router):
    """Serve waits between its passes over the replicas only where the router asks it to: without, a request
    waiting for a full deployment was rendered, ranked and probed again in a loop on Serve's event loop."""

    async def passes() -> tuple[int, list[int]]:
        router = new_router()
        router.update_replicas([StandInReplica("R1"), StandInReplica("R2")])
        router.tokenizer.token_ids = lambda request, rendering: list(request.prompt)
        waits: list[int] = []

        async def backoff(attempt: int) -> None:
            waits.append(attempt)

        router._backoff = backoff
        request = pending(SimpleNamespace(prompt=list(range(64))))
        tiers = router._choose_replicas_with_backoff(request)
        num_tiers = 0
        for _ in range(8):  # each replica refuses: Serve takes the next tier, then passes again
            await anext(tiers)
            num_tiers += 1
        await tiers.aclose()
        return num_tiers, waits

    num_tiers, waits = asyncio.run(passes())
    assert num_tiers == 8 and waits == [0, 1]  # four passes: none before the second, then growing waits


def _routing_router(new_router):
    router = new_router()
    router.update_replicas([StandInReplica("R1"), StandInReplica("R2")])
    router.tokenizer.token_ids = lambda request, rendering: list(request.prompt)
    return router


def test_a_request_serve_asks_again_for_is_not_drawn_back_by_its_own_placement(new_router):
    async def route():
        router = _routing_router(new_router)
        request = pending(SimpleNamespace(prompt=list(range(64))))
        replicas = list(router.curr_replicas.values())
        await router.choose_replicas(replicas, request)
        await router.choose_replicas(replicas, request)  # every replica refused it: Serve asks again
        return router._decisions[request.metadata.internal_request_id]

    decision = asyncio.run(route())
    assert decision.reason != "prefix-hit" and not any(decision.predicted_cached_tokens.values()), decision


def test_a_request_serve_asks_again_for_is_not_counted_twice_on_its_own_choice(new_router):
    """Its own placement, not yet sent, counted on the replica it chose, and the load guard added it again: a
    replica holding its prompt and one other request looked like two over the guard's limit, and the request
    went to a cold replica."""
    async def route():
        router = new_router()
        replicas = [StandInReplica(f"R{n}") for n in range(1, 5)]
        router.update_replicas(replicas)
        router.tokenizer.token_ids = lambda request, rendering: list(request.prompt)
        cache_on(router, "R1", list(range(64)), 0)
        router._inflight.place("other", ReplicaId("R1"), time.monotonic(), True)  # R1 runs one request
        router.replica_queue_len_cache.update(replicas[0].replica_id, 1)
        request = pending(SimpleNamespace(prompt=list(range(64))))
        await router.choose_replicas(replicas, request)
        first = router._decisions[request.metadata.internal_request_id]
        await router.choose_replicas(replicas, request)  # refused, or every replica full: Serve asks again
        return first, router._decisions[request.metadata.internal_request_id]

    first, again = asyncio.run(route())
    assert (first.replica_id, first.reason) == ("R1", "prefix-hit")
    assert (again.replica_id, again.reason) == ("R1", "prefix-hit")


def test_a_session_serve_asks_again_for_is_not_drawn_back_by_its_own_first_choice(new_router):
    """The first choice was recorded as the session's replica: asked again, session affinity chose it again, every
    time, and called it `session-affinity` for a replica holding none of the session's history."""
    async def route():
        router = _routing_router(new_router)
        choices = []
        for _ in range(40):  # equal replicas: the first choice falls either way
            request = pending(SimpleNamespace(prompt=list(range(64))))
            request.metadata.session_id = f"s-{uuid.uuid4().hex}"
            replicas = list(router.curr_replicas.values())
            (first,), *_ = await router.choose_replicas(replicas, request)
            await router.choose_replicas(replicas, request)  # every replica refused it: Serve asks again
            again = router._decisions[request.metadata.internal_request_id]
            choices.append((first.replica_id.unique_id, again.replica_id, again.reason))
        return choices

    choices = asyncio.run(route())
    assert all(reason != "session-affinity" for _, _, reason in choices), choices
    assert any(first != again for first, again, _ in choices)  # not drawn back every time


def test_a_request_serve_sent_elsewhere_moves_its_placement_there(new_router):
    async def route():
        router = _routing_router(new_router)
        request = pending(SimpleNamespace(prompt=list(range(64))))
        replicas = {r.replica_id.unique_id: r for r in router.curr_replicas.values()}
        (chosen,), *_ = await router.choose_replicas(list(replicas.values()), request)
        other = next(r for name, r in replicas.items() if name != chosen.replica_id.unique_id)
        router.on_request_routed(request, other.replica_id, None)  # the chosen one was full
        return chosen.replica_id.unique_id, other.replica_id.unique_id, router

    before = decision_log.STATS.snapshot()["decisions_by_reason"]
    chosen, other, router = asyncio.run(route())
    hashes = hash_request_blocks(list(range(64)), BS, root_hash("m", None))
    held = router.index.longest_prefix(hashes, time.monotonic())
    assert chosen not in held and held.get(other) == 16, held
    # `/v1/router` counts it as served, as the decisions metric, the route header and span do.
    after = decision_log.STATS.snapshot()["decisions_by_reason"]
    assert after.get("fallback", 0) == before.get("fallback", 0) + 1
    assert sum(after.values()) == sum(before.values()) + 1


def test_a_request_decided_again_then_served_elsewhere_counts_once_as_fallback(new_router):
    """Serve asked again (every replica full) and the second decision had another reason: the fallback then took
    that reason's count from another request, and this one counted twice."""
    async def route():
        router = _routing_router(new_router)
        request = pending(SimpleNamespace(prompt=list(range(64)), session_id="s1"))
        replicas = {r.replica_id.unique_id: r for r in router.curr_replicas.values()}
        await router.choose_replicas(list(replicas.values()), request)  # cold: nothing known
        (chosen,), *_ = await router.choose_replicas(list(replicas.values()), request)  # session-affinity
        other = next(r for name, r in replicas.items() if name != chosen.replica_id.unique_id)
        router.on_request_routed(request, other.replica_id, None)

    before = decision_log.STATS.snapshot()["decisions_by_reason"]
    asyncio.run(route())
    after = decision_log.STATS.snapshot()["decisions_by_reason"]
    changes = {reason: after.get(reason, 0) - before.get(reason, 0) for reason in set(before) | set(after)}
    assert {reason: n for reason, n in changes.items() if n} == {"fallback": 1}


def _text_in_arguments(text: str):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}
    return StandInRequest(messages=[{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": None, "tool_calls": [call]}])


@pytest.mark.parametrize(("num_chars", "is_rendered"), [(100, True), (200, False)])
@pytest.mark.parametrize("where", ["content", "tool call arguments"])
def test_a_prompt_far_past_the_window_is_routed_by_load_without_rendering_it(new_router, num_chars, is_rendered,
                                                                              where):
    """Past 16 characters a token of an 8-token window the engine refuses it anyway, and rendering megabytes
    would hold up every request the router places meanwhile (wherever the text sits)."""
    async def route() -> None:
        router = new_router()
        router.args = router.args.model_copy(update={"max_model_len_tokens": 8})
        recorder = with_stand_in_tokenizer(router)
        replica = StandInReplica("R1", EngineRendering({}, renders_like_router=True).routing_stats())
        router.update_replicas([replica])
        body = chat("x" * num_chars) if where == "content" else _text_in_arguments("x" * num_chars)
        await router.choose_replicas([replica], pending(body, "chat"))
        assert bool(recorder.template_calls) is is_rendered
        assert bool(router._decisions) is is_rendered

    asyncio.run(route())


def test_a_completion_batch_of_one_far_past_the_window_is_not_tokenized(new_router):
    async def route() -> list:
        router = new_router()
        router.args = router.args.model_copy(update={"max_model_len_tokens": 8})
        tokenized = []
        router.tokenizer.token_ids = lambda request, rendering: tokenized.append(request) or [1, 2, 3]
        replica = StandInReplica("R1")
        router.update_replicas([replica])
        await router.choose_replicas([replica], pending(SimpleNamespace(prompt=["x" * 200])))
        return tokenized

    assert asyncio.run(route()) == []


def test_requests_routed_by_load_are_counted_once_each_by_why(new_router, monkeypatch):
    """`/v1/router` counted only prefix decisions: a fleet whose prompts stopped rendering (a template the
    router cannot apply) routed everything by load, and nothing said so."""
    monkeypatch.setattr(decision_log, "STATS", decision_log.RoutingStats())

    async def route() -> dict:
        router = new_router()
        replica = StandInReplica("R1", EngineRendering({}, renders_like_router=True).routing_stats())
        router.update_replicas([replica])
        waiting = pending(chat(), "chat")
        for _ in range(3):  # one request Serve asks for again while every replica is full: counted once
            await router.choose_replicas([replica], waiting)
        # ... and once more after its replica rejected it (Serve reports the attempt complete, then retries)
        router.on_request_completed(SimpleNamespace(unique_id="R1"), waiting.metadata.internal_request_id)
        await router.choose_replicas([replica], waiting)
        await router.choose_replicas([replica], pending(chat(), "tokenize"))  # prefills nothing: not counted
        with_stand_in_tokenizer(router)
        router.args = router.args.model_copy(update={"max_model_len_tokens": 8})
        await router.choose_replicas([replica], pending(chat("x" * 200), "chat"))
        await router.choose_replicas([replica], pending(SimpleNamespace(prompt=5), "completions"))  # renders nothing
        monkeypatch.setattr(router, "_choose", lambda *args: 1 / 0)
        await router.choose_replicas([replica], pending(chat(), "chat"))
        return decision_log.STATS.snapshot()["routed_by_load"]

    assert asyncio.run(route()) == {"no-tokenizer": 1, "over-window": 1, "no-prefix": 1, "router-error": 1}


def test_ids_an_earlier_attempt_forwarded_are_taken_back_when_a_later_one_may_not_forward_them(new_router):
    """Serve asks again with the same request (every replica full); meanwhile a replica that renders otherwise
    joined. The first attempt's ids stayed on the request and reached that replica, which would have rendered
    another prompt."""
    alike = EngineRendering({"enable_thinking": False}, renders_like_router=True)
    thinking = EngineRendering({"enable_thinking": True}, renders_like_router=True)

    async def route():
        router = new_router()
        with_stand_in_tokenizer(router)
        old, new = StandInReplica("old", alike.routing_stats()), StandInReplica("new", thinking.routing_stats())
        router.update_replicas([old])
        body = chat("hello")
        body.kv_transfer_params = {"kept": 1}  # a client's own keys stay
        request = pending(body, "chat")
        await router.choose_replicas([old], request)
        first = dict(body.kv_transfer_params)
        router.update_replicas([old, new])
        await router.choose_replicas([old, new], request)
        return first, body.kv_transfer_params

    first, second = asyncio.run(route())
    assert first == {"kept": 1, FORWARDED_IDS_KEY: [ord(c) for c in "hello"]}
    assert second == {"kept": 1}


def test_ids_a_client_set_itself_are_not_taken_back(new_router):
    async def route():
        router = new_router()
        with_stand_in_tokenizer(router)
        replicas = [StandInReplica("r1", EngineRendering({}, renders_like_router=False).routing_stats())]
        router.update_replicas(replicas)
        body = chat("hello")
        body.kv_transfer_params = {FORWARDED_IDS_KEY: [7, 8]}
        request = pending(body, "chat")
        for _ in range(2):
            await router.choose_replicas(replicas, request)
        return body.kv_transfer_params

    assert asyncio.run(route()) == {FORWARDED_IDS_KEY: [7, 8]}


def test_router_state_counts_active_sessions_of_the_replicas_serving_now(new_router):
    """A replica gone (its actor died, or scaled down) kept its sessions in the counts, under a replica the
    state no longer listed, until they idled."""
    async def route():
        router = _routing_router(new_router)
        replicas = {r.replica_id.unique_id: r for r in router.curr_replicas.values()}
        for name in ("R1", "R1", "R2"):
            request = pending(SimpleNamespace(prompt=list(range(64))))
            request.metadata.session_id = f"s-{uuid.uuid4().hex}"
            await router.choose_replicas(list(replicas.values()), request)
            router.on_request_routed(request, replicas[name].replica_id, None)
        before = router.snapshot()
        router.update_replicas([replicas["R2"]])
        return before, router.snapshot()

    before, after = asyncio.run(route())
    assert before["active_sessions_by_replica"] == {"R1": 2, "R2": 1} and before["num_active_sessions"] == 3
    assert before["num_remembered_sessions"] == 3
    assert after["active_sessions_by_replica"] == {"R2": 1} and after["num_active_sessions"] == 1
    assert after["replicas"] == ["R2"]
