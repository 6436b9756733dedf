"""The three agent workloads, deterministic from a seed.

A workload is a tuple of `Session`s. A session is a sequence of `Step`s; each
step is one model call whose prompt is a prefix of one of the session's message
lists (`Session.contexts`): the list only grows between compressions, and a
compression (coding workload) starts a new list. What the model answers is part
of the workload, not of the run: step k's answer is the assistant message that
step k+1's prompt holds, so every run of a workload sends the same prompts
whatever the model writes (the small model's text is gibberish).

Workloads (`WORKLOADS`):
- "shared-tools": ReAct agents sharing one system prompt and 20-50 tool
  schemas; each step appends a tool call and a tool result; Poisson arrivals.
- "coding": a few long sessions; large tool results (file contents) until the
  context passes the compression threshold, then one summary replaces the old
  rounds (as `serve_apps.orchestrator.compression` does: system prompt and
  tools untouched, the last rounds kept verbatim), costing one summarisation call.
- "fanout": tasks fan out into branches (one session each, same arrival time);
  every branch's prompt is a global prefix, its role's prompt and tools, then a
  shared document; documents and roles have Zipf-skewed popularity.

Sizes: each `*Params` has `cpu()` defaults (2 CPU replicas of the small model
serve a run in minutes) and `gpu()` sizes (the issue's numbers: 20-50 tools, a
few thousand prefix tokens, 3-15 steps of a tool call and its result each, then
the answer: 4-16 model calls; 100-200-token calls, 300-1000-token results). Token counts are nominal: the synthetic renderer produces exactly
them, the tokenizer renders text generated to approximately that size.

Determinism: content is a pure function of `Part.key` and size; sizes, choices
and times come from one `random.Random` per workload consumed in session
order, so the first n sessions are the same whatever the session count.

Rendering (the text of parts, OpenAI chat bodies, token ids: `openai_request`,
`TokenizerRenderer`, `SyntheticRenderer`) lives in `bench.workload_render`.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence, Union

Role = Literal["system", "user", "assistant", "tool"]
TextStyle = Literal["prose", "json", "code"]
StepKind = Literal["tool", "final", "summarize"]
WorkloadName = Literal["shared-tools", "coding", "fanout"]

WORKLOAD_NAMES: tuple[WorkloadName, ...] = ("shared-tools", "coding", "fanout")


@dataclass(frozen=True, slots=True)
class Part:
    """A piece of message content: equal keys mean equal text and equal tokens."""

    key: str
    num_tokens: int
    style: TextStyle = "prose"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool schema (rendered as an OpenAI function tool) of about `num_tokens` tokens in all.

    The description is what is left after the JSON skeleton (name, parameters), whose
    size the model's tokenizer puts at about `SCHEMA_OVERHEAD_TOKENS + PARAM_TOKENS` per parameter.
    """

    name: str
    num_tokens: int
    description: Part
    param_names: tuple[str, ...]


SCHEMA_OVERHEAD_TOKENS = 45
PARAM_TOKENS = 26


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message. An assistant message with `tool_name` is a tool call whose arguments are `parts`."""

    role: Role
    parts: tuple[Part, ...]
    tool_name: str | None = None
    call_id: str | None = None
    name: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(part.num_tokens for part in self.parts)


@dataclass(frozen=True, slots=True)
class Step:
    """One model call of a session.

    Attributes:
        context_index: which of the session's message lists the prompt comes from.
        num_messages: the prompt is the first `num_messages` messages of that list.
        num_output_tokens: what the agent generates (the next tool call, a final
            answer or a summary).
        tool_latency_s: time after this call's response before the next call is
            sent (the tool runs); 0 for the last step.
        kind: "tool" (answers with a tool call), "final" or "summarize".
    """

    context_index: int
    num_messages: int
    num_output_tokens: int
    tool_latency_s: float
    kind: StepKind = "tool"


@dataclass(frozen=True, slots=True)
class Session:
    """One agent session: its tools, message lists and steps (see module docstring)."""

    session_id: str
    arrival_s: float
    tools: tuple[ToolSpec, ...]
    contexts: tuple[tuple[Message, ...], ...]
    steps: tuple[Step, ...]
    group_id: str | None = None

    def prompt(self, step_index: int) -> tuple[Message, ...]:
        """Messages of step `step_index`'s prompt, system message first."""
        step = self.steps[step_index]
        return self.contexts[step.context_index][: step.num_messages]


@dataclass(frozen=True)
class SharedToolsParams:
    """Shared-tools ReAct agents (`cpu()` defaults; `gpu()` for the issue's full sizes).

    The CPU arrival rate keeps 2 CPU replicas of the small model busy but not saturated
    (about 9 sessions active and 2 requests in flight on average; pow2's TTFT p50 is 1.6x its
    idle value): at one session in flight no policy has queueing to remove and the first
    replica to cache the system prompt can serve everything; past saturation every policy
    measures the queue.
    """

    num_sessions: int = 40
    sessions_per_s_per_replica: float = 0.4
    system_tokens: int = 300
    num_tools: int = 24
    tool_schema_tokens: int = 110
    task_tokens: tuple[int, int] = (40, 120)
    num_steps: tuple[int, int] = (2, 6)
    tool_call_tokens: tuple[int, int] = (40, 80)
    tool_result_tokens: tuple[int, int] = (150, 500)
    final_answer_tokens: tuple[int, int] = (40, 120)
    fast_tool_fraction: float = 0.5
    fast_tool_s: tuple[float, float] = (0.1, 1.0)
    slow_tool_s: tuple[float, float] = (2.0, 8.0)

    @classmethod
    def cpu(cls) -> "SharedToolsParams":
        return cls()

    @classmethod
    def gpu(cls) -> "SharedToolsParams":
        return cls(
            num_sessions=10_000, sessions_per_s_per_replica=0.3, system_tokens=500, num_tools=40,
            tool_schema_tokens=120, num_steps=(3, 15), tool_call_tokens=(100, 200),
            tool_result_tokens=(300, 1000), final_answer_tokens=(100, 300),
        )


@dataclass(frozen=True)
class CodingParams:
    """Long-horizon coding agents: few sessions, many turns, compression near the context budget."""

    num_sessions: int = 3
    sessions_per_s_per_replica: float = 0.01
    system_tokens: int = 800
    num_tools: int = 8
    tool_schema_tokens: int = 110
    num_turns: tuple[int, int] = (12, 20)
    steps_per_round: tuple[int, int] = (2, 4)
    instruction_tokens: tuple[int, int] = (30, 100)
    tool_call_tokens: tuple[int, int] = (40, 100)
    tool_result_tokens: tuple[int, int] = (300, 900)
    final_answer_tokens: tuple[int, int] = (60, 150)
    context_budget_tokens: int = 7680
    compress_below_fraction: float = 0.2
    keep_last_rounds: int = 1
    summary_tokens: int = 400
    fast_tool_fraction: float = 0.5
    fast_tool_s: tuple[float, float] = (0.1, 0.8)
    slow_tool_s: tuple[float, float] = (3.0, 10.0)

    @classmethod
    def cpu(cls) -> "CodingParams":
        return cls()

    @classmethod
    def gpu(cls) -> "CodingParams":
        return cls(
            num_sessions=10_000, sessions_per_s_per_replica=0.03, system_tokens=2000, num_tools=12,
            tool_schema_tokens=150, num_turns=(40, 80), steps_per_round=(3, 6), tool_call_tokens=(100, 250),
            tool_result_tokens=(1000, 4000), final_answer_tokens=(200, 600),
            context_budget_tokens=32_768, summary_tokens=1500,
        )


@dataclass(frozen=True)
class FanoutParams:
    """Multi-agent fan-out over shared documents with Zipf-popular roles and documents."""

    num_sessions: int = 12
    sessions_per_s_per_replica: float = 0.1
    global_tokens: int = 400
    num_roles: int = 4
    role_tokens: int = 300
    tools_per_role: int = 4
    tool_schema_tokens: int = 110
    num_documents: int = 4
    document_tokens: tuple[int, int] = (600, 1200)
    zipf_exponent: float = 1.1
    branches_per_task: tuple[int, int] = (2, 3)
    question_tokens: tuple[int, int] = (30, 90)
    num_steps: tuple[int, int] = (1, 3)
    tool_call_tokens: tuple[int, int] = (40, 80)
    tool_result_tokens: tuple[int, int] = (100, 300)
    final_answer_tokens: tuple[int, int] = (40, 120)
    fast_tool_fraction: float = 0.5
    fast_tool_s: tuple[float, float] = (0.1, 1.0)
    slow_tool_s: tuple[float, float] = (2.0, 6.0)

    def __post_init__(self) -> None:
        if self.branches_per_task[1] > self.num_roles:
            raise ValueError(f"branches_per_task={self.branches_per_task} exceeds num_roles={self.num_roles}")

    @classmethod
    def cpu(cls) -> "FanoutParams":
        return cls()

    @classmethod
    def gpu(cls) -> "FanoutParams":
        return cls(
            num_sessions=10_000, sessions_per_s_per_replica=0.5, global_tokens=2000, num_roles=8,
            role_tokens=1000, tools_per_role=8, tool_schema_tokens=120, num_documents=1000,
            document_tokens=(2000, 8000), branches_per_task=(3, 8), question_tokens=(50, 150),
            num_steps=(1, 4), tool_call_tokens=(100, 200), tool_result_tokens=(300, 1000),
            final_answer_tokens=(100, 300),
        )


WorkloadParams = Union[SharedToolsParams, CodingParams, FanoutParams]


@dataclass(frozen=True)
class Workload:
    """Sessions of one workload, sorted by arrival time."""

    name: WorkloadName
    seed: int
    params: WorkloadParams
    arrival_rate_per_s: float
    sessions: tuple[Session, ...] = field(repr=False)

    @property
    def num_requests(self) -> int:
        return sum(len(s.steps) for s in self.sessions)

    def with_arrival_rate(self, arrival_rate_per_s: float) -> "Workload":
        """The same sessions with arrival times rescaled to `arrival_rate_per_s` sessions per second."""
        if arrival_rate_per_s <= 0:
            raise ValueError(f"arrival_rate_per_s must be > 0, got {arrival_rate_per_s}")
        factor = self.arrival_rate_per_s / arrival_rate_per_s
        sessions = tuple(dataclasses.replace(s, arrival_s=s.arrival_s * factor) for s in self.sessions)
        return dataclasses.replace(self, arrival_rate_per_s=arrival_rate_per_s, sessions=sessions)


# --- generators ---------------------------------------------------------------------------------

_VERBS = ("get", "list", "search", "create", "update", "delete", "check", "fetch", "run", "read", "write", "compute")
_NOUNS = ("order", "invoice", "customer", "ticket", "shipment", "refund", "account", "report", "file", "build",
          "metric", "alert", "user", "policy", "document", "record")


def _uniform_int(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def _tool_latency_s(rng: random.Random, fast_fraction: float, fast_s: tuple[float, float],
                    slow_s: tuple[float, float]) -> float:
    low, high = fast_s if rng.random() < fast_fraction else slow_s
    return rng.uniform(low, high)


def _tools(prefix: str, num_tools: int, schema_tokens: int, rng: random.Random) -> tuple[ToolSpec, ...]:
    tools = []
    for i in range(num_tools):
        name = f"{_VERBS[i % len(_VERBS)]}_{_NOUNS[(i // len(_VERBS) + i) % len(_NOUNS)]}_{i}"
        params = tuple(f"{_NOUNS[(i + j) % len(_NOUNS)]}_{j}" for j in range(rng.randint(1, 3)))
        description_tokens = max(8, schema_tokens - SCHEMA_OVERHEAD_TOKENS - PARAM_TOKENS * len(params))
        tools.append(ToolSpec(name, schema_tokens, Part(f"{prefix}/tool/{i}", description_tokens), params))
    return tuple(tools)


def _zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / (rank ** exponent) for rank in range(1, n + 1)]


def _sample_without_replacement(rng: random.Random, weights: Sequence[float], k: int) -> list[int]:
    """k distinct indices, each drawn with probability proportional to its weight among those left."""
    left = list(range(len(weights)))
    chosen = []
    for _ in range(k):
        index = rng.choices(range(len(left)), weights=[weights[i] for i in left])[0]
        chosen.append(left.pop(index))
    return chosen


def _react_steps(
    rng: random.Random, session_id: str, tools: Sequence[ToolSpec], messages: list[Message], num_steps: int,
    p: SharedToolsParams | FanoutParams,
) -> list[Step]:
    """Appends `num_steps` (tool call, tool result) pairs to `messages`; returns num_steps + 1 calls."""
    steps = []
    for k in range(num_steps):
        tool = tools[rng.randrange(len(tools))]
        call_tokens = _uniform_int(rng, p.tool_call_tokens)
        latency_s = _tool_latency_s(rng, p.fast_tool_fraction, p.fast_tool_s, p.slow_tool_s)
        steps.append(Step(0, len(messages), call_tokens, latency_s))
        call_id = f"call_{k}"
        messages.append(Message("assistant", (Part(f"{session_id}/call/{k}", call_tokens),),
                                tool_name=tool.name, call_id=call_id))
        messages.append(Message("tool", (Part(f"{session_id}/result/{k}", _uniform_int(rng, p.tool_result_tokens),
                                              "json"),), call_id=call_id))
    steps.append(Step(0, len(messages), _uniform_int(rng, p.final_answer_tokens), 0.0, "final"))
    return steps


def shared_tools(seed: int, params: SharedToolsParams, arrival_rate_per_s: float) -> Workload:
    """Shared-tools ReAct agents: one system prompt and tool set for all sessions."""
    rng = random.Random(f"shared-tools/{seed}")
    prefix = f"st{seed}"
    system = Message("system", (Part(f"{prefix}/system", params.system_tokens),))
    tools = _tools(prefix, params.num_tools, params.tool_schema_tokens, rng)
    sessions = []
    now_s = 0.0
    for i in range(params.num_sessions):
        now_s += rng.expovariate(arrival_rate_per_s)
        session_id = f"{prefix}-s{i:05d}"
        messages = [system, Message("user", (Part(f"{session_id}/task", _uniform_int(rng, params.task_tokens)),))]
        steps = _react_steps(rng, session_id, tools, messages, _uniform_int(rng, params.num_steps), params)
        sessions.append(Session(session_id, now_s, tools, (tuple(messages),), tuple(steps)))
    return Workload("shared-tools", seed, params, arrival_rate_per_s, tuple(sessions))


def context_tokens(messages: Sequence[Message], tools: Sequence[ToolSpec]) -> int:
    """Nominal tokens of a prompt (messages plus tool schemas), before any rendering."""
    return sum(m.num_tokens for m in messages) + sum(t.num_tokens for t in tools)


def coding(seed: int, params: CodingParams, arrival_rate_per_s: float) -> Workload:
    """Long coding sessions whose context is compressed near the budget (see module docstring)."""
    rng = random.Random(f"coding/{seed}")
    prefix = f"cd{seed}"
    system = Message("system", (Part(f"{prefix}/system", params.system_tokens),))
    tools = _tools(prefix, params.num_tools, params.tool_schema_tokens, rng)
    compress_at_tokens = int(params.context_budget_tokens * (1.0 - params.compress_below_fraction))
    sessions = []
    now_s = 0.0
    for i in range(params.num_sessions):
        now_s += rng.expovariate(arrival_rate_per_s)
        session_id = f"{prefix}-s{i:05d}"
        contexts: list[tuple[Message, ...]] = []
        messages = [system]
        round_starts: list[int] = []  # index in `messages` of each round's user message
        steps: list[Step] = []
        num_turns = _uniform_int(rng, params.num_turns)
        steps_left_in_round = 0
        num_rounds = num_summaries = 0
        for turn in range(num_turns):
            if steps_left_in_round == 0:
                round_starts.append(len(messages))
                messages.append(Message("user", (Part(f"{session_id}/instruction/{num_rounds}",
                                                      _uniform_int(rng, params.instruction_tokens)),)))
                num_rounds += 1
                steps_left_in_round = _uniform_int(rng, params.steps_per_round)
            steps_left_in_round -= 1
            result_tokens = _uniform_int(rng, params.tool_result_tokens)
            call_tokens = _uniform_int(rng, params.tool_call_tokens)
            if (len(round_starts) > params.keep_last_rounds
                    and context_tokens(messages, tools) + call_tokens + result_tokens > compress_at_tokens):
                # The orchestrator's compression: one summarisation call over the whole
                # history, then a new context: system, summary, the last rounds verbatim.
                summarize = Message("user", (Part(f"{session_id}/summarize/{num_summaries}", 60),))
                contexts.append(tuple(messages) + (summarize,))
                steps.append(Step(len(contexts) - 1, len(messages) + 1, params.summary_tokens, 0.0, "summarize"))
                keep_from = round_starts[-params.keep_last_rounds]
                summary = Message("user", (Part(f"{session_id}/summary/{num_summaries}", params.summary_tokens),),
                                  name="warmpath-context-summary")
                kept = messages[keep_from:]
                messages = [system, summary] + kept
                round_starts = [2 + (start - keep_from) for start in round_starts[-params.keep_last_rounds:]]
                num_summaries += 1
            latency_s = _tool_latency_s(rng, params.fast_tool_fraction, params.fast_tool_s, params.slow_tool_s)
            tool = tools[rng.randrange(len(tools))]
            steps.append(Step(len(contexts), len(messages), call_tokens, latency_s))
            call_id = f"call_{turn}"
            messages.append(Message("assistant", (Part(f"{session_id}/call/{turn}", call_tokens),),
                                    tool_name=tool.name, call_id=call_id))
            messages.append(Message("tool", (Part(f"{session_id}/result/{turn}", result_tokens, "code"),),
                                    call_id=call_id))
        steps.append(Step(len(contexts), len(messages), _uniform_int(rng, params.final_answer_tokens), 0.0, "final"))
        contexts.append(tuple(messages))
        sessions.append(Session(session_id, now_s, tools, tuple(contexts), tuple(steps)))
    return Workload("coding", seed, params, arrival_rate_per_s, tuple(sessions))


def fanout(seed: int, params: FanoutParams, arrival_rate_per_s: float) -> Workload:
    """Tasks fanning out into role branches over Zipf-popular documents (see module docstring)."""
    rng = random.Random(f"fanout/{seed}")
    prefix = f"fo{seed}"
    global_part = Part(f"{prefix}/global", params.global_tokens)
    roles = [
        (Part(f"{prefix}/role/{r}", params.role_tokens),
         _tools(f"{prefix}/role{r}", params.tools_per_role, params.tool_schema_tokens, rng))
        for r in range(params.num_roles)
    ]
    documents = [Part(f"{prefix}/doc/{d}", _uniform_int(rng, params.document_tokens)) for d in range(params.num_documents)]
    role_weights = _zipf_weights(params.num_roles, params.zipf_exponent)
    document_cum_weights = list(itertools.accumulate(_zipf_weights(params.num_documents, params.zipf_exponent)))
    mean_branches = sum(params.branches_per_task) / 2
    task_rate_per_s = arrival_rate_per_s / mean_branches  # sessions (branches) arrive at the given rate
    sessions: list[Session] = []
    now_s = 0.0
    task = 0
    while len(sessions) < params.num_sessions:
        now_s += rng.expovariate(task_rate_per_s)
        document = documents[rng.choices(range(params.num_documents), cum_weights=document_cum_weights)[0]]
        num_branches = _uniform_int(rng, params.branches_per_task)
        task_id = f"{prefix}-t{task:05d}"
        for branch, role in enumerate(_sample_without_replacement(rng, role_weights, num_branches)):
            if len(sessions) == params.num_sessions:
                break
            role_part, tools = roles[role]
            session_id = f"{task_id}-b{branch}"
            messages = [
                Message("system", (global_part, role_part)),
                Message("user", (document, Part(f"{session_id}/question", _uniform_int(rng, params.question_tokens)))),
            ]
            steps = _react_steps(rng, session_id, tools, messages, _uniform_int(rng, params.num_steps), params)
            sessions.append(Session(session_id, now_s, tools, (tuple(messages),), tuple(steps), group_id=task_id))
        task += 1
    return Workload("fanout", seed, params, arrival_rate_per_s, tuple(sessions))


_GENERATORS: dict[WorkloadName, tuple[type, Callable[..., Workload]]] = {
    "shared-tools": (SharedToolsParams, shared_tools),
    "coding": (CodingParams, coding),
    "fanout": (FanoutParams, fanout),
}


def default_params(name: WorkloadName, scale: Literal["cpu", "gpu"] = "cpu") -> WorkloadParams:
    """The `cpu()` or `gpu()` parameters of workload `name`."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    params_cls = _GENERATORS[name][0]
    return params_cls.gpu() if scale == "gpu" else params_cls.cpu()


def generate(
    name: WorkloadName,
    seed: int,
    num_replicas: int,
    params: WorkloadParams | None = None,
    num_sessions: int | None = None,
) -> Workload:
    """Generates workload `name`.

    Args:
        name: one of `WORKLOAD_NAMES`.
        seed: everything (content, sizes, times) follows from it.
        num_replicas: arrivals are `params.sessions_per_s_per_replica * num_replicas` per second.
        params: sizes; default `default_params(name, "cpu")`.
        num_sessions: overrides `params.num_sessions`.

    Returns:
        The workload, sessions in arrival order.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    params = params if params is not None else default_params(name)
    if not isinstance(params, _GENERATORS[name][0]):
        raise ValueError(f"workload {name!r} takes {_GENERATORS[name][0].__name__}, got {type(params).__name__}")
    if num_sessions is not None:
        if num_sessions < 1:
            raise ValueError(f"num_sessions must be >= 1, got {num_sessions}")
        params = dataclasses.replace(params, num_sessions=num_sessions)
    return _GENERATORS[name][1](seed, params, params.sessions_per_s_per_replica * num_replicas)


__all__ = [
    "CodingParams", "FanoutParams", "Message", "Part", "Session", "SharedToolsParams", "Step", "ToolSpec",
    "WORKLOAD_NAMES", "Workload", "WorkloadName", "context_tokens", "default_params", "generate",
]
