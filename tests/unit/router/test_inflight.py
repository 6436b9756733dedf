from router.inflight import INFLIGHT_TIMEOUT_S, MAX_INFLIGHT, UNDISPATCHED_TIMEOUT_S, InflightRequests
from router.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


def test_a_burst_of_placements_counts_before_any_completes():
    inflight = InflightRequests()
    for i in range(5):
        inflight.place(f"r{i}", A, 0.0, False)
    inflight.place("r5", B, 0.0, is_dispatched=False)
    assert inflight.counts(1.0) == {A: 5, B: 1}


def test_a_request_counts_once_on_the_replica_it_was_last_placed_on():
    inflight = InflightRequests()
    inflight.place("r", A, 0.0, is_dispatched=False)
    inflight.place("r", B, 0.1, is_dispatched=True)
    assert inflight.counts(1.0) == {B: 1}
    inflight.complete("r")
    inflight.complete("r")  # completing twice is harmless
    assert inflight.counts(1.0) == {}


def test_undispatched_decisions_expire_sooner_than_dispatched_requests():
    inflight = InflightRequests()
    inflight.place("decided", A, 0.0, is_dispatched=False)
    inflight.place("sent", B, 0.0, is_dispatched=True)
    assert inflight.counts(UNDISPATCHED_TIMEOUT_S + 1) == {B: 1}
    assert inflight.counts(INFLIGHT_TIMEOUT_S + 1) == {}


def test_bookkeeping_is_bounded():
    inflight = InflightRequests()
    for i in range(MAX_INFLIGHT + 10):
        inflight.place(f"r{i}", A, 0.0, is_dispatched=True)
    assert inflight.counts(0.0) == {A: MAX_INFLIGHT}
