"""Per-key session quotas in the session store, against a real redis-server started for this module."""

import asyncio

import pytest
import redis

from serve_apps.orchestrator.owner_sessions import PRUNE_BATCH, SessionQuota, SessionQuotaExceeded
from serve_apps.orchestrator.store import SessionRecord, SessionStore, StoreUnavailable
from tests.integration.test_store_redis import REQUEST, _run


def _index(owner: str) -> str:
    return f"warmpath:{{owner:{owner}}}:sessions"


async def _create(store: SessionStore, owner: str, quota: SessionQuota | None) -> str:
    return (await store.create(REQUEST, owner, "ab" * 32, quota)).session_id


def test_a_key_at_its_limit_is_refused_until_one_of_its_sessions_is_deleted(redis_url):
    two = SessionQuota(limit=2)

    async def scenario(store):
        first = await _create(store, "k-full", two)
        await _create(store, "k-full", two)
        with pytest.raises(SessionQuotaExceeded, match="API key k-full holds 2 live sessions") as refused:
            await _create(store, "k-full", two)
        other_key = await _create(store, "k-other", two)  # another key's count is its own
        assert await store.delete(first, "k-full")
        third = await _create(store, "k-full", two)
        return refused.value, other_key, third

    refused, other_key, third = _run(redis_url, scenario)
    assert (refused.owner_key_id, refused.limit) == ("k-full", 2)
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zcard(_index("k-full")) == 2 and third in client.zrange(_index("k-full"), 0, -1)
        assert client.zrange(_index("k-other"), 0, -1) == [other_key]


def test_a_refused_creation_writes_no_session(redis_url):
    async def scenario(store):
        await _create(store, "k-nothing", SessionQuota(limit=1))
        with redis.Redis.from_url(redis_url) as client:
            before = client.dbsize()
            with pytest.raises(SessionQuotaExceeded):
                await _create(store, "k-nothing", SessionQuota(limit=1))
            return before, client.dbsize()

    before, after = _run(redis_url, scenario)
    assert after == before


def test_sessions_gone_without_a_delete_stop_counting_once_their_expiry_passes(redis_url):
    """Expired (or deleted while the index was not told): dropped by the next creation; live ones stay counted."""
    two = SessionQuota(limit=2)

    async def scenario(store):
        expired = await _create(store, "k-expiry", two)
        outlived = await _create(store, "k-expiry", two)  # a turn kept it alive past its first expiry
        with redis.Redis.from_url(redis_url, decode_responses=True) as client:
            client.delete(f"warmpath:{{{expired}}}:meta")
            client.zadd(_index("k-expiry"), {expired: 1, outlived: 2})  # both recorded expiries have passed
            replacement = await _create(store, "k-expiry", two)
            with pytest.raises(SessionQuotaExceeded):
                await _create(store, "k-expiry", two)
            return expired, outlived, replacement, client.zrange(_index("k-expiry"), 0, -1, withscores=True)

    expired, outlived, replacement, members = _run(redis_url, scenario)
    assert {m for m, _ in members} == {outlived, replacement}
    rescored = dict(members)[outlived]
    assert rescored > 1e12  # scored again by the session's remaining time, from now
    assert expired not in dict(members)


def test_pruning_walks_every_batch_of_gone_sessions(redis_url):
    async def scenario(store):
        with redis.Redis.from_url(redis_url) as client:
            client.zadd(_index("k-batches"), {f"gone-{i}": 1 for i in range(2 * PRUNE_BATCH + 5)})
        sid = await _create(store, "k-batches", SessionQuota(limit=1))
        with redis.Redis.from_url(redis_url, decode_responses=True) as client:
            return sid, client.zrange(_index("k-batches"), 0, -1)

    sid, members = _run(redis_url, scenario)
    assert members == [sid]


def test_creations_racing_for_the_last_places_get_exactly_the_limit(redis_url):
    async def scenario(store):
        outcomes = await asyncio.gather(
            *(_create(store, "k-race", SessionQuota(limit=3)) for _ in range(8)), return_exceptions=True
        )
        return outcomes

    outcomes = _run(redis_url, scenario)
    created = [o for o in outcomes if isinstance(o, str)]
    assert len(created) == 3
    assert all(isinstance(o, SessionQuotaExceeded) for o in outcomes if not isinstance(o, str))
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert sorted(client.zrange(_index("k-race"), 0, -1)) == sorted(created)


def test_keys_without_a_quota_are_not_counted_and_unlimited_ones_are(redis_url):
    async def scenario(store):
        await _create(store, "k-admin", None)
        for _ in range(3):
            await _create(store, "k-unlimited", SessionQuota(limit=None))

    _run(redis_url, scenario)
    with redis.Redis.from_url(redis_url) as client:
        assert not client.exists(_index("k-admin"))
        assert client.zcard(_index("k-unlimited")) == 3


def test_a_creation_whose_write_fails_gives_its_place_back(redis_url, monkeypatch):
    def failing_dump(self, **kwargs):
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    async def scenario(store):
        with monkeypatch.context() as patched:
            patched.setattr(SessionRecord, "model_dump_json", failing_dump)
            with pytest.raises(StoreUnavailable):
                await _create(store, "k-failed", SessionQuota(limit=1))
        return await _create(store, "k-failed", SessionQuota(limit=1))

    sid = _run(redis_url, scenario)
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zrange(_index("k-failed"), 0, -1) == [sid]


def test_a_reservation_retried_after_a_lost_reply_counts_once(redis_url):
    async def scenario(store):
        real, replies = store._owners._reserve, []

        async def reply_lost_once(**kwargs):
            replies.append(await real(**kwargs))
            if len(replies) == 1:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            return replies[-1]

        store._owners._reserve = reply_lost_once
        return await _create(store, "k-retried", SessionQuota(limit=1)), replies

    sid, replies = _run(redis_url, scenario)
    assert replies == [1, 1]  # the retry found its own place taken, not the key full
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zrange(_index("k-retried"), 0, -1) == [sid]
