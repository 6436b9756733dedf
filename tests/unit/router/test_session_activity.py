"""router.session_activity.SessionActivity and the session-balance scorer it feeds."""

from __future__ import annotations

import pytest

from router.scorers import ScoringState
from router.scorers.session_balance import SessionBalanceScorer
from router.session_activity import SessionActivity
from router.types import ReplicaId, ReplicaLoad, RoutingRequest

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def test_a_session_counts_once_on_its_latest_replica():
    activity = SessionActivity(idle_s=10.0, max_sessions=100)
    activity.touch("s1", A, 0.0)
    activity.touch("s2", A, 1.0)
    activity.touch("s1", B, 2.0)  # moved
    assert dict(activity.counts(2.0)) == {A: 1, B: 1}
    assert len(activity) == 2


def test_idle_sessions_stop_counting():
    activity = SessionActivity(idle_s=10.0, max_sessions=100)
    activity.touch("s1", A, 0.0)
    activity.touch("s2", B, 5.0)
    assert dict(activity.counts(9.9)) == {A: 1, B: 1}
    assert dict(activity.counts(10.0)) == {B: 1}  # s1 idle for exactly idle_s
    activity.touch("s1", A, 12.0)  # comes back
    assert dict(activity.counts(12.0)) == {A: 1, B: 1}
    assert dict(activity.counts(30.0)) == {}


def test_the_least_recently_active_session_is_forgotten_beyond_the_bound():
    activity = SessionActivity(idle_s=100.0, max_sessions=2)
    for i, replica in enumerate([A, B, C]):
        activity.touch(f"s{i}", replica, float(i))
    assert dict(activity.counts(3.0)) == {B: 1, C: 1}


@pytest.mark.parametrize(("idle_s", "max_sessions"), [(0.0, 10), (1.0, 0)])
def test_bad_bounds_raise(idle_s, max_sessions):
    with pytest.raises(ValueError):
        SessionActivity(idle_s, max_sessions)


@pytest.mark.parametrize(
    ("active", "expected"),
    [
        ({}, {A: 1.0, B: 1.0, C: 1.0}),
        ({A: 1}, {A: 0.5, B: 1.0, C: 1.0}),  # one session does not swing the score to 0
        ({A: 9, B: 3}, {A: 0.1, B: 0.7, C: 1.0}),
        ({A: 9, B: 3, ReplicaId("gone"): 50}, {A: 0.1, B: 0.7, C: 1.0}),  # non-candidates are ignored
    ],
)
def test_session_balance_scores_relative_spare_sessions(active, expected):
    idle = {r: ReplicaLoad(0) for r in (A, B, C)}
    state = ScoringState(0, {}, idle, {}, active)
    scores = SessionBalanceScorer().score(RoutingRequest([1, 2], "m", session_id="s"), [A, B, C], state)
    assert scores == pytest.approx(expected)
    assert SessionBalanceScorer().score(RoutingRequest([1, 2], "m"), [A, B, C], state) == {}  # no session to place


def test_counts_besides_leave_out_the_asking_session_only():
    activity = SessionActivity(idle_s=10.0, max_sessions=100)
    activity.touch("s1", A, 0.0)
    activity.touch("s2", A, 1.0)
    activity.touch("s3", B, 2.0)
    assert dict(activity.counts_besides("s3", 3.0)) == {A: 2}
    assert dict(activity.counts_besides("s1", 3.0)) == {A: 1, B: 1}
    assert dict(activity.counts_besides("new", 3.0)) == {A: 2, B: 1}
    assert dict(activity.counts_besides(None, 3.0)) == {A: 2, B: 1}
    assert dict(activity.counts(3.0)) == {A: 2, B: 1}  # the table itself is unchanged


def test_a_restored_session_takes_its_place_by_time_and_expires_when_it_would_have():
    activity = SessionActivity(idle_s=10.0, max_sessions=100)
    activity.touch("s1", A, 0.0)
    activity.touch("s2", B, 5.0)
    before = activity.entry("s1")
    activity.touch("s1", C, 6.0)  # a decision Serve then asks again for
    activity.restore("s1", before)
    assert activity.entry("s1") == (A, 0.0) and dict(activity.counts(6.0)) == {A: 1, B: 1}
    assert dict(activity.counts(10.0)) == {B: 1}  # expired at 0 + idle_s, not held back behind s2
    activity.touch("new", A, 11.0)
    activity.restore("new", None)  # untracked before: forgotten again
    assert activity.entry("new") is None and dict(activity.counts(11.0)) == {B: 1}


def test_a_decision_serve_asks_again_for_leaves_an_idle_session_idle():
    """Undone, the first choice had still marked the session active: asked again, session affinity drew the
    idle session back to its old replica, which held none of its history (README: `router.session_idle_s`)."""
    import random

    from cluster.config import RouterConfig
    from router.index import PrefixIndex
    from router.policy import PrefixAwarePolicy

    policy = PrefixAwarePolicy(RouterConfig(), 4, rng=random.Random(0))
    index, sessions = PrefixIndex(4, 10_000, "m"), {}
    first = policy.choose(RoutingRequest(list(range(40)), "m", session_id="s"), [A, B],
                          {A: ReplicaLoad(0), B: ReplicaLoad(3)}, index, sessions, 0.0)
    assert first.replica_id == A
    later = RoutingRequest(list(range(5000, 5040)), "m", session_id="s")  # long idle; A runs a request, B none
    loads = {A: ReplicaLoad(1), B: ReplicaLoad(0)}
    chosen = policy.choose(later, [A, B], loads, index, sessions, 1000.0)
    index.withdraw_pending(chosen.replica_id, chosen.request_blocks.hashes())  # as the adapter undoes it
    policy.unrecord_session(chosen, sessions)
    again = policy.choose(later, [A, B], loads, index, sessions, 1000.01)
    assert (chosen.replica_id, again.replica_id) == (B, B) and again.reason != "session-affinity"
