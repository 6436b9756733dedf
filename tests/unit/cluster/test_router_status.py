"""cluster.router_status: `warmpath status` lines from a `/v1/router` response, problems flagged."""

from __future__ import annotations

import pytest

from cluster.router_status import router_status_lines, stream_problem

HEALTHY = {"num_stored_blocks": 900, "num_orphaned_blocks": 0, "num_probes": 2, "num_stalls": 0,
           "num_unreachable": 0, "num_reloads": 0, "num_gaps": 1, "num_replayed_gaps": 1,
           "seconds_since_last_batch": 1.4}


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({}, None),
        ({"num_stored_blocks": 0, "num_orphaned_blocks": 500}, "blind: every stored block arrived without its parent"),
        ({"num_stored_blocks": 0, "num_orphaned_blocks": 3}, None),  # a few: a late join's first blocks
        ({"num_stalls": 1}, "its event stream stalled and was resubscribed"),
        ({"num_unreachable": 2, "num_stalls": 1}, "its replay buffer did not answer a probe"),
        ({"num_reloads": 1}, "the router lost track of its blocks and reloaded them from its replay buffer"),
        ({"num_gaps": 2, "num_replayed_gaps": 2}, None),  # every gap filled from the replay buffer
        ({"num_gaps": 3, "num_replayed_gaps": 1},
         "2 gaps in its event stream that its replay buffer did not fill: the router forgot its blocks there"),
        ({"num_gaps": 1, "num_replayed_gaps": 0, "num_reloads": 1},
         "1 gap in its event stream that its replay buffer did not fill: the router forgot its blocks there"),
    ],
)
def test_stream_problem(changes, problem):
    assert stream_problem({**HEALTHY, **changes}) == problem


def test_lines_name_each_replica_and_flag_the_blind_one():
    state = {
        "routers": [{
            "policy": "warmpath", "replicas": ["a", "b"], "subscribed_replicas": ["a", "b"], "num_active_sessions": 1,
            "index": {"num_blocks_by_replica": {"a": 900}},
            "kv_cache": {"a": {"capacity_blocks": 2048, "usage": 0.4404},
                         "b": {"capacity_blocks": None, "usage": None}},
            "event_streams": {"b": {**HEALTHY, "num_stored_blocks": 0, "num_orphaned_blocks": 812,
                                    "seconds_since_last_batch": None}, "a": HEALTHY, "c": {**HEALTHY, "num_probes": 1}},
            "renders_like_router": {"a": True, "b": None, "c": False},
        }],
        "stats": {"prediction_accuracy": 0.675, "num_predictions": 203},
    }
    assert router_status_lines(state) == [
        "routing: prediction accuracy 0.68 over 203 calls",
        "  warmpath router: 2/2 replicas subscribed, 1 active session",
        "    a: 900 blocks indexed (KV cache: 2048 blocks, 44% in use), last event 1s ago, 2 probes, prompt ids forwarded",
        "    b: 0 blocks indexed, no event yet, 2 probes; PROBLEM: blind: every stored block arrived without its parent",
        "    c: 0 blocks indexed, last event 1s ago, 1 probe, renders prompts itself (ids not forwarded)",
    ]


def test_lines_without_a_prefix_aware_router():
    assert router_status_lines({"routers": [], "stats": {"prediction_accuracy": None, "num_predictions": 0}}) == [
        "routing: no predictions yet",
        "  no prefix-aware router in the ingress (another policy, or no request routed yet)",
    ]
