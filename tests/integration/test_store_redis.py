"""SessionStore against a real redis-server started for this module on a free loopback port."""

import asyncio
import contextlib
import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from typer.testing import CliRunner

from cluster.api_keys import ApiKeyStore, hash_api_key, run_with_store
from cluster.api_keys import StoreUnavailable as KeyStoreUnavailable
from cluster.cli import app
from cluster.redis_pool import pooled_client
from serve_apps.orchestrator.models import STORED, CompressionReport, CreateSessionRequest, Message, StepStats
from serve_apps.orchestrator.store import (
    Compaction,
    SessionBusy,
    SessionDamaged,
    SessionNotFound,
    SessionRecord,
    SessionStore,
    StaleTurn,
    StepTotals,
    StoreUnavailable,
    TurnLockTaken,
)
from tests.integration.conftest import REDIS_SERVER, free_port

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


def test_a_session_an_earlier_release_accepted_stays_readable_under_stricter_creation_rules(redis_url):
    """A tool schema's rules tighten between releases (a pattern escape ECMAScript has not is refused now): read
    back under them, a stored session would fail validation and be lost to its owner."""
    body = {**REQUEST.model_dump(mode="json"), "tools": [{"name": "find", "execution": {"kind": "client"}, "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "\\A[a-z]+\\z"}}}}]}
    with pytest.raises(ValueError, match="no escape"):
        CreateSessionRequest.model_validate(body)
    older = CreateSessionRequest.model_validate(body, context=STORED)

    async def scenario(store):
        record = await store.create(older, owner_key_id="key-1", prefix_fingerprint="ab" * 32)
        return await store.get(record.session_id), await store.view(record.session_id)

    fetched, view = _run(redis_url, scenario)
    assert fetched.request == older and view.record == fetched


def test_a_session_whose_record_no_longer_reads_back_can_still_be_deleted_by_its_owner_alone(redis_url):
    """Its deletion read the whole record first: a record this release cannot read (a field a later release
    dropped) made every delete fail, and the session held its place in its key's quota until it expired."""
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="key-1", prefix_fingerprint="ab" * 32)
        meta = store._key(record.session_id, "meta")
        stored = json.loads(await store._redis.hget(meta, "record"))
        del stored["created_at_s"]
        await store._redis.hset(meta, "record", json.dumps(stored))
        with pytest.raises(ValueError):
            await store.get(record.session_id)
        owner = await store.owner_of(record.session_id)
        deleted = await store.delete(record.session_id, owner)
        with pytest.raises(SessionNotFound):
            await store.owner_of(record.session_id)
        return owner, deleted

    assert _run(redis_url, scenario) == ("key-1", True)


def test_what_a_later_release_stored_reads_back_without_the_fields_this_one_does_not_know(redis_url):
    """During a rolling update both releases share one Redis: a message, step or record holding a field a later
    release added (an assistant message's `reasoning` was one) failed every turn, view and deletion of its
    session on the replicas not yet updated. A client's unknown field is still refused."""
    later = {"field_of_a_later_release": {"x": 1}}

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="key-1", prefix_fingerprint="ab" * 32)
        await store.commit_turn(record.session_id, 0, _turn(0), [_stats(0)])
        meta, log, steps = (store._key(record.session_id, part) for part in ("meta", "log", "stats"))
        stored = json.loads(await store._redis.hget(meta, "record"))
        stored["request"]["tools"][0].update(later)
        await store._redis.hset(meta, "record", json.dumps({**stored, **later}))
        message = {**json.loads(await store._redis.lindex(log, 1)), **later}
        message["tool_calls"] = [{"id": "c1", "name": "get_order", "arguments": "{}", **later}]
        await store._redis.lset(log, 1, json.dumps(message))
        await store._redis.lset(steps, 0, json.dumps({**json.loads(await store._redis.lindex(steps, 0)), **later}))
        return await store.get(record.session_id), await store.view(record.session_id)

    fetched, view = _run(redis_url, scenario)
    assert fetched.request == REQUEST and view.record == fetched
    assert [message.content for message in view.transcript.messages] == ["question 0", "answer 0"]
    assert view.transcript.messages[1].tool_calls[0].name == "get_order"
    assert [step.step_index for step in view.steps] == [0]
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        Message.model_validate({"role": "user", "content": "hi", **later})


def test_a_session_whose_messages_were_lost_from_redis_is_refused_not_read_as_empty(redis_url):
    """An evicting Redis dropped the transcript and kept the record (read more recently): the session showed no
    messages, and its next turn ran on none. A session that never committed reads as empty, as it is."""

    async def scenario(store):
        fresh = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        damaged = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        await store.commit_turn(damaged.session_id, 0, _turn(0), [_stats(0)])
        await store._redis.delete(store._key(damaged.session_id, "log"))
        outcomes = [(await store.transcript(fresh.session_id)).length]
        for read in (store.transcript, store.view):
            try:
                await read(damaged.session_id)
            except SessionDamaged as err:
                outcomes.append(str(err))
        return outcomes

    fresh_length, *refusals = _run(redis_url, scenario)
    assert fresh_length == 0 and len(refusals) == 2
    assert all("messages are missing from Redis" in said and "delete the session" in said for said in refusals)


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


@pytest.mark.parametrize("fate", ["reply-timed-out", "turn-cancelled"])
def test_a_lock_taken_without_its_reply_is_freed_not_left_busy(redis_url, fate):
    """Redis ran the acquire script, but its reply timed out (the turn fails 503) or the turn was cancelled
    before it came (its client hung up): either way the next turn runs at once."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        acquire = store._acquire
        ran = asyncio.Event()

        async def reply_missing(**lock_args):
            await acquire(**lock_args)
            ran.set()
            if fate == "reply-timed-out":
                raise redis.exceptions.TimeoutError("Timeout reading from socket")
            await asyncio.Event().wait()  # the reply never comes before the cancellation

        async def turn():
            async with store.turn_lock(record.session_id):
                pytest.fail("the lock was reported taken")

        store._acquire = reply_missing
        task = asyncio.create_task(turn())
        await ran.wait()
        if fate == "turn-cancelled":
            task.cancel()
        with pytest.raises(asyncio.CancelledError if fate == "turn-cancelled" else StoreUnavailable):
            await task
        store._acquire = acquire
        async with store.turn_lock(record.session_id):  # not SessionBusy until the lock expires
            return True

    assert _run(redis_url, scenario, lock_ttl_s=600)


def test_concurrent_turns_one_wins(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        release = asyncio.Event()

        async def turn():
            async with store.turn_lock(record.session_id):
                await release.wait()  # held until the other four have failed
                return "ran"

        tasks = [asyncio.create_task(turn()) for _ in range(5)]

        async def four_done():
            while sum(task.done() for task in tasks) < 4:
                await asyncio.wait([task for task in tasks if not task.done()], return_when=asyncio.FIRST_COMPLETED)

        try:
            await asyncio.wait_for(four_done(), timeout=60)
            refused = [task.exception() for task in tasks if task.done()]
        finally:
            release.set()
        return refused, await asyncio.gather(*tasks, return_exceptions=True)

    refused, outcomes = _run(redis_url, scenario)
    assert len(refused) == 4 and all(isinstance(error, SessionBusy) for error in refused)
    assert outcomes.count("ran") == 1
    assert sum(isinstance(outcome, SessionBusy) for outcome in outcomes) == 4


async def _pttl_rises(client, key: str, deadline: float) -> bool:
    """Whether the key's PTTL goes up (a renewal) before `deadline`; False once it is gone or time is up."""
    previous = await client.pttl(key)
    while time.monotonic() < deadline and previous > 0:
        await asyncio.sleep(0.02)
        current = await client.pttl(key)
        if current > previous:
            return True
        previous = current
    return False


def test_a_live_turn_renews_its_lock(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        lock_key = f"warmpath:{{{record.session_id}}}:lock"
        client = aioredis.Redis.from_url(redis_url)
        try:
            async with store.turn_lock(record.session_id):
                deadline = time.monotonic() + 30
                # A renewal every third of lock_ttl_s sets the lock's PTTL back up, again and again.
                renewals = [await _pttl_rises(client, lock_key, deadline) for _ in range(3)]
                with pytest.raises(SessionBusy):
                    async with store.turn_lock(record.session_id):
                        pass
            return renewals, await client.exists(lock_key)
        finally:
            await client.aclose()

    assert _run(redis_url, scenario, lock_ttl_s=1.5) == ([True, True, True], 0)


def test_a_dead_holders_lock_expires(redis_url):
    async def create(store):
        return (await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")).session_id

    session_id = _run(redis_url, create)
    # A holder that died without releasing (a killed orchestrator) leaves a lock nobody renews.
    lock_key = f"warmpath:{{{session_id}}}:lock"
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(lock_key, "dead-holder", px=600_000)

        async def while_held(store):
            with pytest.raises(SessionBusy):
                async with store.turn_lock(session_id):
                    pass
            return True

        assert _run(redis_url, while_held, lock_ttl_s=0.3)
        # A refused taker leaves the holder's lock alone: neither replaced nor given a shorter TTL.
        assert client.get(lock_key) == b"dead-holder" and client.pttl(lock_key) > 500_000
        client.pexpire(lock_key, 1)  # its TTL runs out
        deadline = time.monotonic() + 10
        while client.exists(lock_key) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not client.exists(lock_key)
    finally:
        client.close()

    async def after_expiry(store):
        async with store.turn_lock(session_id):
            return True

    assert _run(redis_url, after_expiry, lock_ttl_s=0.3)


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


def _compressed(num_messages: int) -> tuple[CompressionReport, Message]:
    """A compression's report of `num_messages` and its summary message."""
    report = CompressionReport(num_messages_compressed=num_messages, tokens_before=900, tokens_after=400,
                               ledger_size=3, ledger_retained_fraction=1.0)
    return report, Message(role="user", content="summary\nFacts:\n- ORD-98231", name="warmpath-context-summary")


def test_compaction_keeps_logical_length_monotonic(redis_url):
    report, summary = _compressed(4)

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


def test_a_turn_that_compressed_twice_counts_both_in_the_totals(redis_url):
    """A second compression at a pause comes after its step's stats went out: the totals counted one."""
    report, summary = _compressed(2)

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        length = await store.commit_turn(sid, 0, _turn(0), [_stats(0)])
        await store.commit_turn(sid, length, _turn(1), [_stats(0, report)],
                                compaction=Compaction(num_messages_replaced=2, summary=summary, num_compressions=2))
        return (await store.view(sid)).totals

    assert _run(redis_url, scenario).num_compressions == 2


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
        length = await store.commit_turn(sid, 0, _turn(0), [], idem_key="turn-a", result_json='{"answer": 0}')
        await store.commit_turn(sid, length, _turn(1), [], idem_key="turn-a", result_json='{"answer": 1}')
        return [await store.lookup_turn_result(sid, "turn-a"), await store.lookup_turn_result(sid, "turn-b")]

    assert _run(redis_url, scenario) == ['{"answer": 0}', None]


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


# --- Redis in states the shared module server must not be put in: each test below starts its own. ---


@contextlib.contextmanager
def _own_redis(workdir: Path, port: int | None = None, *extra: str):
    """A redis-server of the test's own on `port` (a free one by default); yields its URL and process."""
    port = port or free_port()
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("redis-server did not start")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", process
    finally:
        client.close()
        process.kill()  # nothing to keep, and no shutdown save to wait for
        process.wait(timeout=10)


def _fill_up(url: str) -> None:
    """Makes Redis full (maxmemory below its use, noeviction) and empties its script cache, so every script
    is loaded again while full, as after a restart."""
    client = redis.Redis.from_url(url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    client.script_flush()
    client.close()


def _fail_snapshots(url: str, process: subprocess.Popen) -> None:
    """Makes Redis refuse writes with MISCONF: a snapshot child killed mid-save counts as a failed save."""
    client = redis.Redis.from_url(url)
    client.config_set("save", "3600 1")
    client.config_set("rdb-key-save-delay", 1_000_000)  # one second per key: the child is still saving
    client.set("some-key", "v")
    client.bgsave()
    deadline = time.monotonic() + 5
    while not psutil.Process(process.pid).children() and time.monotonic() < deadline:
        time.sleep(0.02)
    for child in psutil.Process(process.pid).children():
        child.kill()
    while client.info("persistence")["rdb_last_bgsave_status"] == "ok" and time.monotonic() < deadline:
        time.sleep(0.02)
    client.close()


def _make_replica(url: str) -> None:
    """Makes Redis a read-only replica (of a primary that does not exist)."""
    client = redis.Redis.from_url(url)
    client.replicaof("127.0.0.1", free_port())
    client.close()


@pytest.mark.parametrize(
    "break_redis, condition",
    [
        (lambda url, process: _fill_up(url), "out of memory"),
        (lambda url, process: _make_replica(url), "read-only replica"),
        (_fail_snapshots, "MISCONF"),
    ],
    ids=["oom", "readonly", "misconf"],
)
def test_redis_refusing_writes_is_store_unavailable_naming_why(tmp_path, break_redis, condition):
    with _own_redis(tmp_path) as (url, process):

        async def scenario(store):
            record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
            break_redis(url, process)
            refusals = []
            for call in (
                lambda: store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp"),
                lambda: store.commit_turn(record.session_id, 0, _turn(0), []),
                lambda: store.turn_lock(record.session_id).__aenter__(),
            ):
                with pytest.raises(StoreUnavailable) as info:
                    await call()
                refusals.append(str(info.value))
            keys = ApiKeyStore.from_url(url)
            try:
                with pytest.raises(KeyStoreUnavailable) as info:
                    await keys.create("n", ["*"], 1.0, 1)
            finally:
                await keys.aclose()
            return refusals + [str(info.value)]

        for message in _run(url, scenario):
            assert condition in message and "\n" not in message


def test_a_database_the_server_lacks_is_store_unavailable(redis_url):
    async def scenario(store):
        with pytest.raises(StoreUnavailable) as info:
            await store.get("any")
        return str(info.value)

    assert "database number" in _run(redis_url.rsplit("/", 1)[0] + "/99", scenario)


def test_a_full_redis_still_serves_reads_key_checks_and_deletes(tmp_path):
    with _own_redis(tmp_path) as (url, _):

        async def scenario(store):
            keys = ApiKeyStore.from_url(url)
            key, key_record = await keys.create("n", ["*"], requests_per_s=0.5, burst=2)
            record = await store.create(REQUEST, owner_key_id=key_record.key_id, prefix_fingerprint="fp")
            sid = record.session_id
            await store.commit_turn(sid, 0, _turn(0), [_stats(0)], idem_key="t0", result_json='{"a": 0}')
            _fill_up(url)
            try:
                admitted = [(await keys.authorize(key)).is_allowed for _ in range(3)]
            finally:
                await keys.aclose()
            reads = (
                await store.get(sid), await store.transcript(sid), await store.step_stats(sid),
                await store.lookup_turn_result(sid, "t0"), await store.view(sid),
            )
            is_deleted = await store.delete(sid)
            with pytest.raises(SessionNotFound):
                await store.transcript(sid)
            return admitted, reads, is_deleted

        admitted, (fetched, snapshot, stats, remembered, view), is_deleted = _run(url, scenario)
        assert admitted == [True, True, False]  # the bucket still admits, and still limits
        assert fetched.owner_key_id.startswith("key_") and snapshot.messages == tuple(_turn(0)) and snapshot.length == 2
        assert stats == [_stats(0)] and remembered == '{"a": 0}' and is_deleted
        assert view.transcript == snapshot and view.steps == stats and view.totals.num_steps == 1


def test_a_full_redis_still_frees_a_turns_lock(tmp_path):
    """Redis filled up during the turn (its commit refused): a release that could not write left the lock held,
    and the client's retry, once it had made room, was refused busy for the lease."""
    with _own_redis(tmp_path) as (url, _):

        async def scenario(store):
            record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
            sid = record.session_id
            async with store.turn_lock(sid):
                _fill_up(url)
            with redis.Redis.from_url(url) as client:
                return client.exists(f"warmpath:{{{sid}}}:lock")

        assert _run(url, scenario) == 0


def test_the_first_calls_after_a_redis_restart_succeed(tmp_path):
    """Pooled connections die with the Redis they went to; the next calls of both stores still succeed."""
    port = free_port()
    with _own_redis(tmp_path, port) as (url, _):
        store, keys = SessionStore.from_url(url), ApiKeyStore.from_url(url)

        async def warm_up():  # several pooled connections, each dead after the restart
            key, _ = await keys.create("n", ["*"], 100.0, 100)
            record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
            await asyncio.gather(*(store.get(record.session_id) for _ in range(4)))
            await asyncio.gather(*(keys.authorize(key) for _ in range(4)))
            return key, record.session_id

        loop = asyncio.new_event_loop()
        key, sid = loop.run_until_complete(warm_up())
    with _own_redis(tmp_path, port):  # the same port, empty (no persistence)

        async def after_restart():
            outcomes = []
            for call in (lambda: store.get(sid), lambda: store.transcript(sid), lambda: store.delete(sid)):
                try:
                    outcomes.append(await call())
                except SessionNotFound:
                    outcomes.append("not found")
            outcomes.append((await keys.authorize(key)).record)
            return outcomes

        assert loop.run_until_complete(after_restart()) == ["not found", "not found", False, None]

    async def after_stop():  # the retry does not hide an outage: a Redis that is down still refuses every call
        with pytest.raises(KeyStoreUnavailable):
            await keys.authorize(key)
        with pytest.raises(StoreUnavailable):
            await store.get(sid)
        await store.aclose()
        await keys.aclose()
        return True

    assert loop.run_until_complete(after_stop())
    loop.close()


def test_idempotency_records_keep_only_the_most_recent(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        length = 0
        for index in range(5):
            length = await store.commit_turn(
                sid, length, _turn(index), [], idem_key=f"t{index}", result_json=f"r{index}"
            )
        return sid, [await store.lookup_turn_result(sid, f"t{index}") for index in range(5)]

    sid, committed = _run(redis_url, scenario, max_idempotency_records=3)
    assert committed == [None, None, "r2", "r3", "r4"]
    client = redis.Redis.from_url(redis_url)
    try:
        idem, order = (f"warmpath:{{{sid}}}:{part}" for part in ("idem", "idem-order"))
        assert client.hlen(idem) == client.llen(order) == 3
        assert 0 < client.pttl(order) <= 86_400_000
    finally:
        client.close()


def test_idempotency_records_keep_only_the_newest_that_fit_their_bytes(redis_url):
    """Each record holds every tool result of its turn: counted alone, tool-heavy sessions kept megabytes."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid, length = record.session_id, 0
        for index, size in enumerate([400, 400, 400, 300, 2000]):
            length = await store.commit_turn(
                sid, length, _turn(index), [], idem_key=f"t{index}", result_json=str(index) * size
            )
            yield [key for key in (f"t{i}" for i in range(5)) if await store.lookup_turn_result(sid, key)]

    async def collect(store):
        return [kept async for kept in scenario(store)]

    kept = _run(redis_url, collect, max_idempotency_bytes=1000)
    assert kept == [["t0"], ["t0", "t1"], ["t1", "t2"], ["t2", "t3"], ["t4"]]  # the newest stays, whatever its size


def test_a_running_turn_keeps_its_session_alive_past_its_ttl(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        await store.commit_turn(sid, 0, _turn(0), [], idem_key="t0", result_json="r0")
        await asyncio.sleep(0.3)  # idle for part of its TTL (a stall of 0.7 s would expire it)
        async with store.turn_lock(sid):
            snapshot = await store.transcript(sid)
            await asyncio.sleep(1.5)  # the turn outlives the TTL: renewals keep the session
            new_len = await store.commit_turn(sid, snapshot.length, _turn(1), [])
        return new_len, await store.lookup_turn_result(sid, "t0")

    assert _run(redis_url, scenario, ttl_s=1.0) == (4, "r0")


def test_a_turn_lock_on_a_missing_session_is_not_found(redis_url):
    async def scenario(store):
        with pytest.raises(SessionNotFound):
            async with store.turn_lock("no-such-session"):
                pass
        client = redis.Redis.from_url(redis_url)
        try:
            return client.exists("warmpath:{no-such-session}:lock")
        finally:
            client.close()

    assert _run(redis_url, scenario) == 0


def test_another_keys_turn_is_not_found_and_never_takes_the_lock(redis_url):
    from serve_apps.access import Caller
    from serve_apps.orchestrator.deployment import Orchestrator

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="owner", prefix_fingerprint="fp")
        locked = []
        take_lock = store.turn_lock
        store.turn_lock = lambda session_id: locked.append(session_id) or take_lock(session_id)
        orchestrator = Orchestrator.__new__(Orchestrator)
        orchestrator._store = store

        async def first_item(session_id):
            stream = orchestrator._turn(session_id, "auto", Caller("other", ("*",)), None, "sha", user_content="hi")
            try:
                return await stream.__anext__()
            finally:
                await stream.aclose()

        idle = await first_item(record.session_id)
        async with take_lock(record.session_id):  # the owner's turn runs
            busy = await first_item(record.session_id)
        return idle["status"], busy["status"], busy["body"]["error"]["code"], locked

    assert _run(redis_url, scenario) == (404, 404, "session_not_found", [])


def test_a_delete_whose_reply_was_lost_reports_the_session_it_deleted(redis_url):
    """The connection drops after Redis ran the delete: the retry finds nothing, yet the session existed."""

    async def scenario(store):
        record = await store.create(REQUEST, "k1", "ab" * 32)
        real, results = store._delete, []

        async def reply_lost_once(**kwargs):
            results.append(await real(**kwargs))
            if len(results) == 1:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            return results[-1]

        store._delete = reply_lost_once
        existed = await store.delete(record.session_id)
        with pytest.raises(SessionNotFound):
            await store.get(record.session_id)
        store._delete = real
        return existed, results, await store.delete("never-there")

    existed, results, never = _run(redis_url, scenario)
    assert results == [1, 0] and existed is True and never is False


def test_listing_keys_reads_every_key_id_and_only_those(redis_url):
    url = redis_url.rsplit("/", 1)[0] + "/2"  # a database of its own: exactly the keys written here
    client = redis.Redis.from_url(url, decode_responses=True)
    client.flushdb()

    async def create(keys):
        return [(await keys.create(name, ["*"], 5.0, 5))[1] for name in ("first", "second")]

    try:
        first, second = run_with_store(url, create)
        bad_hash = "f" * 64
        bad = first.model_dump(mode="json") | {"key_id": "key_ffffffffffff", "name": "bad", "requests_per_s": 0}
        client.hset(f"warmpath:apikey:{bad_hash}", "record", json.dumps(bad))
        client.set("warmpath:apikey-id:key_ffffffffffff", bad_hash)
        # What a looser pattern would also read: keys that are not key ids, of other types and shapes.
        client.hset(f"warmpath:{{{'s' * 32}}}:meta", "record", "{}")
        client.set("warmpath:apikey-idx", client.get(f"warmpath:apikey-id:{second.key_id}"))
        client.set("other:warmpath:apikey-id:key_000000000000", client.get(f"warmpath:apikey-id:{first.key_id}"))
        listing = run_with_store(url, lambda keys: keys.list())
    finally:
        client.flushdb()
        client.close()
    assert sorted(listing.records, key=lambda r: r.name) == [first, second]
    assert [u.key_id for u in listing.unreadable] == ["key_ffffffffffff"]
    assert "requests_per_s" in listing.unreadable[0].problem


@pytest.mark.parametrize("raw", ["not json", "null", "[]", '{"requests_per_s": 1, "burst": 1}',
                                 '{"key_id": 5, "requests_per_s": 1, "burst": 1}'])
def test_a_key_whose_record_cannot_be_read_is_refused_as_unknown(redis_url, raw):
    """Not a 503 `key_store_unavailable`: the rate-limit script failed on it, which read as Redis failing."""
    url = redis_url.rsplit("/", 1)[0] + "/3"
    client = redis.Redis.from_url(url, decode_responses=True)
    key = "wp-a-key-with-a-broken-record"
    client.hset(f"warmpath:apikey:{hash_api_key(key)}", "record", raw)
    try:
        outcome = run_with_store(url, lambda keys: keys.authorize(key))
    finally:
        client.flushdb()
        client.close()
    assert outcome.record is None and not outcome.is_allowed


@pytest.mark.parametrize("write_entry, problem", [
    (lambda client, key: client.hset(key, "record", b"\xff{}"), "it is not UTF-8 text"),
    (lambda client, key: client.set(key, "{}"), "its entry is of another Redis type"),
])
def test_a_hand_written_key_entry_redis_cannot_hand_back_as_a_record_is_refused_and_listed_apart(
        redis_url, write_entry, problem):
    """Text that is no UTF-8 failed the key check as an internal error (a bare 500), an entry of another Redis
    type as an unavailable store (a 503 its clients retry); either made `keys list` fail for every key."""
    url = redis_url.rsplit("/", 1)[0] + "/4"
    client = redis.Redis.from_url(url)
    client.flushdb()
    key = "wp-a-key-written-by-hand"
    try:
        _, good = run_with_store(url, lambda keys: keys.create("good", ["*"], 5.0, 5))
        write_entry(client, f"warmpath:apikey:{hash_api_key(key)}")
        client.set("warmpath:apikey-id:key_handwritten", hash_api_key(key))
        outcomes = run_with_store(url, lambda keys: asyncio.gather(keys.authorize(key), keys.lookup(key), keys.list()))
    finally:
        client.flushdb()
        client.close()
    authorization, looked_up, listing = outcomes
    assert authorization.record is None and not authorization.is_allowed and looked_up is None
    assert listing.records == [good]
    assert [(u.key_id, u.problem) for u in listing.unreadable] == [("key_handwritten", problem)]


def test_hand_written_key_id_entries_are_listed_apart_and_revoked_not_read_as_redis_failing(redis_url, caplog):
    """An id entry of another Redis type: `keys list` named it for `keys revoke`, which then reported Redis
    unavailable (WRONGTYPE). An id entry whose name is no UTF-8 failed `keys list` for every key. A record
    that is empty text was logged as an entry of another Redis type."""
    url = redis_url.rsplit("/", 1)[0] + "/6"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        _, good = run_with_store(url, lambda keys: keys.create("good", ["*"], 5.0, 5))
        client.rpush("warmpath:apikey-id:key_aaaaaaaaaaaa", "x")
        client.set(b"warmpath:apikey-id:key_\xff\xfe", "f" * 64)
        client.hset(f"warmpath:apikey:{hash_api_key('wp-empty')}", "record", "")
        listing = run_with_store(url, lambda keys: keys.list())
        is_revoked = run_with_store(url, lambda keys: keys.revoke("key_aaaaaaaaaaaa"))
        with caplog.at_level("WARNING", logger="cluster.api_keys"):
            empty = run_with_store(url, lambda keys: keys.authorize("wp-empty"))
        after = run_with_store(url, lambda keys: keys.list())
    finally:
        client.flushdb()
        client.close()
    assert listing.records == [good] == after.records
    assert [(u.key_id, u.problem) for u in listing.unreadable] == [  # by id
        ("key_\\xff\\xfe", "its name is not UTF-8 text (delete it with redis-cli)"),
        ("key_aaaaaaaaaaaa", "its entry is of another Redis type"),
    ]
    assert is_revoked and [u.key_id for u in after.unreadable] == ["key_\\xff\\xfe"]
    assert empty.record is None and "another Redis type" not in caplog.text and "unreadable record" in caplog.text


def test_keys_revoke_given_the_key_itself_revokes_it_by_its_id_and_never_prints_it(redis_url):
    """An operator who pasted the `api_key` `keys create` printed got `no key wp_...` (the secret on the
    terminal and in logs) and the key stayed live."""
    url = redis_url.rsplit("/", 1)[0] + "/5"
    key, record = run_with_store(url, lambda keys: keys.create("leaked", ["*"], 5.0, 5))
    result = CliRunner().invoke(app, ["keys", "revoke", key, "--redis-url", url])
    outcome = run_with_store(url, lambda keys: keys.authorize(key))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"revoked {record.key_id}" and key not in result.output
    assert outcome.record is None and not outcome.is_allowed


def test_the_token_bucket_refills_at_its_rate(redis_url):
    async def scenario(keys):
        key, _ = await keys.create("limited", ["*"], requests_per_s=20.0, burst=1)
        # At once: the one token is spent, and the requests after it are refused until it refills.
        burst = await asyncio.gather(*(keys.authorize(key) for _ in range(8)))
        refused = [outcome for outcome in burst if not outcome.is_allowed]
        deadline = time.monotonic() + 5
        is_allowed = False
        while not is_allowed and time.monotonic() < deadline:
            await asyncio.sleep(max(outcome.retry_after_s for outcome in refused))
            is_allowed = (await keys.authorize(key)).is_allowed
        return burst, refused, is_allowed

    burst, refused, is_allowed_again = run_with_store(redis_url, scenario)
    assert any(outcome.is_allowed for outcome in burst)
    assert refused and all(0 < outcome.retry_after_s <= 0.05 for outcome in refused)  # one token per 50 ms
    assert is_allowed_again


def test_running_totals_count_every_step_beyond_those_kept(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, "k1", "ab" * 32)
        sid = record.session_id
        for step in range(3):
            report = CompressionReport(num_messages_compressed=2, tokens_before=10, tokens_after=5, ledger_size=1,
                                       ledger_retained_fraction=1.0) if step == 1 else None
            await store.commit_turn(sid, 2 * step, _turn(step), [_stats(step, report)])
        view = await store.view(sid)
        return view.steps, view.totals

    kept, totals = _run(redis_url, scenario, max_step_stats=2)
    assert [s.step_index for s in kept] == [1, 2]
    assert totals == StepTotals(num_steps=3, prompt_tokens=2700, cached_tokens=2304, num_compressions=1)


def test_a_compaction_no_step_reports_still_counts(redis_url):
    """A resume with no steps left that had to compress commits its compaction without step stats."""
    summary = Message(role="user", content="summary\nFacts:\n- ORD-98231", name="warmpath-context-summary")

    async def scenario(store):
        record = await store.create(REQUEST, "k1", "ab" * 32)
        sid = record.session_id
        length = await store.commit_turn(sid, 0, _turn(0), [_stats(0)])
        await store.commit_turn(sid, length, [Message(role="user", content="more")], [],
                                compaction=Compaction(num_messages_replaced=2, summary=summary))
        return (await store.view(sid)).totals

    assert _run(redis_url, scenario).num_compressions == 1


def test_a_session_from_before_running_totals_sums_its_kept_steps_and_gets_none(redis_url):
    """Its totals would count only the steps after the upgrade: its view sums its kept steps instead."""

    async def scenario(store):
        record = await store.create(REQUEST, "k1", "ab" * 32)
        with redis.Redis.from_url(redis_url) as client:
            client.hdel(f"warmpath:{{{record.session_id}}}:meta", "steps_total", "prompt_tokens_total",
                        "cached_tokens_total", "compressions_total")
        await store.commit_turn(record.session_id, 0, _turn(0), [_stats(0)])
        with redis.Redis.from_url(redis_url) as client:
            fields = client.hkeys(f"warmpath:{{{record.session_id}}}:meta")
        return (await store.view(record.session_id)).totals, fields

    totals, fields = _run(redis_url, scenario)
    assert totals == StepTotals(num_steps=1, prompt_tokens=900, cached_tokens=768, num_compressions=0)
    assert not [field for field in fields if field.endswith(b"_total")], fields


def test_a_view_is_one_instant_while_turns_commit(redis_url):
    """Each commit adds two messages and one step: every view agrees with itself however the commits
    interleave (read one by one, a commit landing between reads showed messages without their step)."""

    async def scenario(store):
        record = await store.create(REQUEST, "k1", "ab" * 32)
        sid = record.session_id
        views = []

        async def commit_all():
            length = 0
            for step in range(150):
                length = await store.commit_turn(sid, length, _turn(step), [_stats(step)])

        async def read_all():
            while not committing.done():
                views.append(await store.view(sid))

        committing = asyncio.ensure_future(commit_all())
        await asyncio.gather(committing, read_all(), read_all())
        return views

    views = _run(redis_url, scenario)
    assert len(views) > 10
    for view in views:
        assert view.record.owner_key_id == "k1"
        assert view.transcript.length == len(view.transcript.messages) == 2 * len(view.steps)
        assert view.totals.num_steps == len(view.steps)
        assert view.totals.prompt_tokens == 900 * len(view.steps)


def test_a_view_of_a_missing_session_is_not_found(redis_url):
    async def scenario(store):
        with pytest.raises(SessionNotFound):
            await store.view("no-such-session")
        return True

    assert _run(redis_url, scenario)


def test_more_calls_at_once_than_the_pool_has_connections_wait_for_one(redis_url):
    """A burst above the pool's size waits for connections instead of failing (redis-py's default pool
    failed every call past its 100th at once); only a wait past the pool's limit is an outage."""

    async def burst(store):
        await store.create(REQUEST, "key_1", "ab" * 32)
        record = await store.create(REQUEST, "key_1", "ab" * 32)
        found = await asyncio.gather(*(store.get(record.session_id) for _ in range(300)), return_exceptions=True)
        return [type(item).__name__ for item in found if not isinstance(item, SessionRecord)]

    async def main(max_connections, pool_wait_s):
        client = pooled_client(redis_url, reply_timeout_s=5, connect_timeout_s=2, max_connections=max_connections,
                               pool_wait_s=pool_wait_s)
        store = SessionStore(client)
        try:
            return await burst(store)
        finally:
            await store.aclose()

    assert asyncio.run(main(max_connections=16, pool_wait_s=10)) == []
    assert _run(redis_url, burst) == []  # the store's own pool
    assert _run(redis_url, lambda store: asyncio.sleep(0, store._redis.connection_pool.max_connections)) >= 512

    async def held():
        client = pooled_client(redis_url, reply_timeout_s=5, connect_timeout_s=2, max_connections=1, pool_wait_s=0.2)
        store = SessionStore(client)
        record = await store.create(REQUEST, "key_1", "ab" * 32)
        only = await client.connection_pool.get_connection()  # the pool's only connection, held
        try:
            with pytest.raises(StoreUnavailable, match="every connection to the session store is busy"):
                await store.get(record.session_id)
        finally:
            await client.connection_pool.release(only)
            await store.aclose()

    asyncio.run(held())


def test_a_turn_whose_lock_another_turn_took_cannot_commit(redis_url):
    """A holder that stalled past its lease (its renewals did not run) finds the next turn holding the lock: its
    commit is refused, and only the turn holding the lock saves; a lock that expired untaken is no bar."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        stalled = store.turn_lock(sid)
        old_token = await stalled.__aenter__()
        with redis.Redis.from_url(redis_url) as client:
            client.delete(f"warmpath:{{{sid}}}:lock")  # its lease ran out
        async with store.turn_lock(sid) as token:
            with pytest.raises(TurnLockTaken, match="another turn took it"):
                await store.commit_turn(sid, 0, _turn(0), [_stats(0)], lock_token=old_token)
            length = await store.commit_turn(sid, 0, _turn(1), [_stats(0)], lock_token=token)
            with redis.Redis.from_url(redis_url) as client:
                client.delete(f"warmpath:{{{sid}}}:lock")  # its lease ran out too, and no turn took it
            untaken = await store.commit_turn(sid, length, _turn(2), [_stats(1)], lock_token=token)
        await stalled.__aexit__(None, None, None)
        with pytest.raises(TurnLockTaken):  # ended, its token is no one's to commit with
            await store.commit_turn(sid, untaken, _turn(3), [_stats(2)], lock_token=token)
        return (await store.transcript(sid)).messages, untaken

    messages, untaken = _run(redis_url, scenario)
    assert messages == (*_turn(1), *_turn(2)) and untaken == 4


def test_a_turn_whose_renewal_finds_its_lock_taken_is_told_so(redis_url):
    """Its commit would be refused; told at once, the turn stops before running more tools (which the turn
    holding the lock now may be running too)."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        async with store.turn_lock(sid) as token:
            assert not store.lock_lost(token)
            with redis.Redis.from_url(redis_url) as client:
                client.set(f"warmpath:{{{sid}}}:lock", "another-turns-token")  # it expired, and was taken
            deadline = time.monotonic() + 10
            while not store.lock_lost(token):  # the next renewal (every 0.1 s here) finds out
                assert time.monotonic() < deadline, "no renewal noticed the lock was taken"
                await asyncio.sleep(0.05)
        return store.lock_lost(token)

    assert _run(redis_url, scenario, lock_ttl_s=0.3) is False  # forgotten with its block


def test_a_turn_whose_expired_lock_another_turn_took_and_released_does_not_take_it_back(redis_url):
    """Between two renewals of a stalled turn, another turn took its expired lock, ran and released it: the
    renewal found the lock free and took it back as if it had expired untaken, so the stalled turn ran on
    (model calls, server-side tools) and held off the client's next turn as busy."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid, lock_key = record.session_id, f"warmpath:{{{record.session_id}}}:lock"
        async with store.turn_lock(sid) as token:
            renew, stalled = store._acquire, asyncio.Event()

            async def stalled_renewal(**kwargs):
                await stalled.wait()  # this process stalls past its lease
                return await renew(**kwargs)

            store._acquire = stalled_renewal
            other = SessionStore.from_url(redis_url)
            try:
                with redis.Redis.from_url(redis_url) as client:
                    client.delete(lock_key)  # the lease ran out
                    async with other.turn_lock(sid):  # another orchestrator's turn: it fails, saving nothing
                        pass
                    stalled.set()
                    deadline = time.monotonic() + 10
                    while not store.lock_lost(token):
                        assert time.monotonic() < deadline, "the renewal took the lock back"
                        await asyncio.sleep(0.05)
                    is_free = client.get(lock_key) is None
                with pytest.raises(TurnLockTaken, match="another turn took it"):
                    await store.commit_turn(sid, 0, _turn(0), [_stats(0)], lock_token=token)
                async with other.turn_lock(sid) as next_token:  # the client's next turn is not refused as busy
                    length = await other.commit_turn(sid, 0, _turn(1), [_stats(0)], lock_token=next_token)
            finally:
                await other.aclose()
            return is_free, length

    assert _run(redis_url, scenario, lock_ttl_s=0.3) == (True, 2)


def test_a_renewal_redis_runs_after_its_turn_released_the_lock_does_not_take_it_back(redis_url):
    """Sent before the release and run after it (another pooled connection), the renewal found the lock
    free with its own token the last taker, and took it: the next turn was refused busy for the lease."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        async with store.turn_lock(sid) as token:
            pass
        renewed = await store._acquire(**store._lock_args(sid, token, is_renewal=True))
        async with store.turn_lock(sid):  # the next turn
            pass
        return renewed

    assert _run(redis_url, scenario) == 0


def test_a_lock_that_expired_untaken_is_taken_again_and_a_deleted_session_is_no_lost_lock(redis_url):
    """No other turn ran: the turn goes on and commits (a lock gone with its session is the commit's to report,
    as not found); only another turn holding the lock means the lock was lost."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid, lock_key = record.session_id, f"warmpath:{{{record.session_id}}}:lock"
        async with store.turn_lock(sid) as token:
            with redis.Redis.from_url(redis_url) as client:
                client.delete(lock_key)  # its lease ran out while Redis was away; no turn took it
                deadline = time.monotonic() + 10
                while client.get(lock_key) != token.encode():  # the next renewal takes it again
                    assert time.monotonic() < deadline, "no renewal took the lock again"
                    await asyncio.sleep(0.05)
            taken_again = not store.lock_lost(token)
            length = await store.commit_turn(sid, 0, _turn(0), [_stats(0)], lock_token=token)
            await store.delete(sid)
            renewals = store._acquire
            calls = []

            async def counted(**kwargs):
                calls.append(await renewals(**kwargs))
                return calls[-1]

            store._acquire = counted
            deadline = time.monotonic() + 10
            while not calls:
                assert time.monotonic() < deadline, "no renewal ran"
                await asyncio.sleep(0.05)
            return taken_again, length, calls[0], store.lock_lost(token)

    taken_again, length, renewal, is_lost = _run(redis_url, scenario, lock_ttl_s=0.3)
    assert taken_again and length == 2
    assert renewal == -1 and not is_lost  # the session is gone: not a lock another turn took


def test_a_turn_cancelled_as_it_frees_its_lock_still_frees_it(redis_url):
    """Its client left at the turn's last event; the release was cancelled with it, and the session refused
    the next turn as busy until the lock expired."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        release, releasing = store._release, asyncio.Event()

        async def slow_release(**kwargs):
            releasing.set()
            await asyncio.sleep(0.2)  # a Redis round trip under load
            return await release(**kwargs)

        store._release = slow_release

        async def turn():
            async with store.turn_lock(sid):
                pass

        running = asyncio.ensure_future(turn())
        await releasing.wait()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        with redis.Redis.from_url(redis_url) as client:
            deadline = time.monotonic() + 10
            while client.exists(f"warmpath:{{{sid}}}:lock"):  # the shielded release finishes on its own
                assert time.monotonic() < deadline, "the lock was left held"
                await asyncio.sleep(0.05)
        store._release = release
        async with store.turn_lock(sid):
            return True

    assert _run(redis_url, scenario, lock_ttl_s=30)


def test_a_commit_whose_reply_was_lost_is_settled_saved_or_voided(redis_url):
    """A commit Redis ran but whose reply was lost is reported saved; one that had not run is reported not saved
    and refused if it arrives later, so a turn reported failed is never saved after all."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        real_commit, sent = store._commit, []

        async def ran_then_reply_lost(keys, args):
            await real_commit(keys=keys, args=args)
            raise RedisTimeoutError("Timeout reading from socket")

        async def not_arrived_yet(keys, args):
            sent.append((keys, args))
            raise RedisConnectionError("Connection reset by peer")

        store._commit = ran_then_reply_lost
        saved = await store.commit_turn(sid, 0, _turn(0), [_stats(0)])
        store._commit = not_arrived_yet
        with pytest.raises(StoreUnavailable, match=r"unreachable \(no connection\); the turn was not saved"):
            await store.commit_turn(sid, saved, _turn(1), [_stats(1)])
        assert len(sent) == 2  # settled as never run, it was sent once more, and lost again
        for keys, args in reversed(sent):
            with pytest.raises(ResponseError, match="WARMPATH_VOIDED"):
                await real_commit(keys=keys, args=args)  # arriving late, either attempt is refused

        async def redis_gone(keys, args):
            raise RedisConnectionError("Connection refused")

        store._settle = redis_gone
        with pytest.raises(StoreUnavailable, match="whether it was saved is unknown"):
            await store.commit_turn(sid, saved, _turn(1), [_stats(1)])
        return saved, await store.transcript(sid)

    saved, snapshot = _run(redis_url, scenario)
    assert saved == 2 and snapshot.messages == tuple(_turn(0))


def test_a_commit_settled_as_never_run_is_sent_once_more_and_saved(redis_url):
    """A Redis restart during a turn: the commit's connection is dead, the settling finds it never ran, and the
    turn is saved by a second attempt instead of answered 503 (its work lost though nothing was written). The
    first attempt, arriving late, is refused."""

    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
        sid = record.session_id
        real_commit, sent = store._commit, []

        async def first_lost(keys, args):
            sent.append(list(args))
            if len(sent) == 1:
                raise RedisConnectionError("Connection reset by peer")
            return await real_commit(keys=keys, args=args)

        store._commit = first_lost
        saved = await store.commit_turn(sid, 0, _turn(0), [_stats(0)])
        with pytest.raises(ResponseError, match="WARMPATH_VOIDED"):
            await real_commit(keys=store._keys(sid) + [store._key(sid, "lock")], args=sent[0])
        return saved, len(sent), await store.transcript(sid)

    saved, num_sent, snapshot = _run(redis_url, scenario)
    assert (saved, num_sent, snapshot.length) == (2, 2, 2) and snapshot.messages == tuple(_turn(0))


def test_a_turn_committing_after_a_redis_restart_is_saved(tmp_path):
    """A Redis with AOF restarts (killed) while a turn runs: the turn's commit goes out on a dead pooled
    connection, is settled as never run, and saved by its second attempt under the lock it still holds."""
    port, aof = free_port(), ("--appendonly", "yes", "--appendfsync", "always")
    loop = asyncio.new_event_loop()
    with _own_redis(tmp_path, port, *aof) as (url, _):
        store = SessionStore.from_url(url)
        sid = loop.run_until_complete(store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")).session_id
        lock = store.turn_lock(sid)
        token = loop.run_until_complete(lock.__aenter__())
    with _own_redis(tmp_path, port, *aof):  # the same port and data directory: the session and lock reloaded

        async def commit_after_restart():
            saved = await store.commit_turn(sid, 0, _turn(0), [_stats(0)], lock_token=token)
            await lock.__aexit__(None, None, None)
            snapshot = await store.transcript(sid)
            await store.aclose()
            return saved, snapshot

        saved, snapshot = loop.run_until_complete(commit_after_restart())
    loop.close()
    assert saved == 2 and snapshot.messages == tuple(_turn(0))


def test_a_turn_cancelled_right_after_taking_its_lock_frees_it(redis_url):
    async def scenario(store):
        record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")

        async def client_left(owner_key_id):
            raise asyncio.CancelledError

        store._touch_owner = client_left
        with pytest.raises(asyncio.CancelledError):
            async with store.turn_lock(record.session_id, "k"):
                pass
        with redis.Redis.from_url(redis_url) as client:
            return client.exists(f"warmpath:{{{record.session_id}}}:lock")

    assert _run(redis_url, scenario) == 0


def test_a_full_redis_refuses_a_commit_that_compacts_before_it_writes(tmp_path):
    """A compaction's first write is LTRIM, which a full Redis lets through: the commit is refused up front."""
    summary = Message(role="user", content="summary\nFacts:\n- ORD-98231", name="warmpath-context-summary")
    with _own_redis(tmp_path) as (url, _):

        async def scenario(store):
            record = await store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")
            sid = record.session_id
            length = await store.commit_turn(sid, 0, _turn(0), [_stats(0)])
            _fill_up(url)
            with pytest.raises(StoreUnavailable, match="out of memory"):
                await store.commit_turn(sid, length, _turn(1), [_stats(1)],
                                        compaction=Compaction(num_messages_replaced=2, summary=summary))
            return await store.transcript(sid)

        snapshot = _run(url, scenario)
        assert snapshot.messages == tuple(_turn(0)) and snapshot.length == 2


def test_a_lock_a_redis_crash_kept_is_freed_as_soon_as_redis_is_back(tmp_path):
    """A turn cut off by a Redis crash could not free its lock, which Redis's AOF kept: once Redis was back the
    session answered every turn, the client's retry of that one too, `409 session_busy` until the lock expired."""
    port, aof = free_port(), ("--appendonly", "yes", "--appendfsync", "always")
    loop = asyncio.new_event_loop()
    with _own_redis(tmp_path, port, *aof) as (url, _):
        store = SessionStore.from_url(url, lock_ttl_s=60.0)
        sid = loop.run_until_complete(store.create(REQUEST, owner_key_id="k", prefix_fingerprint="fp")).session_id
        lock = store.turn_lock(sid)
        loop.run_until_complete(lock.__aenter__())
    # Redis is down: the turn ends, and its lock cannot be freed now.
    loop.run_until_complete(lock.__aexit__(None, None, None))
    with _own_redis(tmp_path, port, *aof):  # back, with the lock its AOF kept (60 s of it)

        async def next_turn_within(timeout_s: float) -> float:
            started = time.monotonic()
            while True:
                try:
                    async with store.turn_lock(sid):
                        return time.monotonic() - started
                except SessionBusy:
                    if time.monotonic() - started > timeout_s:
                        raise
                    await asyncio.sleep(0.1)  # polling the lock: the outcome under test

        waited_s = loop.run_until_complete(next_turn_within(10.0))
        loop.run_until_complete(store.aclose())
    loop.close()
    assert waited_s < 10.0  # freed by the release tried again, not by the lock's 60 s expiry
