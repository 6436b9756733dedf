import asyncio
import json
import math
import shutil
import stat
import subprocess
import time

import pytest
import redis
from pydantic import ValidationError
from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from typer.testing import CliRunner

from cluster import api_keys, local
from cluster.api_keys import (
    MAX_BUCKET_TTL_MS,
    ApiKeyRecord,
    ApiKeyStore,
    InvalidStoreUrl,
    KeyIdTaken,
    KeyListing,
    KeyRevoked,
    UnreadableKey,
    generate_api_key,
    hash_api_key,
    key_id_of,
    run_with_store,
)
from cluster.cli import app
from cluster.config import ClusterConfig
from cluster.redis_errors import redis_refusal
from serve_apps.access import AccessDenied, credentials_from


def _record(permissions):
    return ApiKeyRecord(key_id="key_x", name="n", permissions=tuple(permissions), requests_per_s=1, burst=1, created_at_s=0)


@pytest.mark.parametrize("held, required, missing", [
    (["orders:read"], ["orders:read"], []),
    (["orders:read"], ["orders:read", "payments:write"], ["payments:write"]),
    ([], ["a", "b"], ["a", "b"]),
    (["*"], ["anything", "at:all"], []),
    (["orders:read"], [], []),
])
def test_missing_permissions(held, required, missing):
    assert _record(held).missing_permissions(required) == missing


def test_generated_keys_are_unique_prefixed_and_hash_to_stable_ids():
    keys = {generate_api_key() for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith("wp_") and len(k) >= 40 for k in keys)
    key = next(iter(keys))
    assert hash_api_key(key) == hash_api_key(key) != hash_api_key(key + "x")
    assert key_id_of(hash_api_key(key)).startswith("key_") and key not in key_id_of(hash_api_key(key))


@pytest.mark.parametrize("headers, key", [
    ([("Authorization", "Bearer wp_abc")], "wp_abc"),
    ([("authorization", "bearer   wp_abc  ")], "wp_abc"),
    ([("x-api-key", "wp_abc")], "wp_abc"),
    ([("authorization", "Basic dXNlcg==")], None),
    ([("authorization", "Bearer ")], None),
    ([], None),
    ([("content-type", "application/json")], None),
])
def test_credentials_from_headers_or_metadata(headers, key):
    assert credentials_from(headers) == key


@pytest.mark.parametrize("retry_after_s, header", [(None, None), (0.2, "1"), (1.0, "1"), (2.4, "3")])
def test_denials_round_retry_after_up_to_whole_seconds(retry_after_s, header):
    denied = AccessDenied(429, "rate_limited", "slow down", retry_after_s)
    assert denied.headers().get("retry-after") == header
    assert denied.body()["error"] == {"message": "slow down", "type": "RateLimitError", "param": None, "code": "rate_limited"}


@pytest.mark.parametrize("days", ["0", "-1"])
def test_keys_create_refuses_an_expiry_not_in_the_future_before_touching_the_store(days):
    result = CliRunner().invoke(app, ["keys", "create", "--name", "x", "--expires-in-days", days,
                                      "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2
    assert "--expires-in-days must be > 0" in result.output


def test_records_written_before_expiry_existed_still_load():
    raw = '{"key_id": "key_x", "name": "n", "permissions": ["*"], "requests_per_s": 1.0, "burst": 1, "created_at_s": 0}'
    assert ApiKeyRecord.model_validate_json(raw).expires_at_s is None


UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"  # nothing listens: a flag check that lets a call through exits 1, not 2


@pytest.mark.parametrize("field, value", [
    ("requests_per_s", float("inf")),
    ("requests_per_s", float("nan")),
    ("requests_per_s", 0),
    ("created_at_s", float("inf")),
    ("expires_at_s", float("inf")),
    ("expires_at_s", float("nan")),
])
def test_records_refuse_non_finite_and_non_positive_values(field, value):
    fields = {"key_id": "key_x", "name": "n", "permissions": ("*",), "requests_per_s": 1, "burst": 1, "created_at_s": 0}
    with pytest.raises(ValidationError, match=field):
        ApiKeyRecord(**{**fields, field: value})


@pytest.mark.parametrize("flags, message", [
    (["--requests-per-s", "inf"], "--requests-per-s must be a finite number > 0, got inf"),
    (["--requests-per-s", "nan"], "--requests-per-s must be a finite number > 0, got nan"),
    (["--requests-per-s", "0"], "--requests-per-s must be a finite number > 0"),
    (["--burst", "0"], "--burst must be 1 to 1000000000, got 0"),
    (["--burst", "1" + "0" * 400], "--burst must be 1 to 1000000000, got 1000"),
    (["--expires-in-days", "inf"], "--expires-in-days must be at most 36500"),
    (["--expires-in-days", "nan"], "--expires-in-days must be > 0, got nan"),
    (["--expires-in-days", "1e-12"], "--expires-in-days must be at least 1 minute"),
    (["-p", ""], "--permission must be non-empty and contain no whitespace, got ''"),
    (["-p", "orders:read", "-p", "a b"], "--permission must be non-empty and contain no whitespace, got 'a b'"),
    (["-p", " "], "got ' '"),
    (["--max-sessions", "0"], "--max-sessions must be at least 1, got 0"),
    (["--max-sessions", "5", "-p", "*"], "--max-sessions does not apply to a key holding '*'"),
])
def test_keys_create_refuses_bad_flags_on_one_line_before_touching_the_store(flags, message):
    result = CliRunner().invoke(app, ["keys", "create", "--name", "x", *flags, "--redis-url", UNREACHABLE_REDIS])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert message in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["", "   ", "n" * 129])
def test_keys_create_refuses_names_the_record_cannot_hold(name):
    result = CliRunner().invoke(app, ["keys", "create", "--name", name, "--redis-url", UNREACHABLE_REDIS])
    assert result.exit_code == 2 and "--name must be 1 to 128 characters" in result.output


@pytest.mark.parametrize("command", [
    ["keys", "create", "--name", "caf\udce9"], ["keys", "create", "--name", "x", "-p", "\udcff"],
    ["keys", "revoke", "key_\udcff"],
])
def test_keys_commands_refuse_arguments_a_terminal_passed_as_bytes_that_are_not_utf8(command):
    """A terminal in another encoding hands Python such bytes as lone surrogates: Redis' client, the record
    model or its JSON writer failed on them with a traceback."""
    result = CliRunner().invoke(app, [*command, "--redis-url", UNREACHABLE_REDIS])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "must be UTF-8 text" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["keys", "list"], ["keys", "revoke", "key_x"], ["keys", "create", "--name", "x"]])
def test_keys_commands_refuse_a_redis_url_that_is_not_one(command):
    result = CliRunner().invoke(app, [*command, "--redis-url", "notaurl"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.output.strip() == "--redis-url must be a redis://, rediss:// or unix:// URL, got 'notaurl'"


def test_the_store_refuses_a_url_that_is_not_redis():
    with pytest.raises(InvalidStoreUrl):
        ApiKeyStore.from_url("notaurl")


class _RecordsOnlyRedis:
    """Just enough of redis.asyncio.Redis for `list`, `lookup` and `authorize` over fixed records."""

    def __init__(self, records_by_hash: dict[str, str], authorize_reply: list | None = None) -> None:
        self._records = records_by_hash
        self._authorize_reply = authorize_reply

    def register_script(self, _source):
        async def run(keys, args):
            return self._authorize_reply

        return run

    async def execute_command(self, command, cursor, *args, **options):  # SCAN, its names undecoded
        assert command == "SCAN" and options
        return 0, [("warmpath:apikey-id:" + json.loads(raw)["key_id"]).encode() for raw in self._records.values()]

    async def get(self, id_key):
        key_id = id_key.rpartition(":")[2]
        return next((h for h, raw in self._records.items() if json.loads(raw)["key_id"] == key_id), None)

    async def hget(self, key, field):
        return self._records.get(key.rpartition(":")[2])

    async def time(self):
        return 1_700_000_000, 0

    def pipeline(self, transaction):
        raise AssertionError("nothing may be written")

    async def aclose(self):
        pass


GOOD_RAW = '{"key_id": "key_good", "name": "g", "permissions": ["*"], "requests_per_s": 5.0, "burst": 2, "created_at_s": 1}'
# What pydantic wrote for `requests_per_s=inf` before records refused it: JSON has no infinity.
NULL_RATE_RAW = '{"key_id": "key_nullrate", "name": "b", "permissions": ["*"], "requests_per_s": null, "burst": 2, "created_at_s": 2}'


def test_list_reports_unreadable_records_apart_instead_of_raising():
    store = ApiKeyStore(_RecordsOnlyRedis({"h1": NULL_RATE_RAW, "h2": GOOD_RAW}))
    listing = asyncio.run(store.list())
    assert [r.key_id for r in listing.records] == ["key_good"]
    assert listing.unreadable == [UnreadableKey(key_id="key_nullrate", problem="requests_per_s: Input should be a valid number")]


def test_keys_list_prints_the_readable_keys_and_one_warning_per_unreadable_one(monkeypatch):
    redis = _RecordsOnlyRedis({"h1": NULL_RATE_RAW, "h2": GOOD_RAW})
    monkeypatch.setattr(ApiKeyStore, "from_url", classmethod(lambda cls, url: cls(redis)))
    result = CliRunner().invoke(app, ["keys", "list", "--redis-url", UNREACHABLE_REDIS])
    assert result.exit_code == 0 and result.exception is None, result.output
    lines = result.output.strip().splitlines()
    assert json.loads(lines[0])["key_id"] == "key_good"
    assert lines[1].startswith("warning: key key_nullrate has an unreadable record (requests_per_s:")
    assert "warmpath keys revoke key_nullrate" in lines[1] and len(lines) == 2


@pytest.mark.parametrize("reply", [
    [2, NULL_RATE_RAW],  # the script found no usable rate or burst
    [1, NULL_RATE_RAW, 1, 0],  # a record the script could use but the model refuses
    [2, GOOD_RAW],
])
def test_authorize_refuses_a_key_whose_record_is_unusable_as_unknown(reply):
    store = ApiKeyStore(_RecordsOnlyRedis({}, authorize_reply=reply))
    outcome = asyncio.run(store.authorize("wp_any"))
    assert outcome.record is None and not outcome.is_allowed


def test_lookup_treats_an_unreadable_record_as_no_record():
    store = ApiKeyStore(_RecordsOnlyRedis({hash_api_key("wp_k"): NULL_RATE_RAW}))
    assert asyncio.run(store.lookup("wp_k")) is None


@pytest.mark.parametrize("kwargs, error", [
    ({"requests_per_s": float("inf")}, ValidationError),
    ({"requests_per_s": float("nan")}, ValidationError),
    ({"expires_in_s": float("inf")}, ValueError),
    ({"expires_in_s": float("nan")}, ValueError),
    # Redis refuses so long an expiry inside the transaction, after the key is stored: it never expired.
    ({"expires_in_s": 1e16}, ValueError),
    ({"expires_in_s": 36_501 * 86_400.0}, ValueError),
])
def test_create_refuses_non_finite_values_before_writing(kwargs, error):
    store = ApiKeyStore(_RecordsOnlyRedis({}))
    with pytest.raises(error):
        asyncio.run(store.create("n", ["*"], **{"requests_per_s": 1.0, "burst": 1, **kwargs}))


def test_key_listing_is_empty_for_an_empty_store():
    assert asyncio.run(ApiKeyStore(_RecordsOnlyRedis({})).list()) == KeyListing(records=[], unreadable=[])


@pytest.mark.parametrize("error, meaning", [
    (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "out of memory"),
    (ReadOnlyError("You can't write against a read only replica."), "read-only replica"),
    (ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."), "MISCONF"),
    (ResponseError("Command # 1 (HSET k record {...}) of pipeline caused error: MISCONF Redis is ..."), "MISCONF"),
    (ResponseError("DB index is out of range"), "database number"),
    (ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."), "BUSY"),
    (ResponseError("NOREPLICAS Not enough good replicas to write."), "min-replicas-to-write"),
    (TryAgainError("Multiple keys request during rehashing of slot"), "TRYAGAIN"),
    (ClusterDownError("The cluster is down"), "cluster is down"),
    (MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."), "MASTERDOWN"),
    (ResponseError("BUSYKEY Target key name already exists."), None),
    (ResponseError("WARMPATH_STALE 4"), None),  # the scripts' own answers are not outages
    (ResponseError("Error running script (call to f_1234): @user_script:3: bad argument"), None),
    (ResponseError("Command # 1 (SET k 'MISCONF') of pipeline caused error: ERR syntax error"), None),
])
def test_redis_refusals_name_the_state_of_redis_and_nothing_else_is_one(error, meaning):
    refusal = redis_refusal(error)
    assert refusal is None if meaning is None else meaning in refusal


# ---- against a real Redis: the scripts, transactions and expiries Redis itself runs ----


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A private redis-server on a unix socket (no TCP port to collide with), ready when its log says so."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    folder = tmp_path_factory.mktemp("redis")
    socket_path = folder / "redis.sock"
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(socket_path), "--save", "", "--appendonly", "no",
         "--dir", str(folder)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        for line in server.stdout:
            if "ready to accept connections" in line.lower():
                break
        else:
            pytest.fail("redis-server exited before accepting connections")
        yield f"unix://{socket_path}"
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


@pytest.fixture
def redis_url(redis_server):
    """The private Redis, emptied for each test."""
    client = redis.Redis.from_url(redis_server, decode_responses=True)
    client.flushall()
    yield redis_server
    client.close()


def _admin_cfg(tmp_path) -> ClusterConfig:
    return ClusterConfig.model_validate({"state_dir": str(tmp_path / "state")})


def test_a_revoked_key_stays_refused_and_cannot_be_registered_again(redis_url):
    async def work(store):
        key, record = await store.create("k", ["*"], 10.0, 10)
        assert await store.revoke(record.key_id)
        outcome = await store.authorize(key)
        with pytest.raises(KeyRevoked):
            await store.create("k", ["*"], 10.0, 10, key=key)
        return outcome, await store.lookup(key), await store.revoke(record.key_id)

    outcome, looked_up, is_revoked_again = run_with_store(redis_url, work)
    assert outcome.record is None and not outcome.is_allowed and looked_up is None and not is_revoked_again


# Two keys whose ids (the first 48 bits of their hashes) are the same.
COLLIDING_KEYS = ("wp_44176233", "wp_46117317")


def test_a_key_whose_id_another_key_holds_is_never_stored_under_it(redis_url, monkeypatch):
    """Two keys under one id would share a bucket and each other's sessions, and `revoke <id>` would miss one."""
    first, second = COLLIDING_KEYS
    assert key_id_of(hash_api_key(first)) == key_id_of(hash_api_key(second))
    drawn = iter([second, "wp_" + "7" * 40])
    monkeypatch.setattr(api_keys, "generate_api_key", lambda: next(drawn))

    async def work(store):
        _, held = await store.create("alice", ["*"], 10.0, 10, key=first)
        with pytest.raises(KeyIdTaken, match=f"API key id {held.key_id}"):
            await store.create("bob", ["*"], 10.0, 10, key=second)
        new_key, new = await store.create("carol", ["*"], 10.0, 10)  # drawn again past the taken id
        again = await store.create("alice", ["*"], 10.0, 10, key=first)  # the same key registered again
        return held, new_key, new, again, (await store.authorize(first)).record, await store.lookup(second)

    held, new_key, new, again, alice, bob = run_with_store(redis_url, work)
    assert new_key == "wp_" + "7" * 40 and new.key_id != held.key_id
    assert again[1].key_id == alice.key_id == held.key_id and alice.name == "alice" and bob is None


def test_a_keys_own_session_limit_reaches_its_callers_and_an_unset_one_is_not_stored(redis_url):
    """An unset limit stays out of the stored record, so a build from before it existed still reads the key."""

    async def work(store):
        limited_key, limited = await store.create("limited", [], 10.0, 10, max_sessions=5)
        plain_key, plain = await store.create("plain", [], 10.0, 10)
        return (await store.authorize(limited_key)).record, (await store.authorize(plain_key)).record, plain

    limited, plain, plain_created = run_with_store(redis_url, work)
    assert limited.max_sessions == 5 and plain.max_sessions is None
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        key_hash = client.get("warmpath:apikey-id:" + plain_created.key_id)
        stored = json.loads(client.hget("warmpath:apikey:" + key_hash, "record"))
    assert "max_sessions" not in stored and "expires_at_s" not in stored


def test_a_key_can_be_revoked_on_a_redis_too_full_to_take_writes(redis_url):
    key, record = run_with_store(redis_url, lambda store: store.create("leaked", ["*"], 10.0, 10))
    client = redis.Redis.from_url(redis_url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", client.info("memory")["used_memory"])
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("filler", "x" * 100_000)
        assert run_with_store(redis_url, lambda store: store.revoke(record.key_id))
    finally:
        client.config_set("maxmemory", 0)
    with pytest.raises(KeyRevoked):
        run_with_store(redis_url, lambda store: store.create("leaked", ["*"], 10.0, 10, key=key))


def test_a_key_a_flushed_redis_lost_can_be_registered_again(redis_url):
    key = generate_api_key()
    run_with_store(redis_url, lambda store: store.create("k", ["*"], 10.0, 10, key=key))
    redis.Redis.from_url(redis_url).flushall()
    _, record = run_with_store(redis_url, lambda store: store.create("k", ["*"], 10.0, 10, key=key))
    assert run_with_store(redis_url, lambda store: store.authorize(key)).record == record


def test_up_replaces_a_revoked_admin_key_and_registers_one_redis_lost_again(redis_url, tmp_path):
    cfg = _admin_cfg(tmp_path)
    first = local.ensure_local_api_key(cfg, redis_url, lambda message: None)
    file = local.api_key_file(cfg)
    file.chmod(0o644)
    assert run_with_store(redis_url, lambda store: store.revoke(key_id_of(hash_api_key(first))))

    messages = []
    second = local.ensure_local_api_key(cfg, redis_url, messages.append)
    assert second != first and file.read_text() == second + "\n"
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert f"({key_id_of(hash_api_key(first))}) was revoked" in messages[0]
    assert run_with_store(redis_url, lambda store: store.authorize(first)).record is None
    assert run_with_store(redis_url, lambda store: store.authorize(second)).record.permissions == ("*",)

    redis.Redis.from_url(redis_url).flushall()  # a new or flushed Redis: the same key is registered again
    messages.clear()
    assert local.ensure_local_api_key(cfg, redis_url, messages.append) == second
    assert messages[0].startswith("api key: registered")
    assert run_with_store(redis_url, lambda store: store.authorize(second)).is_allowed


@pytest.mark.parametrize("skew_s", [-600, 3600])
def test_a_keys_expiry_follows_redis_clock_not_the_creating_machines(redis_url, monkeypatch, skew_s):
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)
    key, record = run_with_store(redis_url, lambda store: store.create("k", ["*"], 5.0, 5, expires_in_s=300))
    monkeypatch.setattr(time, "time", real_time)
    client = redis.Redis.from_url(redis_url)
    seconds, microseconds = client.time()
    assert 0 <= seconds + microseconds / 1e6 - record.created_at_s < 60
    assert record.expires_at_s - record.created_at_s == 300
    for entry in ("warmpath:apikey:" + hash_api_key(key), "warmpath:apikey-id:" + record.key_id):
        assert 240_000 < client.pttl(entry) <= 300_000
    assert run_with_store(redis_url, lambda store: store.authorize(key)).is_allowed


def _stored(redis_url: str, requests_per_s: float, burst: float) -> str:
    """A key whose record is written as is, as a build without today's bounds could have written it."""
    key = generate_api_key()
    record = {"key_id": key_id_of(hash_api_key(key)), "name": "n", "permissions": ["*"],
              "requests_per_s": requests_per_s, "burst": burst, "created_at_s": 1}
    redis.Redis.from_url(redis_url).hset("warmpath:apikey:" + hash_api_key(key), "record", json.dumps(record))
    return key


@pytest.mark.parametrize("requests_per_s, burst", [(1e-15, 1), (1.0, 1e14), (1000.0, 1e18), (1e-300, 1)])
def test_a_stored_bucket_too_slow_to_refill_is_an_unknown_key_not_a_redis_error(redis_url, requests_per_s, burst):
    key = _stored(redis_url, requests_per_s, burst)
    assert run_with_store(redis_url, lambda store: store.authorize(key)).record is None
    bucket = "warmpath:ratelimit:" + key_id_of(hash_api_key(key))
    assert 0 < redis.Redis.from_url(redis_url).pttl(bucket) <= MAX_BUCKET_TTL_MS


def test_the_slowest_bucket_records_allow_keeps_an_expiry_redis_takes(redis_url):
    key, record = run_with_store(redis_url, lambda store: store.create("k", ["*"], 1e-11, 1))

    async def twice(store):
        return [await store.authorize(key) for _ in range(2)]

    first, second = run_with_store(redis_url, twice)
    assert first.is_allowed and not second.is_allowed and second.retry_after_s == pytest.approx(1e11, rel=1e-6)
    assert redis.Redis.from_url(redis_url).pttl("warmpath:ratelimit:" + record.key_id) > 99_000_000_000_000


@pytest.mark.parametrize("requests_per_s, burst", [(1e-12, 1), (1e-3, 10**9), (1e-15, 1), (1e-4, 10**9)])
def test_records_refuse_a_bucket_that_takes_1e12_s_or_more_to_refill(requests_per_s, burst):
    fields = {"key_id": "key_x", "name": "n", "permissions": ("*",), "created_at_s": 0}
    with pytest.raises(ValidationError, match="must be under 1e\\+12 s"):
        ApiKeyRecord(**fields, requests_per_s=requests_per_s, burst=burst)


@pytest.mark.parametrize("flags, refill", [
    (["--requests-per-s", "1e-15", "--burst", "1"], "1e+15 s"),
    (["--requests-per-s", "0.001", "--burst", "1000000000"], "1e+12 s"),
])
def test_keys_create_refuses_a_bucket_that_takes_1e12_s_or_more_to_refill(flags, refill):
    result = CliRunner().invoke(app, ["keys", "create", "--name", "x", *flags, "--redis-url", UNREACHABLE_REDIS])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip() == (
        f"--burst / --requests-per-s (how long an empty bucket takes to refill) must be under 1e+12 s, got {refill}"
    )


@pytest.mark.parametrize("burst", [10**9 + 1, 10**400])
def test_records_refuse_a_burst_past_the_bound_as_a_validation_error(burst):
    """10**400 made the refill check's division raise OverflowError, which no caller takes for a bad record."""
    fields = {"key_id": "key_x", "name": "n", "permissions": ("*",), "requests_per_s": 1.0, "created_at_s": 0}
    with pytest.raises(ValidationError, match="burst"):
        ApiKeyRecord(**fields, burst=burst)


def test_a_stored_record_with_a_huge_burst_is_an_unknown_key_not_a_crash(redis_url):
    key = generate_api_key()
    raw = ('{"key_id": "%s", "name": "n", "permissions": ["*"], "requests_per_s": 1.0, "burst": 1%s, '
           '"created_at_s": 1}' % (key_id_of(hash_api_key(key)), "0" * 400))
    client = redis.Redis.from_url(redis_url)
    client.hset("warmpath:apikey:" + hash_api_key(key), "record", raw)
    client.set("warmpath:apikey-id:" + key_id_of(hash_api_key(key)), hash_api_key(key))
    assert run_with_store(redis_url, lambda store: store.authorize(key)).record is None
    assert run_with_store(redis_url, lambda store: store.lookup(key)) is None
    listing = run_with_store(redis_url, lambda store: store.list())
    assert [unreadable.key_id for unreadable in listing.unreadable] == [key_id_of(hash_api_key(key))]


def test_an_expiring_key_expires_at_the_instant_its_record_names(redis_url, monkeypatch):
    """The write comes round trips after Redis' clock was read: a lifetime counted from it would outlive
    the record's `expires_at_s`."""
    write = ApiKeyStore._write

    async def slow_write(self, key_hash, record):
        await asyncio.sleep(1.0)  # a slow link between reading Redis' clock and the transaction
        await write(self, key_hash, record)

    monkeypatch.setattr(ApiKeyStore, "_write", slow_write)
    key, record = run_with_store(redis_url, lambda store: store.create("k", ["*"], 1.0, 1, expires_in_s=300))
    client = redis.Redis.from_url(redis_url)
    for entry in ("warmpath:apikey:" + hash_api_key(key), "warmpath:apikey-id:" + record.key_id):
        assert client.pexpiretime(entry) == math.floor(record.expires_at_s * 1000)


@pytest.mark.parametrize("url, shown", [
    ("redis://:S3cretPass@127.0.0.1:1/0", "redis://:***@127.0.0.1:1/0"),
    ("redis://127.0.0.1:1/0?password=S3cretPass", "redis://127.0.0.1:1/0?password=***"),  # redis-py reads it there
])
def test_a_keys_command_never_prints_the_redis_password(url, shown):
    result = CliRunner().invoke(app, ["keys", "list", "--redis-url", url])
    assert result.exit_code == 1 and "is unavailable" in result.output
    assert "S3cretPass" not in result.output and shown in result.output
