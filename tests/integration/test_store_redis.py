"""SessionStore against a real redis-server started for this module on a free loopback port."""

import asyncio
import time

import pytest
import redis

from serve_apps.orchestrator.models import CompressionReport, CreateSessionRequest, Message, StepStats
from serve_apps.orchestrator.store import (
    Compaction,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    StaleTurn,
    StoreUnavailable,
)
from tests.integration.conftest import free_port

REQUEST = CreateSessionRequest.model_validate(
    {
        "model": "warmpath-tiny",
        "system_prompt": "You are the order desk agent.",
        "tools": [{"name": "get_order", "execution": {"kind": "client"}}],
    }
)


def _run(redis_url, scenario, **store_kwargs):
    """Runs `scenario(store)` on a fresh event loop with its own client."""

    async def main():
        store = SessionStore.from_url(redis_url, **store_kwargs)
        try:
            return await scenario(store)
        finally:
            await store.aclose()

    return asyncio.run(main())


def _turn(index: int) -> list[Message]:
    return [Message(role="user", content=f"question {index}"), Message(role="assistant", content=f"answer {index}")]


def _stats(step: int, compression: CompressionReport | None = None) -> StepStats:
    return StepStats(
        step_index=step, prefix_fingerprint="ab" * 32, prompt_tokens=900, cached_tokens=768, compression=compression
    )


def test_create_get_delete(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="key-1", prefix_fingerprint="ab" * 32)
        fetched = await store.get(record.session_id)
        snapshot = await store.transcript(record.session_id)
        is_deleted = await store.delete(record.session_id)
        with pytest.raises(SessionNotFound):
            await store.get(record.session_id)
        with pytest.raises(SessionNotFound):
            await store.transcript(record.session_id)
        return record, fetched, snapshot, is_deleted, await store.delete(record.session_id)

    record, fetched, snapshot, is_deleted, is_deleted_again = _run(redis_url, scenario)
    assert len(record.session_id) == 32
    assert fetched == record and fetched.owner_key_id == "key-1" and fetched.request == REQUEST
    assert (snapshot.messages, snapshot.length) == ((), 0)
    assert (is_deleted, is_deleted_again) == (True, False)


def test_session_expires_after_ttl(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                await store.get(record.session_id)
            except SessionNotFound:
                return True
            await asyncio.sleep(0.05)
        return False

    assert _run(redis_url, scenario, ttl_s=0.2)


def test_turn_lock_is_exclusive_and_released(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        entered = asyncio.Event()
        leave = asyncio.Event()

        async def holder():
            async with store.turn_lock(record.session_id):
                entered.set()
                await leave.wait()

        task = asyncio.create_task(holder())
        await entered.wait()
        with pytest.raises(SessionBusy):
            async with store.turn_lock(record.session_id):
                pass
        leave.set()
        await task
        async with store.turn_lock(record.session_id):
            return True

    assert _run(redis_url, scenario)


def test_concurrent_turns_one_wins(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")

        async def turn():
            async with store.turn_lock(record.session_id):
                await asyncio.sleep(0.2)
                return "ran"

        return await asyncio.gather(*(turn() for _ in range(5)), return_exceptions=True)

    outcomes = _run(redis_url, scenario)
    assert outcomes.count("ran") == 1
    assert sum(isinstance(outcome, SessionBusy) for outcome in outcomes) == 4


def test_a_live_turn_keeps_its_lock_past_lock_ttl_and_a_dead_ones_expires(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        async with store.turn_lock(record.session_id):
            await asyncio.sleep(1.0)  # more than three lock_ttl_s: renewed meanwhile
            with pytest.raises(SessionBusy):
                async with store.turn_lock(record.session_id):
                    pass
        return record.session_id

    session_id = _run(redis_url, scenario, lock_ttl_s=0.3)
    # A holder that died without releasing (a killed orchestrator) leaves a lock nobody renews.
    client = redis.Redis.from_url(redis_url)
    client.set(f"warmpath:{{{session_id}}}:lock", "dead-holder", px=300)
    client.close()

    async def after_death(store):
        with pytest.raises(SessionBusy):
            async with store.turn_lock(session_id):
                pass
        await asyncio.sleep(0.5)
        async with store.turn_lock(session_id):
            return True

    assert _run(redis_url, after_death, lock_ttl_s=0.3)


def test_expired_holder_cannot_release_the_next_holders_lock(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        async with store.turn_lock(record.session_id):
            time.sleep(0.3)  # a stalled holder: its renewals stall too, and the lock expires
            second = store.turn_lock(record.session_id)
            await second.__aenter__()
        # The first holder has exited; the second's lock must still stand.
        with pytest.raises(SessionBusy):
            async with store.turn_lock(record.session_id):
                pass
        await second.__aexit__(None, None, None)
        async with store.turn_lock(record.session_id):
            return True

    assert _run(redis_url, scenario, lock_ttl_s=0.1)


def test_stale_commit_writes_nothing(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        start = await store.transcript(record.session_id)
        new_len = await store.commit_turn(record.session_id, start.length, _turn(1), [_stats(0)])
        with pytest.raises(StaleTurn) as info:
            await store.commit_turn(record.session_id, start.length, _turn(2), [_stats(0)], idem_key="t2", result_json="{}")
        return new_len, info.value, await store.transcript(record.session_id), await store.step_stats(record.session_id), (
            await store.lookup_turn_result(record.session_id, "t2")
        )

    new_len, error, snapshot, stats, remembered = _run(redis_url, scenario)
    assert new_len == 2
    assert (error.expected_len, error.actual_len) == (0, 2)
    assert snapshot.messages == tuple(_turn(1)) and snapshot.length == 2
    assert stats == [_stats(0)]
    assert remembered is None


def test_compaction_keeps_logical_length_monotonic(redis_url):
    report = CompressionReport(
        num_messages_compressed=4, tokens_before=900, tokens_after=400, ledger_size=3, ledger_retained_fraction=1.0
    )
    summary = Message(role="user", content="summary\nFacts:\n- ORD-98231", name="warmpath-context-summary")

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        length = 0
        for index in range(3):
            length = await store.commit_turn(sid, length, _turn(index), [_stats(0)])
        compacted = await store.commit_turn(
            sid, length, _turn(3), [_stats(0, report)], compaction=Compaction(num_messages_replaced=4, summary=summary)
        )
        snapshot = await store.transcript(sid)
        # A turn that started before the compaction (length 6) must fail even though 6 messages are stored.
        with pytest.raises(StaleTurn):
            await store.commit_turn(sid, len(snapshot.messages), _turn(9), [])
        with pytest.raises(ValueError):
            await store.commit_turn(sid, snapshot.length, _turn(4), [], compaction=Compaction(99, summary))
        return length, compacted, snapshot, await store.step_stats(sid)

    length, compacted, snapshot, stats = _run(redis_url, scenario)
    assert (length, compacted, snapshot.length) == (6, 8, 8)
    assert snapshot.messages == (summary, *_turn(2), *_turn(3))
    assert stats[-1].compression == report and len(stats) == 4


def test_step_stats_are_bounded(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        await store.commit_turn(record.session_id, 0, _turn(0), [_stats(step) for step in range(5)])
        return await store.step_stats(record.session_id)

    assert [s.step_index for s in _run(redis_url, scenario, max_step_stats=3)] == [2, 3, 4]


def test_idempotency_first_result_wins(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        await store.commit_turn(sid, 0, _turn(0), [], idem_key="turn-a", result_json='{"answer": 0}')
        return [
            await store.lookup_turn_result(sid, "turn-a"),
            await store.lookup_turn_result(sid, "turn-b"),
            await store.remember_turn_result(sid, "turn-b", '{"error": "x"}'),
            await store.remember_turn_result(sid, "turn-b", '{"error": "y"}'),
            await store.lookup_turn_result(sid, "turn-b"),
        ]

    assert _run(redis_url, scenario) == ['{"answer": 0}', None, True, False, '{"error": "x"}']


@pytest.mark.parametrize(
    "call",
    [
        lambda store: store.get("missing"),
        lambda store: store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp"),
        lambda store: store.commit_turn("missing", 0, _turn(0), []),
        lambda store: store.lookup_turn_result("missing", "k"),
    ],
)
def test_unreachable_redis_is_store_unavailable(call):
    async def scenario(store):
        with pytest.raises(StoreUnavailable):
            await call(store)
        with pytest.raises(StoreUnavailable):
            async with store.turn_lock("missing"):
                pass
        return True

    assert _run(f"redis://127.0.0.1:{free_port()}/0", scenario)


def test_commit_to_missing_session_is_not_found(redis_url):
    async def scenario(store):
        with pytest.raises(SessionNotFound):
            await store.commit_turn("no-such-session", 0, _turn(0), [])
        return True

    assert _run(redis_url, scenario)
