"""`warmpath bench` without a cluster: bad flags exit 2 before any work; a policy that fails or a Ctrl-C
keeps the policies that finished (in the table and the JSON), with exit 1 or 130, and the JSON holds each
finished policy as the run goes; GPU sizes, and a workload too long for the model's window."""

from __future__ import annotations

import dataclasses
import json
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from bench import live, report
from bench.trace import RequestRecord
from cluster import local
from cluster.cli import app

BENCH = ["bench", "--workload", "fanout", "--policies", "pow2,warmpath,round-robin"]


def _never(*args, **kwargs):
    raise AssertionError("the command did work before checking its flags")


def _summary(hit_rate: float) -> dict:
    return {"num_requests": 4, "num_errors": 0, "hit_rate": hit_rate, "ttft_p50_s": 0.5, "ttft_p99_s": 1.0,
            "latency_p50_s": 1.0, "latency_p99_s": 2.0, "turns_per_s": 2.0, "prefill_tokens": 100,
            "load_imbalance": 1.1, "prediction_accuracy": None}


def _fake_run(hit_rate: float = 0.8) -> dict:
    records = [RequestRecord("s0", k, float(k), prompt_tokens=300, ttft_s=0.5, token_ids=array("I", range(300)))
               for k in range(2)]  # the second could reuse the first's full blocks
    return {"summary": _summary(hit_rate), "wall_s": 1.0, "replica_ids": ["a"], "num_prompt_token_mismatches": 0,
            "router_state": {}, "records": [r.to_json() for r in records]}


@pytest.fixture
def no_cluster(monkeypatch):
    """run_bench with everything that needs the model or the cluster replaced; returns the policies' outcomes."""
    outcomes: dict[str, object] = {}

    def run_policy(cfg, policy, workload, prepared, time_scale, progress):
        outcome = outcomes.get(policy, _fake_run())
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(live, "TokenizerRenderer", lambda source: SimpleNamespace(chat_token_ids=lambda *args: []))
    monkeypatch.setattr(local, "ensure_model", lambda cfg, progress: None)
    monkeypatch.setattr(live, "prepare_requests", lambda *args: {})
    monkeypatch.setattr(live, "kv_capacity_blocks", lambda cfg: None)
    monkeypatch.setattr(live, "warm_up", lambda *args: outcomes.get("router state after the warm-up", {}))
    monkeypatch.setattr(live, "run_policy", run_policy)

    def redeploy(cfg, progress):  # only the restore of the configured policy calls it (run_policy is replaced)
        outcomes.setdefault("redeployed", []).append(cfg.router.policy)
        if isinstance(outcomes.get("redeploy"), BaseException):
            raise outcomes["redeploy"]

    monkeypatch.setattr(live, "redeploy", redeploy)
    return outcomes


def _run_bench(policies=("pow2", "warmpath", "round-robin"), rounds: int = 1) -> dict:
    from cluster.config import ClusterConfig

    return live.run_bench(ClusterConfig(), "fanout", list(policies), 0, 2, 1.0, lambda msg: None, rounds=rounds)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf"])
def test_bench_refuses_a_time_scale_no_run_can_use(monkeypatch, tmp_path, value):
    monkeypatch.setattr(live, "run_bench", _never)
    result = CliRunner().invoke(app, [*BENCH, f"--time-scale={value}", "--out", str(tmp_path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "--time-scale must be a finite number > 0" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, value, message", [
    ("sessions", "0", "--sessions must be between 1 and 1,000,000, got 0"),
    ("sessions", "-3", "--sessions must be between 1 and 1,000,000, got -3"),
    ("sessions", "99999999999999999999", "--sessions must be between 1 and 1,000,000, got 99999999999999999999"),
    ("rounds", "0", "--rounds must be >= 1, got 0"), ("rounds", "-2", "--rounds must be >= 1, got -2"),
])
def test_bench_refuses_fewer_than_one_session_or_round_or_too_many_sessions(monkeypatch, tmp_path, flag, value,
                                                                             message):
    monkeypatch.setattr(live, "run_bench", _never)
    result = CliRunner().invoke(app, [*BENCH, f"--{flag}={value}", "--out", str(tmp_path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip() == message


def test_run_bench_refuses_a_non_finite_time_scale():
    from cluster.config import ClusterConfig

    with pytest.raises(ValueError, match="finite"):
        live.run_bench(ClusterConfig(), "fanout", ["pow2"], 0, 2, float("nan"), lambda msg: None)


def test_bench_runs_a_policy_named_twice_once(monkeypatch, tmp_path):
    seen = []

    def run_bench(cfg, name, policies, *args, **kwargs):
        seen.append(list(policies))
        raise KeyboardInterrupt

    monkeypatch.setattr(live, "run_bench", run_bench)
    CliRunner().invoke(app, ["bench", "--workload", "fanout", "--policies", "pow2, warmpath,pow2",
                             "--out", str(tmp_path)])
    assert seen == [["pow2", "warmpath"]]


def test_a_failed_policy_keeps_the_others(no_cluster):
    no_cluster["warmpath"] = RuntimeError("redeploy failed:\n  replica died")
    result = _run_bench()
    assert list(result["policies"]) == ["pow2", "warmpath", "round-robin"]
    assert result["policies"]["warmpath"] == {"error": "RuntimeError: redeploy failed: replica died"}
    assert result["policies"]["round-robin"]["summary"]["hit_rate"] == 0.8
    assert live.failures(result) == ["warmpath: RuntimeError: redeploy failed: replica died"]


def test_ctrl_c_carries_the_policies_that_finished(no_cluster):
    no_cluster["warmpath"] = KeyboardInterrupt()
    with pytest.raises(live.BenchInterrupted) as stop:
        _run_bench()
    assert list(stop.value.result["policies"]) == ["pow2"] and stop.value.result["interrupted"] is True


def test_bench_writes_what_finished_marks_the_failure_and_exits_1(no_cluster, tmp_path):
    no_cluster["pow2"] = MemoryError()  # the baseline: ratios fall back to the first policy that finished
    no_cluster["warmpath"] = _fake_run(0.9)
    no_cluster["round-robin"] = _fake_run(0.45)
    result = CliRunner().invoke(app, [*BENCH, "--sessions", "2", "--out", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "(ratio to warmpath, value in parentheses)" in result.output
    assert "pow2" in result.output and "FAILED: MemoryError" in result.output
    assert "0.50 (0.450)" in result.output  # round-robin's hit rate over warmpath's
    assert "error: 1 failed: fanout pow2: MemoryError" in result.output
    document = json.loads((tmp_path / "bench-fanout.json").read_text())
    assert document["policies"]["pow2"] == {"error": "MemoryError"}
    assert document["policies"]["warmpath"]["summary"]["hit_rate"] == 0.9


def test_bench_interrupted_writes_what_finished_and_exits_130(no_cluster, tmp_path):
    no_cluster["warmpath"] = KeyboardInterrupt()
    result = CliRunner().invoke(app, [*BENCH, "--sessions", "2", "--out", str(tmp_path)])
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output.splitlines()[-1]
    # It stopped with warmpath deployed, and never put the configured policy back: it says so.
    assert "`warmpath up --redeploy` deploys it as configured" in result.output
    document = json.loads((tmp_path / "bench-fanout.json").read_text())
    assert list(document["policies"]) == ["pow2"] and document["interrupted"] is True


def test_bench_interrupted_before_any_policy_keeps_an_earlier_file(no_cluster, tmp_path):
    no_cluster["pow2"] = KeyboardInterrupt()
    earlier = tmp_path / "bench-fanout.json"
    earlier.write_text("{}")
    result = CliRunner().invoke(app, [*BENCH, "--sessions", "2", "--out", str(tmp_path)])
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output.splitlines()[-1]
    assert earlier.read_text() == "{}"


def test_rounds_rotate_the_policy_list():
    policies = ["pow2", "warmpath", "prefix-tree"]
    assert [live.round_order(policies, i) for i in range(4)] == [
        ["pow2", "warmpath", "prefix-tree"], ["warmpath", "prefix-tree", "pow2"],
        ["prefix-tree", "pow2", "warmpath"], ["pow2", "warmpath", "prefix-tree"],
    ]


@pytest.fixture
def ttft_by_call(monkeypatch, no_cluster):
    """run_policy answers each call with the next TTFT p50 of its policy's list; records the calls."""
    calls: list[str] = []
    ttfts = {"pow2": [1.0, 2.0, 0.5], "warmpath": [0.6, 1.0, 0.4]}

    def run_policy(cfg, policy, workload, prepared, time_scale, progress):
        calls.append(policy)
        outcome = no_cluster.pop(f"{policy}#{calls.count(policy)}", None)
        if isinstance(outcome, BaseException):
            raise outcome
        run = _fake_run()
        run["summary"] = dict(run["summary"], ttft_p50_s=ttfts[policy][calls.count(policy) - 1])
        return run

    monkeypatch.setattr(live, "run_policy", run_policy)
    return calls


def test_rounds_pair_each_policy_with_the_same_rounds_baseline(ttft_by_call):
    result = _run_bench(("pow2", "warmpath"), rounds=3)
    assert ttft_by_call == ["pow2", "warmpath", "warmpath", "pow2", "pow2", "warmpath"]
    assert [r["order"] for r in result["rounds"]] == [["pow2", "warmpath"], ["warmpath", "pow2"], ["pow2", "warmpath"]]
    assert "records" not in result["rounds"][1]["runs"]["pow2"]  # later rounds keep summaries only
    assert result["policies"]["warmpath"]["summary"]["ttft_p50_s"] == 0.6  # round 1 is the full result
    ttft = result["paired_ratios"]["warmpath"]["ttft_p50_s"]
    assert ttft == {"median": 0.6, "min": 0.5, "max": 0.8, "num_rounds": 3}  # 0.6/1.0, 1.0/2.0, 0.4/0.5
    assert result["paired_ratios"]["pow2"]["ttft_p50_s"]["median"] == 1.0
    # The targets name two baselines: warmpath over each other policy is in the JSON too.
    assert result["warmpath_ttft_p50_over"] == {"pow2": ttft}
    assert live.failures(result) == []


def test_a_policy_failing_in_a_later_round_is_reported_and_left_out_of_its_ratios(ttft_by_call, no_cluster):
    no_cluster["pow2#2"] = RuntimeError("redeploy failed")
    result = _run_bench(("pow2", "warmpath"), rounds=3)
    assert result["rounds"][1]["runs"]["pow2"] == {"error": "RuntimeError: redeploy failed"}
    assert live.failures(result) == ["round 2 pow2: RuntimeError: redeploy failed"]
    ttft = result["paired_ratios"]["warmpath"]["ttft_p50_s"]
    assert ttft["num_rounds"] == 2 and ttft["min"] == 0.6 and ttft["max"] == pytest.approx(0.8)  # 0.6/1.0, 0.4/0.5


def test_ctrl_c_in_a_later_round_keeps_what_that_round_finished(ttft_by_call, no_cluster):
    no_cluster["pow2#2"] = KeyboardInterrupt()
    with pytest.raises(live.BenchInterrupted) as stop:
        _run_bench(("pow2", "warmpath"), rounds=3)
    result = stop.value.result
    assert result["interrupted"] is True
    assert [r["order"] for r in result["rounds"]] == [["pow2", "warmpath"], ["warmpath"]]
    assert result["paired_ratios"]["warmpath"]["ttft_p50_s"]["num_rounds"] == 1  # round 2 has no baseline


def test_bench_prints_the_paired_ratios_of_its_rounds(ttft_by_call, tmp_path):
    result = CliRunner().invoke(app, ["bench", "--workload", "fanout", "--policies", "pow2,warmpath",
                                      "--rounds", "3", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "round 1 of 3" in result.output
    assert "ratio to pow2 within each of 3 rounds: median [min-max]" in result.output
    assert "0.60 [0.50-0.80]" in result.output
    assert "round 2: warmpath, pow2" in result.output
    document = json.loads((tmp_path / "bench-fanout.json").read_text())
    assert len(document["rounds"]) == 3 and document["paired_ratios"]["warmpath"]["ttft_p50_s"]["max"] == 0.8


def test_one_round_writes_no_rounds(no_cluster):
    result = _run_bench(("pow2", "warmpath"))
    assert "rounds" not in result and "paired_ratios" not in result and "warmpath_ttft_p50_over" not in result


def test_the_cluster_is_left_with_its_configured_policy(no_cluster):
    _run_bench(("warmpath", "pow2"))  # the configured policy is warmpath (the default)
    assert no_cluster["redeployed"] == ["warmpath"]


def test_no_redeploy_when_the_last_policy_is_the_configured_one(no_cluster):
    _run_bench(("pow2", "warmpath"))
    assert "redeployed" not in no_cluster
    _run_bench(("warmpath", "pow2"), rounds=2)  # round 2 runs pow2, warmpath
    assert "redeployed" not in no_cluster


def test_the_configured_policy_run_last_and_failed_is_deployed_again(no_cluster):
    """Its redeploy failed, and the bench left the cluster as that failure left it, the application maybe gone."""
    no_cluster["warmpath"] = RuntimeError("redeploy failed")
    _run_bench(("pow2", "warmpath"))
    assert no_cluster["redeployed"] == ["warmpath"]


def test_a_failed_restore_is_reported_with_the_figures_kept(no_cluster):
    no_cluster["redeploy"] = RuntimeError("serve timed out")
    result = _run_bench(("warmpath", "pow2"))
    assert result["policies"]["pow2"]["summary"]["hit_rate"] == 0.8
    assert live.failures(result) == ["redeploying the configured policy: RuntimeError: serve timed out"]


def test_bench_keeps_each_finished_policy_and_round_on_disk(no_cluster, tmp_path, monkeypatch):
    path = tmp_path / "bench-fanout.json"
    on_disk: list[dict | None] = []
    fake = live.run_policy

    def run_policy(cfg, policy, *args):
        on_disk.append(json.loads(path.read_text()) if path.exists() else None)
        return fake(cfg, policy, *args)

    monkeypatch.setattr(live, "run_policy", run_policy)
    result = CliRunner().invoke(app, ["bench", "--workload", "fanout", "--policies", "pow2,warmpath", "--rounds", "2",
                                      "--sessions", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert on_disk[0] is None and len(on_disk) == 4  # round 1: pow2, warmpath; round 2: warmpath, pow2
    assert on_disk[1]["in_progress"] is True and list(on_disk[1]["policies"]) == ["pow2"]
    assert list(on_disk[2]["policies"]) == ["pow2", "warmpath"] and len(on_disk[2]["rounds"]) == 1
    assert on_disk[3] == on_disk[2]  # a later round is written when it ends
    document = json.loads(path.read_text())
    assert "in_progress" not in document and len(document["rounds"]) == 2


def test_gpu_sizes_replay_five_minutes_of_arrivals_unless_told_a_session_count():
    from bench.workloads import default_params

    cpu = live.live_workload("shared-tools", "cpu", 0, 2, None)
    assert cpu.params == default_params("shared-tools", "cpu") and len(cpu.sessions) == cpu.params.num_sessions
    gpu = live.live_workload("shared-tools", "gpu", 0, 2, None)
    params = default_params("shared-tools", "gpu")
    assert gpu.params == dataclasses.replace(params, num_sessions=len(gpu.sessions))
    assert len(gpu.sessions) == round(params.sessions_per_s_per_replica * 2 * live.GPU_ARRIVAL_WINDOW_S) == 180
    assert len(live.live_workload("coding", "gpu", 0, 2, 7).sessions) == 7


def test_a_gpu_sized_bench_records_its_scale_decodes_the_workloads_output_and_bounds_the_hit_rate(no_cluster):
    from cluster.config import ClusterConfig

    result = live.run_bench(ClusterConfig(), "fanout", ["pow2"], 0, 3, 1.0, lambda msg: None, scale="gpu")
    assert result["scale"] == "gpu" and result["num_sessions"] == 3
    assert result["max_output_tokens"] == live.GPU_MAX_OUTPUT_TOKENS
    assert result["workload_params"]["num_documents"] == 1000  # fan-out's gpu() size (cpu(): 4)
    # The replicas' KV capacity is unknown (as on GPU): the infinite-cache bound alone, and the report says it.
    block = ClusterConfig().replicas.block_size_tokens
    assert result["kv_capacity_blocks"] is None and result["oracle"]["pow2"]["placed_hit_rate"] is None
    assert result["oracle"]["pow2"]["infinite_hit_rate"] == pytest.approx(299 // block * block / 600)
    # The fake run's hit rate is above the bound, which a live run's can be only by requests served out of the
    # order they were sent (the replay's): the report says so rather than print a ratio past 1 unexplained.
    assert ("pow2: 0.800 / 0.480 = 1.67 of the infinite shared cache (above it: requests reached the engines out "
            "of the order they were sent)\n") in report.live_report(result) + "\n"
    assert report.live_report(result).startswith("workload fanout at GPU sizes: 3 sessions, ")
    assert report.live_report(_run_bench()).startswith("workload fanout: 2 sessions, ")
    assert _run_bench()["scale"] == "cpu" and _run_bench()["max_output_tokens"] == live.DEFAULT_MAX_OUTPUT_TOKENS


def _router_state(*capacities) -> dict:
    kv_cache = {f"r{i}": {"capacity_blocks": c, "usage": 0.1} for i, c in enumerate(capacities)}
    return {"routers": [{"policy": "warmpath", "kv_cache": kv_cache}], "stats": {}}


def test_the_replicas_reported_kv_cache_is_the_smallest_any_reported():
    assert live.reported_kv_capacity_blocks(_router_state(5000, 4800)) == 4800
    assert live.reported_kv_capacity_blocks(_router_state(5000, None)) == 5000  # one not reported yet
    assert live.reported_kv_capacity_blocks(_router_state(None)) is None
    assert live.reported_kv_capacity_blocks({"routers": [], "stats": {}}) is None  # another policy
    assert live.reported_kv_capacity_blocks({"error": "ConnectError: refused"}) is None


def test_the_placed_bound_uses_the_kv_cache_the_replicas_report(no_cluster):
    from cluster.config import ClusterConfig

    no_cluster["router state after the warm-up"] = _router_state(3, 3)
    messages = []
    result = live.run_bench(ClusterConfig(), "fanout", ["pow2"], 0, 2, 1.0, messages.append, scale="gpu")
    assert result["kv_capacity_blocks"] == 3 and result["kv_capacity_source"] == "replicas"
    assert "bench: the replicas' KV caches hold 3 blocks each (as their engines report)" in messages
    block = ClusterConfig().replicas.block_size_tokens
    # Two requests of one session, 300 tokens each: a replica of 3 blocks keeps 3 of the first's 18 full blocks.
    assert result["oracle"]["pow2"]["placed_hit_rate"] == pytest.approx(3 * block / 600)
    assert "(same trace; placement over 3 KV blocks per replica, as the engines report):" in report.live_report(result)


def test_without_a_reported_size_a_cpu_cluster_works_it_out_and_a_gpu_cluster_has_the_infinite_bound(
        no_cluster, monkeypatch):
    from cluster.config import ClusterConfig

    monkeypatch.setattr(live, "kv_capacity_blocks", lambda cfg: 9 if cfg.replicas.accelerator == "cpu" else None)
    messages = []
    result = live.run_bench(ClusterConfig(), "fanout", ["pow2"], 0, 2, 1.0, messages.append)
    assert result["kv_capacity_blocks"] == 9 and result["kv_capacity_source"] == "model config"
    assert "bench: no KV cache size from the replicas (none reported); 9 blocks each from the model's shape and " \
        "replicas.kv_cache_space_gib" in messages
    gpu = ClusterConfig.model_validate({"replicas": {"accelerator": "gpu", "num_gpus": 1}})
    result = live.run_bench(gpu, "fanout", ["pow2"], 0, 2, 1.0, messages.append)
    assert result["kv_capacity_blocks"] is None and result["kv_capacity_source"] is None
    assert result["oracle"]["pow2"]["placed_hit_rate"] is None
    assert any(m.startswith("bench: no KV cache size from the replicas (none reported), and none can be worked out")
               and m.endswith("on gpu: the infinite-cache bound alone") for m in messages)
    no_cluster["router state after the warm-up"] = {"error": "ConnectError: refused"}
    pow2 = ClusterConfig.model_validate({"router": {"policy": "pow2"}})
    for cfg, why in ((pow2, "router.policy=pow2: no prefix-aware router to report it"),
                     (ClusterConfig(), "GET /v1/router: ConnectError: refused")):
        live.run_bench(cfg, "fanout", ["pow2"], 0, 2, 1.0, messages.append)
        assert f"bench: no KV cache size from the replicas ({why}); 9 blocks each from the model's shape and " \
            "replicas.kv_cache_space_gib" in messages


GPU_CONFIG = ["--config", str(Path(__file__).parents[3] / "k8s/overlays/gpu/cluster.yaml")]  # accelerator: gpu


@pytest.mark.parametrize("flag,scale", [([], "cpu"), (["--scale", "GPU"], "gpu"), (GPU_CONFIG, "gpu"),
                                        ([*GPU_CONFIG, "--scale", "cpu"], "cpu")])
def test_bench_scale_defaults_to_the_configs_accelerator(monkeypatch, tmp_path, flag, scale):
    seen = []

    def run_bench(*args, **kwargs):
        seen.append(kwargs["scale"])
        raise KeyboardInterrupt

    monkeypatch.setattr(live, "run_bench", run_bench)
    monkeypatch.setattr(live, "prepare_workload", lambda *args, **kwargs: None)
    CliRunner().invoke(app, [*BENCH, *flag, "--out", str(tmp_path)])
    assert seen == [scale]


def test_bench_of_every_workload_checks_each_against_the_window_before_running_any(monkeypatch, tmp_path):
    rendered = []

    def prepare_workload(cfg, name, *args, **kwargs):
        rendered.append(name)
        if name == "coding":
            raise live.WorkloadTooLong("the longest coding call at GPU sizes needs 33000 tokens")
        return None

    monkeypatch.setattr(live, "prepare_workload", prepare_workload)
    monkeypatch.setattr(live, "run_bench", _never)
    result = CliRunner().invoke(app, ["bench", "--workload", "all", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == "error: the longest coding call at GPU sizes needs 33000 tokens"
    assert "coding" in rendered and list(tmp_path.iterdir()) == []


def test_bench_refuses_an_unknown_scale(monkeypatch, tmp_path):
    monkeypatch.setattr(live, "run_bench", _never)
    result = CliRunner().invoke(app, [*BENCH, "--scale", "tpu", "--out", str(tmp_path)])
    assert result.exit_code == 2 and result.output.strip() == "--scale must be cpu or gpu, got tpu"


def test_a_workload_over_the_models_window_is_refused_before_any_cluster_work(no_cluster, monkeypatch, tmp_path):
    long_call = live.PreparedRequest("s0", 0, {"max_tokens": 100}, list(range(8150)), 0.0)
    monkeypatch.setattr(live, "prepare_requests", lambda *args: {"s0": [long_call]})
    monkeypatch.setattr(live, "warm_up", _never)
    result = CliRunner().invoke(app, [*BENCH, "--scale", "gpu", "--sessions", "2", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        "error: the longest fanout call at GPU sizes needs 8250 tokens (prompt and output), over "
        "model.max_model_len_tokens=8192: serve a model with a longer window, or use --scale cpu"
    )
    assert list(tmp_path.iterdir()) == []  # nothing written
    monkeypatch.setattr(live, "prepare_requests", lambda *args: {"s0": [dataclasses.replace(long_call, token_ids=[1])]})
    from cluster.config import ClusterConfig

    with pytest.raises(AssertionError, match="did work"):  # a call that fits goes on to the warm-up
        live.run_bench(ClusterConfig(), "fanout", ["pow2"], 0, 2, 1.0, lambda msg: None, scale="gpu")


def test_bench_with_a_model_that_has_no_chat_template_says_so_in_one_line(monkeypatch, tmp_path):
    """Its tokenizer loaded, and rendering the workload failed with a traceback."""
    from cluster.model_builder import build_model

    monkeypatch.setattr(live, "warm_up", _never)
    model = tmp_path / "no-template"
    build_model(model)
    (model / "chat_template.jinja").unlink()
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  source: {model}\n")
    result = CliRunner().invoke(app, [*BENCH, "--config", str(config), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot render chat prompts with the tokenizer of {model}: ValueError:"), last
    assert "chat_template" in last


def test_bench_before_the_model_exists_or_with_a_tokenizer_out_of_reach_says_so_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(live, "warm_up", _never)
    missing = tmp_path / "config.yaml"
    missing.write_text(f"model:\n  source: {tmp_path / 'no-model'}\n")
    result = CliRunner().invoke(app, [*BENCH, "--config", str(missing), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: model.source {tmp_path / 'no-model'}: no such file or folder on this machine"
    )

    def unreachable(source):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(live, "TokenizerRenderer", unreachable)
    hub = tmp_path / "hub.yaml"
    hub.write_text("model:\n  source: Qwen/Qwen2.5-0.5B-Instruct\n")
    result = CliRunner().invoke(app, [*BENCH, "--config", str(hub), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip().splitlines()[-1] == (
        "error: cannot load the tokenizer of Qwen/Qwen2.5-0.5B-Instruct: OSError: We couldn't connect to "
        "'https://huggingface.co' to load the files"
    )
