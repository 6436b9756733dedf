"""Operator metrics, exported through Ray's Prometheus endpoint (prefix `ray_warmpath_`).

Why Ray's metrics: every deployment runs in a Ray worker, and Ray already
aggregates worker metrics per node on its metrics export port, which KubeRay
and Prometheus scrape; no second exporter to run or secure.

Each process creates the instruments on first use (`WarmpathMetrics.get()`),
so importing this module costs nothing and workers that never record create
nothing. Tags are bounded sets: replica ids, decision reasons, outcomes. Never
a name a client chooses (a tool name, a session id): any key that may create
sessions could then mint series without end; tool names are on the spans.

`warmpath_routing_decisions` counts the decisions of model calls that returned
(with their usage), so it agrees with `warmpath_route_predictions`; `/v1/router`
also counts decisions of calls the engine refused. Every path to the engine
records its calls through `record_model_call`: the OpenAI routes, the gRPC
Inference service and the orchestrator's turns.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Optional

from router import decision_log

TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
TURN_BOUNDARIES_S = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


class WarmpathMetrics:
    """The process's instruments; `get()` creates them once."""

    _instance: Optional["WarmpathMetrics"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Histogram

        self.routing_decisions = Counter(
            "warmpath_routing_decisions", "Routing decisions of model calls that returned, by reason.", tag_keys=("reason",)
        )
        self.predictions = Counter(
            "warmpath_route_predictions", "Predicted vs actual cached tokens: within one block or not.",
            tag_keys=("is_within_block",),
        )
        self.prompt_tokens = Counter("warmpath_prompt_tokens", "Prompt tokens per replica.", tag_keys=("replica",))
        self.cached_tokens = Counter(
            "warmpath_cached_tokens", "Prompt tokens served from the prefix cache, per replica.", tag_keys=("replica",)
        )
        self.prompts_rendered = Counter(
            "warmpath_prompts_rendered", "Chat prompts per replica by who rendered them: the router (forwarded ids) "
            "or the engine.", tag_keys=("replica", "renderer"),
        )
        self.ttft = Histogram(
            "warmpath_ttft_seconds", "Time to first token at the replica.", boundaries=TTFT_BOUNDARIES_S,
            tag_keys=("replica",),
        )
        self.turn_latency = Histogram(
            "warmpath_turn_seconds", "Agent turn latency by outcome.", boundaries=TURN_BOUNDARIES_S,
            tag_keys=("outcome",),
        )
        self.tool_calls = Counter("warmpath_tool_calls", "Server-side tool calls by status.", tag_keys=("status",))
        self.compressions = Counter("warmpath_compressions", "Context compressions.")
        self.model_retries = Counter("warmpath_model_retries", "Model calls retried after their replica failed.")
        self.access_denials = Counter(
            "warmpath_access_denials", "Calls refused before any deployment, by reason.", tag_keys=("code",)
        )

    @classmethod
    def get(cls) -> "WarmpathMetrics":
        if cls._instance is None:
            with cls._lock:
                if cls._instance is None:
                    cls._instance = cls()
        return cls._instance

    def record_usage(self, replica_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        if not replica_id:
            return
        tags = {"replica": replica_id}
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens, tags=tags)
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens, tags=tags)

    def record_decision(self, reason: str, predicted_tokens: Optional[int], actual_tokens: Optional[int], block_size_tokens: int) -> None:
        self.routing_decisions.inc(tags={"reason": reason})
        if predicted_tokens is not None and actual_tokens is not None:
            is_within = abs(predicted_tokens - actual_tokens) <= block_size_tokens
            self.predictions.inc(tags={"is_within_block": str(is_within).lower()})


def record_model_call(logged: Optional[decision_log.LoggedDecision], replica_id: str, prompt_tokens: int, cached_tokens: Optional[int]) -> None:
    """Decision, prediction accuracy and per-replica cache counters of one model call."""
    metrics = WarmpathMetrics.get()
    metrics.record_usage(replica_id, prompt_tokens, cached_tokens or 0)
    if logged is None:
        return
    decision = logged.decision
    predicted = decision.predicted_cached_tokens.get(replica_id or decision.replica_id, 0)
    block_size = decision.request_blocks.block_size_tokens if decision.request_blocks is not None else 0
    if cached_tokens is not None and block_size:
        decision_log.STATS.count_prediction(predicted, cached_tokens, block_size)
    metrics.record_decision(decision_log.served_reason(decision, replica_id), predicted, cached_tokens, block_size)


def record_model_usage(
    logged: Optional[decision_log.LoggedDecision], replica_id: str, usage: Optional[Mapping[str, Any]]
) -> None:
    """`record_model_call` from a response's OpenAI `usage` as JSON (None when the response had none)."""
    record_model_call(logged, replica_id, *usage_tokens(usage))


def usage_tokens(usage: Optional[Mapping[str, Any]]) -> tuple[int, Optional[int]]:
    """(prompt tokens, cached tokens or None) of a response's OpenAI `usage` as JSON (None: the response had none)."""
    usage = usage or {}
    return usage.get("prompt_tokens") or 0, (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def settle_model_call(
    replica_id: str, is_answered: bool, prompt_tokens: int = 0, cached_tokens: Optional[int] = None
) -> Optional[decision_log.LoggedDecision]:
    """Takes the current request's routing decision out of the log (`decision_log.pop_current`) and returns it.

    A call the engine answered, even one cut short, is recorded (its `warmpath.route` span,
    `record_model_call`); one refused or failed before any output has its placement withdrawn, on the
    replica Serve sent it to (the chosen one, or another when that was full): it cached nothing the router
    should count on.
    """
    logged = decision_log.pop_current()
    if is_answered:
        decision_log.record_route_span(logged, replica_id or None)
        record_model_call(logged, replica_id, prompt_tokens, cached_tokens)
    else:
        decision_log.withdraw_placement(logged, replica_id or None)
    return logged
