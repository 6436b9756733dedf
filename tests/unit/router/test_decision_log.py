"""router.decision_log.DecisionLog: each request reads its own decision, even under a shared client request id."""

from __future__ import annotations

from router.decision_log import DecisionLog, LoggedDecision
from router.types import Decision


def logged(replica: str) -> LoggedDecision:
    decision = Decision(ranked_tiers=[[replica]], reason="cold", predicted_cached_tokens={}, scores={})
    return LoggedDecision(decision, 0, 0)


def test_requests_sharing_a_client_request_id_read_their_own_decisions():
    log = DecisionLog()
    first, second = logged("r1"), logged("r2")
    log.put("client-id", "internal-1", first)
    log.put("client-id", "internal-2", second)
    assert log.pop("client-id") is None  # the request id alone names neither
    assert log.pop("client-id", "internal-2") is second
    assert log.pop("client-id", "internal-2") is None  # read once
    assert log.pop("client-id") is first  # now the only one under that id


def test_a_request_routed_again_replaces_its_decision():
    log = DecisionLog()
    log.put("id", "internal", logged("refused-it"))
    again = logged("took-it")
    log.put("id", "internal", again)
    assert log.pop("id", "internal") is again and log.pop("id") is None


def test_the_log_is_bounded_and_forgets_the_oldest_first():
    log = DecisionLog(capacity=2)
    for i in range(3):
        log.put("same-client-id", f"internal-{i}", logged(f"r{i}"))
    assert log.pop("same-client-id", "internal-0") is None
    assert log.pop("same-client-id", "internal-1") is not None
    assert log.pop("same-client-id") is not None  # internal-2, the last left
