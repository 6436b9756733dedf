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


def test_a_call_served_elsewhere_than_chosen_reports_a_fallback():
    """The chosen replica was full and Serve sent the call on: its decision's reason (here a prefix hit)
    described a replica that did not serve it."""
    from router.decision_log import FALLBACK_REASON, served_reason

    decision = Decision(ranked_tiers=[["r1"], ["r2"]], reason="prefix-hit", predicted_cached_tokens={"r1": 64},
                        scores={})
    assert served_reason(decision, "r1") == "prefix-hit"
    assert served_reason(decision, None) == "prefix-hit"  # not known where it went: as decided
    assert served_reason(decision, "r2") == FALLBACK_REASON == "fallback"


def test_the_http_headers_and_the_decision_metric_say_fallback(monkeypatch):
    from serve_apps import ingress_http, metrics
    from serve_apps.vllm_replica import ServedBy

    decision = Decision(ranked_tiers=[["r1"], ["r2"]], reason="prefix-hit", predicted_cached_tokens={"r1": 64},
                        scores={})
    monkeypatch.setattr(ingress_http.decision_log, "pop_current", lambda: LoggedDecision(decision, 0, 0))
    headers, _ = ingress_http._route_headers(ServedBy("r2"))
    assert headers["x-warmpath-route"] == "fallback" and headers["x-warmpath-predicted-cached-tokens"] == "0"
    reasons = []
    recorder = type("Metrics", (), {"record_usage": lambda *args: None,
                                    "record_decision": lambda self, reason, *args: reasons.append(reason)})()
    monkeypatch.setattr(metrics.WarmpathMetrics, "get", classmethod(lambda cls: recorder))
    metrics.record_model_call(LoggedDecision(decision, 0, 0), "r2", 100, 0)
    metrics.record_model_call(LoggedDecision(decision, 0, 0), "r1", 100, 64)
    assert reasons == ["fallback", "prefix-hit"]
