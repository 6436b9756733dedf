"""router.stream_watch: when a quiet subscription is due for a probe, and what a probe's outcome resets."""

from __future__ import annotations

import pytest

from router.stream_watch import BLIND_ORPHANED_BLOCKS, BLIND_WINDOW_BLOCKS, CLOCK_OFFSET_RISE_S, EventStreamWatch
from router.types import ReplicaId

A, B = ReplicaId("a"), ReplicaId("b")


@pytest.fixture
def watch() -> EventStreamWatch:
    w = EventStreamWatch(probe_grace_s=2.0, min_probe_interval_s=10.0)
    w.subscribed(A)
    w.subscribed(B)
    return w


def test_a_replica_is_due_only_after_a_completion_outlives_the_grace(watch):
    assert watch.due_for_probe(100.0) == []
    watch.request_completed(A, 100.0)
    watch.request_completed(A, 101.5)
    assert watch.due_for_probe(101.9) == []
    assert watch.due_for_probe(102.0) == [A]  # timed from the first completion since the last batch


def test_a_batch_clears_the_completions(watch):
    watch.request_completed(A, 100.0)
    watch.batch_received(A, 100.5)
    assert watch.due_for_probe(200.0) == []
    assert watch.health(101.0)[A].seconds_since_last_batch == pytest.approx(0.5)
    assert watch.health(101.0)[B].seconds_since_last_batch is None


@pytest.mark.parametrize(
    ("outcome", "due_at_interval", "stalls", "unreachable"),
    [("quiet", [], 0, 0), ("stalled", [], 1, 0), ("unreachable", [A], 0, 1)],
)
def test_probe_outcomes(watch, outcome, due_at_interval, stalls, unreachable):
    watch.request_completed(A, 100.0)
    watch.probed(A, outcome, 3 if outcome == "stalled" else 0, 102.0)
    assert watch.due_for_probe(105.0) == []  # never twice within the interval
    assert watch.due_for_probe(112.0) == due_at_interval
    health = watch.health(112.0)[A]
    assert (health.num_probes, health.num_stalls, health.num_unreachable) == (1, stalls, unreachable)
    assert health.num_recovered_batches == (3 if outcome == "stalled" else 0)


def test_after_a_quiet_probe_new_completions_wait_for_the_interval(watch):
    watch.request_completed(A, 100.0)
    watch.probed(A, "quiet", 0, 102.0)
    watch.request_completed(A, 103.0)
    assert watch.due_for_probe(106.0) == []
    assert watch.due_for_probe(112.0) == [A]


def test_unwatched_and_forgotten_replicas_are_ignored(watch):
    c = ReplicaId("c")
    watch.request_completed(c, 100.0)
    watch.batch_received(c, 100.0)
    watch.probed(c, "stalled", 1, 100.0)
    watch.forget(A)
    watch.request_completed(A, 100.0)
    assert watch.due_for_probe(200.0) == []
    assert set(watch.health(200.0)) == {B}


def test_a_stream_is_blind_when_orphans_pile_up_with_nothing_stored(watch, monkeypatch):
    monkeypatch.setattr("router.stream_watch.BLIND_ORPHANED_BLOCKS", 10)
    assert not watch.looks_blind(A, 0, 9, 100.0)
    assert watch.looks_blind(A, 0, 10, 100.0)  # a reload
    assert not watch.looks_blind(A, 0, 40, 130.0)  # then a minute's wait
    assert watch.looks_blind(A, 0, 40, 160.0)
    assert not watch.looks_blind(A, 0, 80, 270.0)  # then two minutes'
    assert watch.looks_blind(A, 0, 80, 280.0)
    assert watch.health(280.0)[A].num_reloads == 3


def test_stored_blocks_outnumbering_orphans_keep_a_stream_from_looking_blind(watch, monkeypatch):
    monkeypatch.setattr("router.stream_watch.BLIND_ORPHANED_BLOCKS", 10)
    assert not watch.looks_blind(A, 50, 9, 100.0)  # too few orphans
    assert not watch.looks_blind(A, 100, 20, 100.0)  # enough, but a sixth of what arrived
    assert watch.looks_blind(A, 100, 34, 100.0)  # a quarter
    assert not watch.looks_blind(ReplicaId("unwatched"), 0, 1000, 100.0)


def test_orphans_among_blocks_of_unrelated_prompts_call_a_stream_blind(watch):
    """The lost prefix's extensions arrive as orphans while other prompts' own roots keep being stored."""
    stored = orphaned = 0
    for _ in range(70):
        orphaned += 1
        stored += 0 if orphaned % 10 else 1
        if watch.looks_blind(A, stored, orphaned, 100.0):
            break
    assert watch.health(100.0)[A].num_reloads == 1 and orphaned == BLIND_ORPHANED_BLOCKS


def test_a_long_healthy_past_does_not_outweigh_orphans_arriving_now(watch, monkeypatch):
    monkeypatch.setattr("router.stream_watch.BLIND_ORPHANED_BLOCKS", 10)
    assert not watch.looks_blind(A, BLIND_WINDOW_BLOCKS, 0, 100.0)  # a full window: the next one starts here
    assert watch.looks_blind(A, BLIND_WINDOW_BLOCKS + 20, 10, 100.0)


def test_the_publishers_clock_offset_is_the_fastest_delivery_and_follows_a_clock_stepped_back(watch):
    assert watch.on_publisher_clock(A, 1000.0) == 1000.0  # before a live batch: taken as is
    watch.publisher_clock_read(A, newest_published_at=995.0, received_at=1000.0)  # 5 s behind
    watch.publisher_clock_read(A, newest_published_at=990.0, received_at=1000.0)  # delivered late: no change
    assert watch.on_publisher_clock(A, 1000.0) == pytest.approx(995.0 - CLOCK_OFFSET_RISE_S)
    watch.publisher_clock_read(A, newest_published_at=998.0, received_at=1000.0)  # its clock corrected
    assert watch.on_publisher_clock(A, 1000.0) == 998.0
    assert watch.health(0.0)[A].publisher_clock_offset_s == 2.0
    assert watch.on_publisher_clock("unwatched", 7.0) == 7.0


def test_a_publisher_clock_stepped_back_far_or_one_bogus_stamp_is_followed_at_once(watch):
    """Rising 0.01 s a delivery, a clock an hour ahead then corrected (or one batch stamped far in the future)
    kept every probe's recovered batch looking an hour old, a stall, for 360,000 deliveries."""
    watch.publisher_clock_read(A, newest_published_at=4600.0, received_at=1000.0)  # an hour ahead
    watch.publisher_clock_read(A, newest_published_at=1000.0, received_at=1000.1)  # corrected
    assert watch.on_publisher_clock(A, 2000.0) == pytest.approx(1999.9)
    watch.publisher_clock_read(A, newest_published_at=1e300, received_at=1000.0)
    watch.publisher_clock_read(A, newest_published_at=float("nan"), received_at=1000.0)  # ignored
    watch.publisher_clock_read(A, newest_published_at=999.9, received_at=1000.0)
    assert watch.on_publisher_clock(A, 2000.0) == pytest.approx(1999.9)
