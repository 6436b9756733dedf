"""Per-key session quotas in the session store, against a real redis-server started for this module."""

import asyncio
import time

import pytest
import redis

from serve_apps.orchestrator.owner_sessions import (
    PRUNE_BATCH,
    RESERVATION_GRACE_MS,
    SessionQuota,
    SessionQuotaExceeded,
)
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


def test_a_creation_redis_refuses_gives_its_place_back_at_once(redis_url):
    """Redis fills up between the place and the record: the refused write frees the place (ZREM runs when full)."""

    async def scenario(store):
        real_reserve = store._owners.reserve

        async def reserve_then_fill(*args):
            await real_reserve(*args)
            with redis.Redis.from_url(redis_url) as client:
                client.config_set("maxmemory-policy", "noeviction")
                client.config_set("maxmemory", 1)

        store._owners.reserve = reserve_then_fill
        try:
            with pytest.raises(StoreUnavailable, match="out of memory"):
                await _create(store, "k-refused", SessionQuota(limit=1))
        finally:
            with redis.Redis.from_url(redis_url) as client:
                client.config_set("maxmemory", 0)
        store._owners.reserve = real_reserve
        return await _create(store, "k-refused", SessionQuota(limit=1))

    sid = _run(redis_url, scenario)
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zrange(_index("k-refused"), 0, -1) == [sid]


def test_a_creation_whose_outcome_is_unknown_is_removed_and_gives_its_place_back(redis_url, monkeypatch):
    """A lost reply may hide a write that landed, but its id never reached the client: the session is deleted
    and uncounted at once, so a retry of the creation finds its place free."""

    def reply_lost(self, **kwargs):
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    async def scenario(store):
        with redis.Redis.from_url(redis_url) as client:
            before = set(client.scan_iter("warmpath:{*}:meta"))
        with monkeypatch.context() as patched:
            patched.setattr(SessionRecord, "model_dump_json", reply_lost)
            with pytest.raises(StoreUnavailable):
                await _create(store, "k-lost", SessionQuota(limit=1))
        with redis.Redis.from_url(redis_url) as client:
            assert client.zcard(_index("k-lost")) == 0 and set(client.scan_iter("warmpath:{*}:meta")) == before
        return await _create(store, "k-lost", SessionQuota(limit=1))

    sid = _run(redis_url, scenario)
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zrange(_index("k-lost"), 0, -1) == [sid]


@pytest.mark.parametrize("fault", ["reply lost", "cancelled"])
def test_a_creation_whose_reservation_reply_never_came_gives_its_place_back(redis_url, fault):
    """The reservation landed but its reply was lost, or the call was cancelled while it was on its way: the
    place stayed taken for its grace (60 s) with no session behind it, and the key's next creation was 429."""
    owner = f"k-gone-{fault.split()[0]}"

    async def scenario(store):
        real = store._owners._reserve

        async def reserved_then(*args, **kwargs):
            await real(*args, **kwargs)  # Redis took the place...
            if fault == "reply lost":
                raise redis.exceptions.TimeoutError("Timeout reading from socket")  # ...and its reply was lost
            await asyncio.Event().wait()  # ...and the caller leaves while the reply is on its way

        store._owners._reserve = reserved_then
        creation = asyncio.ensure_future(_create(store, owner, SessionQuota(limit=1)))
        deadline = time.monotonic() + 30
        with redis.Redis.from_url(redis_url) as client:
            while fault == "cancelled" and not client.zcard(_index(owner)):
                assert time.monotonic() < deadline, "the creation never took its place"
                await asyncio.sleep(0.01)  # the place is taken
        if fault == "cancelled":
            creation.cancel()
        with pytest.raises(asyncio.CancelledError if fault == "cancelled" else StoreUnavailable):
            await creation
        store._owners._reserve = real
        with redis.Redis.from_url(redis_url) as client:
            assert client.zcard(_index(owner)) == 0
        return await _create(store, owner, SessionQuota(limit=1))

    sid = _run(redis_url, scenario)
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zrange(_index(owner), 0, -1) == [sid]


def test_a_creation_whose_outcome_stays_unknown_holds_its_place_until_its_record_is_looked_up(redis_url, monkeypatch):
    """When Redis is away for the delete too, the place is held for the grace, then settled by the record."""

    def reply_lost(self, **kwargs):
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    async def delete_lost(keys):
        raise redis.exceptions.ConnectionError("Connection refused")

    async def scenario(store):
        with monkeypatch.context() as patched:
            patched.setattr(SessionRecord, "model_dump_json", reply_lost)
            patched.setattr(store, "_delete", delete_lost)
            with pytest.raises(StoreUnavailable):
                await _create(store, "k-unknown", SessionQuota(limit=1))
        with redis.Redis.from_url(redis_url, decode_responses=True) as client:
            (held, score), = client.zrange(_index("k-unknown"), 0, -1, withscores=True)
            with pytest.raises(SessionQuotaExceeded):
                await _create(store, "k-unknown", SessionQuota(limit=1))
            client.zadd(_index("k-unknown"), {held: 1})  # the grace has passed: no record was written
            return held, score, await _create(store, "k-unknown", SessionQuota(limit=1))

    held, score, sid = _run(redis_url, scenario)
    assert 0 < score - time.time() * 1000 <= RESERVATION_GRACE_MS
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zrange(_index("k-unknown"), 0, -1) == [sid]


def test_a_place_whose_record_landed_late_stays_counted_after_its_grace(redis_url):
    async def scenario(store):
        await store._owners.reserve("k-late", SessionQuota(limit=1), "late-session")
        with redis.Redis.from_url(redis_url) as client:
            client.hset("warmpath:{late-session}:meta", "removed", 0)  # the write that landed after its reply was lost
            client.pexpire("warmpath:{late-session}:meta", 3_600_000)
            client.zadd(_index("k-late"), {"late-session": 1})
        with pytest.raises(SessionQuotaExceeded):
            await _create(store, "k-late", SessionQuota(limit=1))

    _run(redis_url, scenario)
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert client.zscore(_index("k-late"), "late-session") > time.time() * 1000 + 3_500_000


def test_sessions_counted_under_a_longer_ttl_are_looked_up_once_it_is_lowered(redis_url):
    """A redeploy lowered session_ttl_s: scores from the old TTL lie past any session's life and are checked."""

    async def scenario():
        before = SessionStore.from_url(redis_url, ttl_s=3600)
        after = SessionStore.from_url(redis_url, ttl_s=60)
        try:
            gone = [await _create(before, "k-ttl", SessionQuota(limit=2)) for _ in range(2)]
            with redis.Redis.from_url(redis_url) as client:
                # Settled under the old TTL (scored by what their records had left), then one expired sooner.
                old_expiry = time.time() * 1000 + 3_500_000
                client.zadd(_index("k-ttl"), {gone[0]: old_expiry, gone[1]: old_expiry})
                client.delete(f"warmpath:{{{gone[0]}}}:meta")
            return gone, await _create(after, "k-ttl", SessionQuota(limit=2))
        finally:
            await before.aclose()
            await after.aclose()

    gone, sid = asyncio.run(scenario())
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        members = dict(client.zrange(_index("k-ttl"), 0, -1, withscores=True))
    assert set(members) == {gone[1], sid}
    assert members[gone[1]] <= time.time() * 1000 + 60_000  # scored again by what it has left


def test_a_keys_count_lasts_as_long_as_its_sessions(redis_url):
    """The index expires with its key's last session: a creation and each turn keep it `ttl_s` ahead."""

    async def scenario(store):
        sid = await _create(store, "k-index", SessionQuota(limit=None))
        with redis.Redis.from_url(redis_url) as client:
            at_creation = client.pttl(_index("k-index"))
            client.pexpire(_index("k-index"), 1000)
            async with store.turn_lock(sid, "k-index"):
                in_turn = client.pttl(_index("k-index"))
            client.pexpire(_index("k-index"), 1000)
            async with store.turn_lock(sid):  # an uncounted key's turn touches nothing
                uncounted = client.pttl(_index("k-index"))
            return at_creation, in_turn, uncounted

    at_creation, in_turn, uncounted = _run(redis_url, scenario, ttl_s=3600)
    assert 3_590_000 < at_creation <= 3_600_000 and 3_590_000 < in_turn <= 3_600_000
    assert uncounted <= 1000


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


def test_places_are_scored_by_redis_clock_not_the_hosts(redis_url, monkeypatch):
    """A replica whose clock ran a minute ahead of another's took that one's fresh reservation (no record yet)
    for overdue, dropped it and took the place: the key went over its limit."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # this host's clock, an hour ahead

    async def scenario(store):
        session_id = await _create(store, "k-skewed", SessionQuota(limit=1))
        seconds, microseconds = await store._redis.time()
        return session_id, int(seconds) * 1000 + int(microseconds) // 1000

    session_id, redis_now_ms = _run(redis_url, scenario)
    with redis.Redis.from_url(redis_url) as client:
        score = client.zscore(_index("k-skewed"), session_id)
    assert abs(score - (redis_now_ms + RESERVATION_GRACE_MS)) < 5_000
