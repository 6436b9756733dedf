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
