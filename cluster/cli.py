"""The `warmpath` command: build the model, bring the local cluster up and down.

Config precedence: defaults < `--config` YAML (or `$WARMPATH_CONFIG`) < environment
(`WARMPATH_SECTION__FIELD`, `REDIS_URL`, `OTEL_EXPORTER_OTLP_ENDPOINT`) < flags.
Every command validates the config once and exits 2 with one line per problem.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional, get_args

import typer

from cluster.config import ClusterConfig, ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="warmpath: a Ray Serve cluster for LLM agents.")
render_app = typer.Typer(no_args_is_help=True, help="Render generated files from the cluster config.")
app.add_typer(render_app, name="render")

_START = time.monotonic()


def progress(msg: str) -> None:
    typer.echo(f"[warmpath {time.monotonic() - _START:6.1f}s] {msg}", err=True)


ConfigOpt = typer.Option(None, "--config", "-c", help="Cluster config YAML.")


def _load(config: Optional[Path], **flags) -> ClusterConfig:
    overrides: dict = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        section, _, name = dotted.partition("__")
        if name:
            overrides.setdefault(section, {})[name] = value
        else:
            overrides[section] = value
    try:
        return load_config(config, overrides=overrides)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2)


@app.command("build-model")
def build_model_cmd(
    config: Optional[Path] = ConfigOpt,
    out: Optional[Path] = typer.Option(None, help="Output folder (default: the config's model folder)."),
    seed: int = typer.Option(0, help="Weight initialisation seed."),
) -> None:
    """Write the small random-weight Llama model, tokenizer and chat template."""
    from cluster.model_builder import build_model

    cfg = _load(config)
    target = out or Path(cfg.model_source())
    manifest = build_model(target, seed=seed, progress=progress)
    typer.echo(json.dumps({"path": str(target), "num_params": manifest["num_params"]}))


@app.command()
def up(
    config: Optional[Path] = ConfigOpt,
    replicas: Optional[int] = typer.Option(None, help="Number of vLLM replicas."),
    policy: Optional[str] = typer.Option(None, help="Router policy."),
    http_port: Optional[int] = typer.Option(None, help="HTTP ingress port."),
    redis_url: Optional[str] = typer.Option(None, help="Use this Redis instead of starting one."),
    state_dir: Optional[str] = typer.Option(None, help="State directory."),
    timeout_s: float = typer.Option(900, help="How long to wait for the replicas."),
    redeploy: bool = typer.Option(False, help="Delete the running application first (pick up new code)."),
) -> None:
    """Start Redis, a Ray head and the Serve application; print the endpoint."""
    from cluster import local

    cfg = _load(
        config, replicas__num_replicas=replicas, router__policy=policy, ports__http_port=http_port,
        redis_url=redis_url, state_dir=state_dir,
    )
    try:
        state = local.up(cfg, progress, timeout_s=timeout_s, redeploy=redeploy)
    except local.BringUpError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1)
    typer.echo(f"warmpath is up: {state.http_url}/v1 (OpenAI-compatible; model \"{cfg.model.model_id}\")")


@app.command()
def down(config: Optional[Path] = ConfigOpt, state_dir: Optional[str] = typer.Option(None)) -> None:
    """Stop what `warmpath up` started."""
    from cluster import local

    local.down(_load(config, state_dir=state_dir), progress)


@app.command()
def status(config: Optional[Path] = ConfigOpt, state_dir: Optional[str] = typer.Option(None)) -> None:
    """Show the application, its deployments and their replicas."""
    from cluster import local

    cfg = _load(config, state_dir=state_dir)
    state = local.LocalState.load(local.state_dir_of(cfg))
    try:
        details = local.serve_details(state)
    except Exception as err:
        typer.echo(f"not running ({err.__class__.__name__}: {err})", err=True)
        raise typer.Exit(1)
    app_status, lines = local.summarize(details, cfg.app_name)
    typer.echo(f"application {cfg.app_name}: {app_status}")
    for line in lines:
        typer.echo(f"  {line}")
    if state.http_url:
        typer.echo(f"http: {state.http_url}/v1")
    if state.redis_url:
        typer.echo(f"redis: {state.redis_url}")


@render_app.command("serve-config")
def render_serve_config_cmd(
    config: Optional[Path] = ConfigOpt,
    out: Optional[Path] = typer.Option(None, help="Write here instead of stdout."),
) -> None:
    """Render the Ray Serve config file (`serve deploy`-able)."""
    from cluster.serve_config import dump_serve_config

    text = dump_serve_config(_load(config))
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)


@render_app.command("k8s")
def render_k8s_cmd(
    overlay: Optional[list[Path]] = typer.Option(
        None, "--overlay", help="Overlay folder holding a cluster.yaml (repeatable; default: every k8s/overlays/*)."
    ),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 listing generated files that drifted."),
) -> None:
    """Regenerate the KubeRay manifests' generated parts from each overlay's cluster.yaml."""
    from cluster import k8s_render

    try:
        overlays = overlay or k8s_render.default_overlays()
        if check:
            drifted = [path for o in overlays for path in k8s_render.check_k8s(o)]
            for path in drifted:
                typer.echo(f"drifted: {path}", err=True)
            if drifted:
                typer.echo("run `warmpath render k8s` and commit the result", err=True)
                raise typer.Exit(1)
            typer.echo(f"k8s manifests up to date ({len(overlays)} overlay(s))")
            return
        for o in overlays:
            changed = k8s_render.write_k8s(o)
            typer.echo(f"{o}: " + (", ".join(str(p) for p in changed) if changed else "unchanged"))
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2)


@app.command()
def bench(
    config: Optional[Path] = ConfigOpt,
    workload: str = typer.Option("shared-tools", help="shared-tools, coding, fanout, or all."),
    policies: str = typer.Option(
        "warmpath,pow2,round-robin,session-hash,prefix-tree", help="Comma-separated routing policies, each run once."
    ),
    seed: int = typer.Option(0, help="Workload seed."),
    sessions: Optional[int] = typer.Option(None, help="Sessions per workload (default: the workload's CPU size)."),
    time_scale: float = typer.Option(1.0, help="Multiplies session arrival times and tool latencies."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for bench-<workload>.json and .png."),
) -> None:
    """Run agent workloads on the local cluster once per routing policy (redeploying between policies)."""
    from bench import live, report
    from bench.workloads import WORKLOAD_NAMES
    from cluster import local
    from cluster.config import RouterPolicy

    cfg = _load(config)
    names = list(WORKLOAD_NAMES) if workload == "all" else [workload]
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [n for n in names if n not in WORKLOAD_NAMES] + [p for p in chosen if p not in get_args(RouterPolicy)]
    if unknown or not chosen:
        typer.echo(f"unknown workload or policy: {', '.join(unknown) or '(no policy)'}", err=True)
        raise typer.Exit(2)
    for name in names:
        try:
            result = live.run_bench(cfg, name, chosen, seed, sessions, time_scale, progress)
        except local.BringUpError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1)
        json_path = out / f"bench-{name}.json"
        report.write_json(json_path, result)
        typer.echo(report.live_report(result))
        try:
            report.plot_live(result, out / f"bench-{name}.png")
        except ImportError:
            progress("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        typer.echo(f"wrote {json_path}")


@app.command()
def simulate(
    workload: str = typer.Option("all", help="shared-tools, coding, fanout, or all."),
    replicas: list[int] = typer.Option([16], "--replicas", help="Replica count (repeatable)."),
    sessions: int = typer.Option(100, help="Sessions per workload."),
    seed: int = typer.Option(0, help="Workload and router seed."),
    out: Path = typer.Option(Path("bench/results/simulate.json"), help="JSON output file."),
) -> None:
    """Simulate every routing policy at scale with the production router code (GPU cost profile)."""
    from bench import report, simulator
    from bench.workloads import WORKLOAD_NAMES

    names = list(WORKLOAD_NAMES) if workload == "all" else [workload]
    if any(name not in WORKLOAD_NAMES for name in names) or any(n < 1 for n in replicas) or sessions < 1:
        typer.echo(f"workload must be one of {', '.join(WORKLOAD_NAMES)} or all; replicas and sessions >= 1", err=True)
        raise typer.Exit(2)
    runs = simulator.run_grid(names, replicas, sessions, seed=seed, progress=progress)
    document = {
        "kind": "warmpath-simulate",
        "profile": simulator.GPU_PROFILE.__dict__,
        "seed": seed,
        "runs": [run.to_json() for run in runs],
    }
    report.write_json(out, document)
    typer.echo(report.simulation_report(document["runs"]))
    typer.echo(f"wrote {out}")


if __name__ == "__main__":
    app()
