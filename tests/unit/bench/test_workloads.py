"""bench.workloads: determinism, shapes of the three workloads, and both renderers."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from bench.workload_render import SyntheticRenderer, nominal_prompt_tokens, openai_request
from bench.workloads import WORKLOAD_NAMES, default_params, generate
from cluster.model_builder import build_model


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_same_seed_same_workload_other_seed_other_workload(name):
    first, again, other = generate(name, 7, 2), generate(name, 7, 2), generate(name, 8, 2)
    assert first == again
    assert first.sessions != other.sessions
    renderer = SyntheticRenderer()
    assert renderer.token_ids(first.sessions[0], 1) == SyntheticRenderer().token_ids(again.sessions[0], 1)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_first_sessions_do_not_depend_on_the_session_count(name):
    small, large = generate(name, 3, 2, num_sessions=4), generate(name, 3, 2, num_sessions=9)
    assert large.sessions[:4] == small.sessions[:4]


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_arrival_rate_scales_with_replicas_and_rescaling_keeps_sessions(name):
    two, eight = generate(name, 1, 2), generate(name, 1, 8)
    assert eight.arrival_rate_per_s == pytest.approx(4 * two.arrival_rate_per_s)
    assert [s.arrival_s for s in eight.sessions] == pytest.approx([s.arrival_s / 4 for s in two.sessions])
    rescaled = two.with_arrival_rate(eight.arrival_rate_per_s)
    assert [s.arrival_s for s in rescaled.sessions] == pytest.approx([s.arrival_s for s in eight.sessions])
    assert [s.steps for s in rescaled.sessions] == [s.steps for s in two.sessions]


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_sessions_arrive_in_order_and_steps_are_well_formed(name, scale):
    workload = generate(name, 0, 4, params=default_params(name, scale), num_sessions=40)
    arrivals = [s.arrival_s for s in workload.sessions]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    for session in workload.sessions:
        assert session.steps[-1].kind == "final" and session.steps[-1].tool_latency_s == 0.0
        for k, step in enumerate(session.steps):
            prompt = session.prompt(k)
            assert prompt[0].role == "system" and prompt[-1].role in ("user", "tool")
            assert step.num_output_tokens > 0 and step.tool_latency_s >= 0
            messages, tools = openai_request(session, k)
            assert len(messages) == len(prompt) and len(tools) == len(session.tools)


def test_shared_tools_sizes_follow_the_gpu_parameters():
    params = default_params("shared-tools", "gpu")
    workload = generate("shared-tools", 0, 16, params=params, num_sessions=200)
    systems = {s.contexts[0][0] for s in workload.sessions}
    tool_sets = {s.tools for s in workload.sessions}
    assert len(systems) == 1 and len(tool_sets) == 1
    assert 20 <= params.num_tools <= 50
    assert 2000 <= sum(t.num_tokens for t in workload.sessions[0].tools) + params.system_tokens <= 8000
    num_tool_steps = Counter(len(s.steps) - 1 for s in workload.sessions)
    assert min(num_tool_steps) >= 3 and max(num_tool_steps) <= 15
    latencies = []
    for session in workload.sessions:
        history = session.contexts[0][2:]
        calls, results = history[0::2], history[1::2]
        assert all(m.role == "assistant" and m.tool_name for m in calls)
        assert all(100 <= m.num_tokens <= 200 for m in calls)
        assert all(m.role == "tool" and 300 <= m.num_tokens <= 1000 for m in results)
        latencies += [s.tool_latency_s for s in session.steps[:-1]]
    fast = sum(latency < 1.0 for latency in latencies) / len(latencies)
    assert 0.35 <= fast <= 0.65  # half the tools answer within a second
    assert max(latencies) > 3.0


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_coding_sessions_compress_and_stay_within_the_context_budget(scale):
    params = default_params("coding", scale)
    workload = generate("coding", 0, 2, params=params, num_sessions=6)
    num_summaries = 0
    for session in workload.sessions:
        summaries = [s for s in session.steps if s.kind == "summarize"]
        num_summaries += len(summaries)
        assert len(session.contexts) == len(summaries) + 1
        for k, step in enumerate(session.steps):
            assert nominal_prompt_tokens(session, k) + step.num_output_tokens <= params.context_budget_tokens
        for context in session.contexts[1:]:
            assert context[1].name == "warmpath-context-summary"  # system, summary, kept rounds
            assert context[0] == session.contexts[0][0]  # the system prompt is never touched
    assert num_summaries > 0


def test_fanout_branches_share_prefixes_and_popularity_is_skewed():
    params = dataclasses.replace(default_params("fanout", "cpu"), num_documents=6, num_sessions=300)
    workload = generate("fanout", 0, 2, params=params)
    by_task: dict[str, list] = {}
    for session in workload.sessions:
        by_task.setdefault(session.group_id, []).append(session)
    global_parts = {s.contexts[0][0].parts[0] for s in workload.sessions}
    assert len(global_parts) == 1
    for branches in by_task.values():
        assert len({b.arrival_s for b in branches}) == 1
        assert len({b.contexts[0][1].parts[0] for b in branches}) == 1  # one document per task
        roles = [b.contexts[0][0].parts[1] for b in branches]
        assert len(set(roles)) == len(roles)
    documents = Counter(s.contexts[0][1].parts[0].key for s in workload.sessions)
    roles = Counter(s.contexts[0][0].parts[1].key for s in workload.sessions)
    assert documents.most_common()[0][1] > 2 * documents.most_common()[-1][1]
    assert roles.most_common()[0][1] > roles.most_common()[-1][1]


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_synthetic_prompts_extend_the_previous_step_and_share_the_system_prefix(name):
    workload = generate(name, 0, 2, num_sessions=6)
    renderer = SyntheticRenderer()
    prompts = {}
    for session in workload.sessions:
        previous = None
        for k, step in enumerate(session.steps):
            ids = renderer.token_ids(session, k)
            assert len(ids) >= nominal_prompt_tokens(session, k)
            if previous is not None and step.context_index == session.steps[k - 1].context_index:
                assert ids[: len(previous)] == previous
            previous = ids
        prompts[session.session_id] = renderer.token_ids(session, 0)
    first, second = list(prompts.values())[:2]
    system_tokens = workload.sessions[0].contexts[0][0].parts[0].num_tokens  # the global part (fanout)
    assert first[:system_tokens] == second[:system_tokens]


@pytest.fixture(scope="session")
def tokenizer_renderer(tmp_path_factory):
    """The served model's tokenizer and template, built here as `warmpath build-model` builds them (seconds)."""
    from bench.workload_render import TokenizerRenderer

    model_dir = tmp_path_factory.mktemp("model") / "warmpath-tiny"
    build_model(model_dir)
    return TokenizerRenderer(str(model_dir))


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_tokenizer_prompts_extend_each_step_and_match_the_nominal_sizes(tokenizer_renderer, name):
    workload = generate(name, 0, 2, num_sessions=3)
    session = max(workload.sessions, key=lambda s: len(s.steps))
    previous = None
    for k in range(len(session.steps)):
        ids = tokenizer_renderer.token_ids(session, k)
        assert 0.75 <= len(ids) / nominal_prompt_tokens(session, k) <= 1.35
        if previous is not None and session.steps[k].context_index == session.steps[k - 1].context_index:
            assert ids[: len(previous)] == previous
        previous = ids
