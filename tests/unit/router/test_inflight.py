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


def test_a_request_routed_on_to_another_replica_counts_there_once():
    inflight = InflightRequests()
    inflight.place("r", A, 0.0, is_dispatched=False)
    inflight.dispatch("r", B, 0.1)
    assert inflight.counts(UNDISPATCHED_TIMEOUT_S + 1) == {B: 1}  # dispatched: not expired with the decisions


def test_a_request_completed_before_it_is_reported_routed_stays_completed():
    """The engine refused it at once: Serve reported it complete before routed; it is in flight nowhere."""
    inflight = InflightRequests()
    inflight.place("r", A, 0.0, is_dispatched=False)
    inflight.complete("r", A)
    inflight.dispatch("r", A, 0.1)
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


def test_counts_agree_with_counting_every_request_through_any_sequence():
    """Per-replica counts kept as requests come and go equal a count over the requests in flight."""
    import random

    rng = random.Random(7)
    inflight = InflightRequests()
    reference: dict[str, tuple[ReplicaId, float, bool]] = {}
    now = 0.0
    for _ in range(5000):
        now += rng.random() * 0.5
        request_id = f"r{rng.randrange(300)}"
        if rng.random() < 0.3:
            inflight.complete(request_id)
            reference.pop(request_id, None)
        else:
            replica_id, is_dispatched = rng.choice([A, B]), rng.random() < 0.5
            inflight.place(request_id, replica_id, now, is_dispatched)
            reference[request_id] = (replica_id, now, is_dispatched)
        timeout = {True: INFLIGHT_TIMEOUT_S, False: UNDISPATCHED_TIMEOUT_S}
        live = [r for r, placed_s, dispatched in reference.values() if now - placed_s <= timeout[dispatched]]
        expected = {r: live.count(r) for r in set(live)}
        assert inflight.counts(now) == expected


def test_the_bound_drops_the_oldest_placement_of_either_kind():
    inflight = InflightRequests()
    inflight.place("oldest", B, 0.0, is_dispatched=False)
    for i in range(MAX_INFLIGHT):
        inflight.place(f"r{i}", A, 1.0, is_dispatched=True)
    assert inflight.counts(1.0) == {A: MAX_INFLIGHT}


class _CountedId(str):
    """A replica id that counts how often it is hashed, i.e. looked up in a dict."""

    num_hashes = 0

    def __hash__(self) -> int:
        _CountedId.num_hashes += 1
        return str.__hash__(self)


def test_reading_the_counts_does_not_walk_every_request_in_flight():
    """Every decision reads them: the cost must not grow with the requests in flight."""
    inflight = InflightRequests()
    replica = _CountedId("a")
    for i in range(1000):
        inflight.place(f"r{i}", replica, 1.0, is_dispatched=True)
    _CountedId.num_hashes = 0
    assert inflight.counts(2.0) == {"a": 1000}
    assert _CountedId.num_hashes < 10


def test_a_rejected_attempts_completion_leaves_its_retry_counted():
    """Serve reports the attempt a full replica rejected complete, possibly after the retry went elsewhere."""
    inflight = InflightRequests()
    inflight.place("r", A, 0.0, is_dispatched=True)
    inflight.place("r", B, 0.1, is_dispatched=True)  # A rejected it; the retry runs on B
    assert not inflight.complete("r", A)
    assert inflight.counts(1.0) == {B: 1}
    assert inflight.complete("r", B)
    assert inflight.counts(1.0) == {}


def test_a_late_completion_of_an_earlier_call_under_the_same_id_does_not_end_the_next():
    """The steps of one orchestrator turn share Serve's internal id: step 1's completion may come after
    step 2 was placed on the same replica; it ended step 1, while step 2 went on uncounted."""
    inflight = InflightRequests()
    inflight.place("turn", A, 0.0, is_dispatched=False)
    inflight.dispatch("turn", A, 0.1)  # step 1 runs on A
    inflight.place("turn", A, 0.2, is_dispatched=False)  # step 2 chosen, step 1's completion still to come
    inflight.dispatch("turn", A, 0.3)
    assert inflight.complete("turn", A)  # step 1's completion: a request ended on A...
    assert inflight.counts(1.0) == {A: 1}  # ...and step 2 still counts
    assert inflight.complete("turn", A)  # step 2's own
    assert inflight.counts(1.0) == {}


def test_a_late_completion_of_an_earlier_call_elsewhere_leaves_the_next_alone():
    inflight = InflightRequests()
    inflight.place("turn", A, 0.0, is_dispatched=False)
    inflight.dispatch("turn", A, 0.1)
    inflight.place("turn", B, 0.2, is_dispatched=False)
    inflight.dispatch("turn", B, 0.3)
    assert inflight.complete("turn", A)
    assert inflight.counts(1.0) == {B: 1}
    inflight.complete("turn", B)
    assert inflight.counts(1.0) == {}


def test_a_completion_in_time_owes_nothing():
    inflight = InflightRequests()
    inflight.place("turn", A, 0.0, is_dispatched=False)
    inflight.dispatch("turn", A, 0.1)
    inflight.complete("turn", A)  # step 1 ended before step 2 was placed
    inflight.place("turn", A, 0.2, is_dispatched=False)
    inflight.dispatch("turn", A, 0.3)
    assert inflight.counts(1.0) == {A: 1}
    inflight.complete("turn", A)
    assert inflight.counts(1.0) == {}
