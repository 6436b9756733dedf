import pytest

from cluster.api_keys import ApiKeyRecord, generate_api_key, hash_api_key, key_id_of
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
    from typer.testing import CliRunner

    from cluster.cli import app

    result = CliRunner().invoke(app, ["keys", "create", "--name", "x", "--expires-in-days", days,
                                      "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2
    assert "--expires-in-days must be > 0" in result.output


def test_records_written_before_expiry_existed_still_load():
    raw = '{"key_id": "key_x", "name": "n", "permissions": ["*"], "requests_per_s": 1.0, "burst": 1, "created_at_s": 0}'
    assert ApiKeyRecord.model_validate_json(raw).expires_at_s is None
