"""`warmpath status`'s view of the routers: `GET /v1/router` as a few readable lines.

Why a module of its own: the lines flag the states an operator must act on (a
replica the router cannot see, an event stream that stalled or does not
answer), and that judgement is worth a unit test apart from the HTTP call.
"""

from __future__ import annotations

from typing import Any, Mapping

# A replica with more orphaned blocks than this and none stored: the router cannot see its cache.
BLIND_MIN_ORPHANED_BLOCKS = 16


def stream_problem(stream: Mapping[str, Any]) -> str | None:
    """What is wrong with one replica's event stream, or None."""
    if stream.get("num_unreachable"):
        return "its replay buffer did not answer a probe"
    if stream.get("num_orphaned_blocks", 0) > BLIND_MIN_ORPHANED_BLOCKS and not stream.get("num_stored_blocks"):
        return "blind: every stored block arrived without its parent"
    if stream.get("num_stalls"):
        return "its event stream stalled and was resubscribed"
    if (num_lost := stream.get("num_gaps", 0) - stream.get("num_replayed_gaps", 0)) > 0:
        return (f"{num_lost} gap{'s' if num_lost > 1 else ''} in its event stream that its replay buffer did not "
                "fill: the router forgot its blocks there")
    if stream.get("num_reloads"):
        return "the router lost track of its blocks and reloaded them from its replay buffer"
    return None


def router_status_lines(state: Mapping[str, Any]) -> list[str]:
    """Lines for `warmpath status` from a `/v1/router` response (the ingress's routers and its routing stats)."""
    stats = state.get("stats") or {}
    accuracy = stats.get("prediction_accuracy")
    lines = [
        "routing: " + (
            f"prediction accuracy {accuracy:.2f} over {stats.get('num_predictions', 0)} calls"
            if accuracy is not None else "no predictions yet"
        )
    ]
    routers = state.get("routers") or []
    if not routers:
        lines.append("  no prefix-aware router in the ingress (another policy, or no request routed yet)")
    for router in routers:
        replicas = router.get("replicas") or []
        subscribed = router.get("subscribed_replicas") or []
        active = router.get("num_active_sessions")
        lines.append(f"  {router.get('policy')} router: {len(subscribed)}/{len(replicas)} replicas subscribed"
                     + ("" if active is None else _count(active, "active session")))
        blocks = (router.get("index") or {}).get("num_blocks_by_replica") or {}
        kv_cache = router.get("kv_cache") or {}
        rendering = router.get("renders_like_router") or {}
        for replica_id, stream in sorted((router.get("event_streams") or {}).items()):
            since = stream.get("seconds_since_last_batch")
            problem = stream_problem(stream)
            lines.append(
                f"    {replica_id}: {blocks.get(replica_id, 0)} blocks indexed"
                + _kv_cache_size(kv_cache.get(replica_id))
                + (", no event yet" if since is None else f", last event {since:.0f}s ago")
                + _count(stream.get("num_probes", 0), "probe")
                + _rendering(rendering.get(replica_id))
                + (f"; PROBLEM: {problem}" if problem else "")
            )
    return lines


def _rendering(renders_like_router: bool | None) -> str:
    """How the replica gets chat prompts: the router's token ids, or its own rendering (the router cannot
    reproduce it, or the replica has not said yet); "" where the router did not report it."""
    if renders_like_router is None:
        return ""
    return ", prompt ids forwarded" if renders_like_router else ", renders prompts itself (ids not forwarded)"


def _kv_cache_size(kv_cache: Mapping[str, Any] | None) -> str:
    """" (KV cache: N blocks, U% in use)" as the replica reported them; "" where it reported no size.

    In use means held by running requests: the index also counts cached blocks the
    engine keeps free for reuse, so it can hold more than the usage says.
    """
    capacity = (kv_cache or {}).get("capacity_blocks")
    if not capacity:
        return ""
    usage = kv_cache.get("usage")
    return f" (KV cache: {capacity} blocks" + (f", {usage:.0%} in use)" if isinstance(usage, (int, float)) else ")")


def _count(number: int, noun: str) -> str:
    """`, 1 probe` / `, 2 probes`."""
    return f", {number} {noun}{'' if number == 1 else 's'}"
