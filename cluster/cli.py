"""The `warmpath` command: build the model, bring the local cluster up and down.

Config precedence: defaults < `--config` YAML (or `$WARMPATH_CONFIG`) < environment
(`WARMPATH_SECTION__FIELD`, `REDIS_URL`, `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_SERVICE_NAME`) < flags.
Every command validates the config once and exits 2 with one line per problem.
Bad flags exit 2 with one line as well, before any work: a command that writes
files checks first that it can write them, so a long run never ends in a path
error that loses its results.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional, get_args

import typer

from cluster.config import (
    LOCAL_PATH_PREFIXES, MAX_KEY_BURST, ClusterConfig, ConfigError, RouterPolicy, bad_permissions, check_redis_url,
    is_loopback_host, load_config, refill_problem,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="warmpath: a Ray Serve cluster for LLM agents.")
render_app = typer.Typer(no_args_is_help=True, help="Render generated files from the cluster config.")
app.add_typer(render_app, name="render")

_START = time.monotonic()
# `simulate`'s default parallelism: each process holds one whole simulation (several GB for
# 10,000 sessions; a 10,000-session coding run at 256 replicas peaks at about 17 GB).
MAX_DEFAULT_JOBS = 8
# A key must outlive its own printing.
MIN_KEY_LIFETIME_S = 60.0


def progress(msg: str) -> None:
    typer.echo(f"[warmpath {time.monotonic() - _START:6.1f}s] {msg}", err=True)


def _refuse(message: str) -> NoReturn:
    """A bad flag: one line on stderr, exit 2."""
    typer.echo(message, err=True)
    raise typer.Exit(2)


def _check_writable_file(path: Path, option: str = "--out") -> None:
    """Exits 2 with one line unless `path` can be written as a file; runs before any work."""
    from cluster.writable import unwritable_file_problem

    if problem := unwritable_file_problem(path, option):
        _refuse(problem)


def _check_writable_dir(path: Path, file_names: list[str], option: str = "--out") -> None:
    """Exits 2 with one line unless the files `file_names` can be written in folder `path` (created if missing)."""
    if path.exists() and not path.is_dir():
        _refuse(f"{option} {path} is not a directory")
    for name in file_names:
        _check_writable_file(path / name, option)


def _in_progress_writer(path: Path, what: str) -> Callable[[dict], None]:
    """Writes a long run's document so far, marked `"in_progress": true`, each time it is called.

    Why: a run killed any way (out of memory, a closed terminal) then keeps what it
    finished; the final write replaces it. A failed write is said once and the run goes on.
    """
    from bench import report

    failed = False

    def write(document: dict) -> None:
        nonlocal failed
        try:
            report.write_json(path, {**document, "in_progress": True})
        except OSError as err:
            if not failed:
                progress(f"warning: cannot write {path} as {what} finish ({err.strerror or err}); "
                         "trying again at the end")
            failed = True

    return write


def _write_or_exit(path: Path, write: Callable[[Path], None]) -> None:
    """Runs `write(path)`; a failure (the path changed since it was checked) is one line and exit 1."""
    try:
        write(path)
    except OSError as err:
        typer.echo(f"error: cannot write {path} ({err.strerror or err})", err=True)
        raise typer.Exit(1)


ConfigOpt = typer.Option(None, "--config", "-c", help="Cluster config YAML (default: $WARMPATH_CONFIG; WARMPATH_<SECTION>__<FIELD> variables and flags override it).")
StateDirOpt = typer.Option(None, help="State directory of the local cluster (default: the config's state_dir).")
PoliciesOpt = typer.Option(",".join(get_args(RouterPolicy)), help="Comma-separated routing policies, each run once.")


def _check_redis_url_flag(redis_url: Optional[str]) -> None:
    """Names the flag itself when `--redis-url` is bad (the config check would name the field)."""
    if redis_url:
        try:
            check_redis_url(redis_url)
        except ValueError as err:
            _refuse(f"--redis-url {err}")


# The flag that sets each config path `_load` is given (`section__field`), named beside a problem with its value.
_FLAG_OF = {"replicas__num_replicas": "--replicas", "router__policy": "--policy", "ports__http_port": "--http-port",
            "redis_url": "--redis-url", "state_dir": "--state-dir", "access__is_auth_enabled": "--no-auth"}


def _load(config: Optional[Path], **flags) -> ClusterConfig:
    overrides: dict = {}
    flag_names: dict[tuple[str, ...], str] = {}
    for dotted, value in flags.items():
        if value is None:
            continue
        section, _, name = dotted.partition("__")
        if name:
            overrides.setdefault(section, {})[name] = value
        else:
            overrides[section] = value
        flag_names[(section, name) if name else (section,)] = _FLAG_OF[dotted]
    try:
        return load_config(config, overrides=overrides, flag_names=flag_names)
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2)


@app.command("build-model")
def build_model_cmd(
    config: Optional[Path] = ConfigOpt,
    out: Optional[Path] = typer.Option(None, help="Output folder (default: the config's model folder)."),
    seed: int = typer.Option(0, help="Weight initialisation seed.", min=0, max=2**64 - 1),
    force: bool = typer.Option(False, "--force", help="Write into a folder that holds files of another model."),
) -> None:
    """Write the small random-weight Llama model, tokenizer and chat template."""
    from cluster.model_builder import build_model, is_rebuildable

    cfg = _load(config)
    source = cfg.model.source
    if out is None and source and not source.startswith(LOCAL_PATH_PREFIXES):
        # A Hugging Face id: read as a folder, it would get random weights under ./<org>/<name>.
        _refuse(f"model.source {source!r} names a Hugging Face model, not a folder to write the small "
                "random-weight model into: pass --out, or unset model.source")
    target = out or Path(cfg.model_source())
    _check_writable_dir(target, ["config.json"], "--out" if out else "model.source")
    if not force and not is_rebuildable(target):
        # A model folder of the user's own (model.source of a GPU config, say): a build would overwrite its
        # weights, config and tokenizer with random ones.
        _refuse(f"{'--out' if out else 'model.source'} {target} holds files that no warmpath build wrote "
                "(another model?): a build would overwrite its weights, config and tokenizer; pass another "
                "folder, or --force to overwrite it")
    manifest = build_model(target, seed=seed, progress=progress)
    typer.echo(json.dumps({"path": str(target), "num_params": manifest["num_params"]}))


@app.command()
def up(
    config: Optional[Path] = ConfigOpt,
    replicas: Optional[int] = typer.Option(None, help="Number of vLLM replicas."),
    policy: Optional[str] = typer.Option(None, help="Router policy."),
    http_port: Optional[int] = typer.Option(None, help="HTTP ingress port."),
    redis_url: Optional[str] = typer.Option(None, help="Use this Redis instead of starting one."),
    state_dir: Optional[str] = StateDirOpt,
    timeout_s: float = typer.Option(900, help="How long to wait for the replicas."),
    redeploy: bool = typer.Option(False, help="Delete the running application first (pick up new code)."),
    no_auth: bool = typer.Option(False, "--no-auth", help="Turn API keys off (local experiments only)."),
) -> None:
    """Start Redis, a Ray head and the Serve application; print the endpoint and the API key."""
    from cluster import local
    from cluster.serve_config import grpc_app_name

    _check_redis_url_flag(redis_url)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        _refuse(f"--timeout-s must be a finite number of seconds > 0, got {timeout_s}")
    cfg = _load(
        config, replicas__num_replicas=replicas, router__policy=policy, ports__http_port=http_port,
        redis_url=redis_url, state_dir=state_dir, access__is_auth_enabled=False if no_auth else None,
    )
    if not cfg.access.is_auth_enabled:
        # Without keys every caller holds every permission, server-side HTTP tools included, which reach this
        # machine's loopback and private networks (an unset ports.host is 127.0.0.1 then: `ClusterConfig`).
        if is_loopback_host(cfg.ports.host):
            progress(f"API keys are off: the proxies are to answer {cfg.ports.host} only (set ports.host to "
                     "serve other machines; Serve's gRPC proxy listens on every address, and the gRPC API refuses "
                     "calls from other machines)")
        else:
            progress(f"warning: API keys are off and the proxies are to listen on {cfg.ports.host} (ports.host): "
                     "every caller that reaches it holds every permission")
    _check_writable_file(local.LocalState.path(local.state_dir_of(cfg)), "state_dir")
    _load_state(cfg)  # a broken record is one line before anything starts
    from cluster.replica_args import replica_args_problems

    if problems := replica_args_problems(cfg):  # else each replica finds them, minutes from now
        _refuse("\n".join(problems))
    with _state_dir_held(cfg):
        try:
            state = local.up(cfg, progress, timeout_s=timeout_s, redeploy=redeploy)
        except local.BringUpError as err:
            typer.echo(f"error: {err}", err=True)
            _echo_left_running(cfg)
            raise typer.Exit(1)
        except OSError as err:  # a state file it wrote (serve_config.yaml, the key) on a full or read-only disk
            typer.echo(f"error: {err.strerror or err}: {err.filename or ''}".rstrip(": "), err=True)
            _echo_left_running(cfg)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            _echo_left_running(cfg)
            raise typer.Exit(130)
    typer.echo(f"warmpath is up: {state.http_url}/v1 (OpenAI-compatible; model \"{cfg.model.model_id}\")")
    typer.echo(f"grpc: {state.grpc_address} (application metadata \"{grpc_app_name(cfg)}\"; see protos/README.md)")
    if cfg.access.is_auth_enabled:
        key_file = local.api_key_file(cfg)
        typer.echo(f"api key: {key_file.read_text().strip()} (send 'Authorization: Bearer <key>'; kept in {key_file})")


@contextlib.contextmanager
def _state_dir_held(cfg: ClusterConfig) -> Iterator[None]:
    """`local.state_dir_lock`, its refusal one line (exit 1)."""
    from cluster import local

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(local.state_dir_lock(cfg))
        except (local.BringUpError, OSError) as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1)
        yield


def _echo_left_running(cfg: ClusterConfig) -> None:
    """After a failed or interrupted `up`: what it left running, and how to stop it."""
    from cluster import local

    try:
        state = local.LocalState.load(local.state_dir_of(cfg))
    except local.BringUpError:
        return
    parts = ([f"redis-server (pid {state.redis_pid})"] if state.redis_pid else []) + (
        ["the Ray head"] if state.ray_started else []) + (
        # A joined cluster keeps what was deployed on it, replicas loading their models included.
        [f"warmpath's applications on {state.ray_address}"] if not state.ray_started and state.ray_address
        and state.app_name else [])
    if parts:
        # `down` finds them only in this state directory: one given by --state-dir or a config's is named.
        where = "" if cfg.state_dir == ClusterConfig.model_fields["state_dir"].default else (
            f" --state-dir {shlex.quote(cfg.state_dir)}")
        typer.echo(f"left running: {', '.join(parts)}; `warmpath down{where}` stops them", err=True)


keys_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke API keys (stored hashed in Redis).")
app.add_typer(keys_app, name="keys")


def _keys_redis_url(config: Optional[Path], redis_url: Optional[str], state_dir: Optional[str]) -> str:
    _check_redis_url_flag(redis_url)
    cfg = _load(config, redis_url=redis_url, state_dir=state_dir)
    url = cfg.redis_url or _load_state(cfg).redis_url
    if not url:
        typer.echo(
            "no Redis: pass --redis-url (or set REDIS_URL), or run `warmpath up` first "
            f"({_where_state_is(cfg)})",
            err=True,
        )
        raise typer.Exit(2)
    return url


def _load_state(cfg: ClusterConfig):
    """What `warmpath up` recorded in the config's state directory; a broken record is one line, exit 1."""
    from cluster import local

    try:
        return local.LocalState.load(local.state_dir_of(cfg))
    except local.BringUpError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1)


def _where_state_is(cfg: ClusterConfig) -> str:
    """Where the local cluster's record is looked for, for messages that found none: a state directory `up` used
    (its Redis data is there) was stopped, or never brought up; any other may be the wrong one."""
    from cluster import local

    state_dir = local.state_dir_of(cfg)
    if local.redis_dir_of(cfg).is_dir():
        return (f"nothing `warmpath up` started from {state_dir} is running: `warmpath down` stopped it, or "
                "`warmpath up` did not finish")
    return (
        f"no local cluster is recorded in {local.LocalState.path(state_dir)}; the state directory "
        "is relative to where `warmpath up` ran unless --state-dir or WARMPATH_STATE_DIR says otherwise"
    )


def _with_key_store(url: str, work):
    from cluster.api_keys import InvalidStoreUrl, StoreUnavailable, run_with_store
    from cluster.config import without_password

    try:
        return run_with_store(url, work)
    except InvalidStoreUrl as err:
        _refuse(f"Redis URL {without_password(url)!r} is not usable: {err}")
    except StoreUnavailable as err:
        typer.echo(f"error: Redis at {without_password(url)} is unavailable: {err}", err=True)
        raise typer.Exit(1)


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _key_problems(
    name: str, permissions: list[str], requests_per_s: float, burst: int, expires_in_days: Optional[float],
    max_sessions: Optional[int] = None,
) -> list[str]:
    """What is wrong with `keys create`'s flags, one item per flag (the record model would refuse the same)."""
    from cluster.api_keys import MAX_KEY_LIFETIME_DAYS, MAX_KEY_NAME_LENGTH

    problems = []
    if not _is_utf8(name) or not all(map(_is_utf8, permissions)):
        # A terminal in another encoding hands Python undecodable bytes as lone surrogates.
        return ["--name and --permission must be UTF-8 text (the terminal passed bytes that are not)"]
    if not name.strip() or len(name) > MAX_KEY_NAME_LENGTH:
        got = f"{len(name)} characters" if name.strip() else repr(name)
        problems.append(f"--name must be 1 to {MAX_KEY_NAME_LENGTH} characters and not blank, got {got}")
    if bad := bad_permissions(permissions):
        problems.append(f"--permission must be non-empty and contain no whitespace, got {', '.join(map(repr, bad))}")
    is_rate_valid = math.isfinite(requests_per_s) and requests_per_s > 0
    if not is_rate_valid:
        problems.append(f"--requests-per-s must be a finite number > 0, got {requests_per_s}")
    if not 1 <= burst <= MAX_KEY_BURST:
        problems.append(f"--burst must be 1 to {MAX_KEY_BURST}, got {burst}")
    elif is_rate_valid and (problem := refill_problem(burst, requests_per_s)) is not None:
        problems.append(f"--burst / --requests-per-s (how long an empty bucket takes to refill) {problem}")
    if expires_in_days is not None:
        min_days = MIN_KEY_LIFETIME_S / 86400
        if math.isnan(expires_in_days) or expires_in_days <= 0:
            problems.append(f"--expires-in-days must be > 0, got {expires_in_days}")
        elif expires_in_days < min_days:
            problems.append(f"--expires-in-days must be at least 1 minute ({min_days:.6f} days), got {expires_in_days}")
        elif expires_in_days > MAX_KEY_LIFETIME_DAYS:
            problems.append(f"--expires-in-days must be at most {MAX_KEY_LIFETIME_DAYS} (100 years), got {expires_in_days}")
    if max_sessions is not None and max_sessions < 1:
        problems.append(f"--max-sessions must be at least 1, got {max_sessions}")
    elif max_sessions is not None and "*" in permissions:
        problems.append("--max-sessions does not apply to a key holding '*' (such keys have no session quota)")
    return problems


@keys_app.command("create")
def keys_create(
    name: str = typer.Option(..., help="Label of the key."),
    permission: list[str] = typer.Option([], "--permission", "-p", help="A permission the key holds (repeat; '*' = all; tools:http lets it define server-side HTTP tools)."),
    requests_per_s: Optional[float] = typer.Option(None, help="Sustained rate (default: access.default_requests_per_s)."),
    burst: Optional[int] = typer.Option(None, help="Bucket size (default: access.default_burst)."),
    expires_in_days: Optional[float] = typer.Option(None, help="The key stops working this many days from now (default: never)."),
    max_sessions: Optional[int] = typer.Option(
        None, help="Live sessions the key may hold at once (default: access.max_sessions_per_key; none for '*')."
    ),
    config: Optional[Path] = ConfigOpt,
    redis_url: Optional[str] = typer.Option(None, help="Key store (default: the config's or the local cluster's)."),
    state_dir: Optional[str] = StateDirOpt,
) -> None:
    """Create a key; prints it once (only its hash is stored)."""
    cfg = _load(config)
    rate = requests_per_s if requests_per_s is not None else cfg.access.default_requests_per_s
    size = burst if burst is not None else cfg.access.default_burst
    if problems := _key_problems(name, permission, rate, size, expires_in_days, max_sessions):
        _refuse("; ".join(problems))
    expires_in_s = None if expires_in_days is None else expires_in_days * 86400
    key, record = _with_key_store(
        _keys_redis_url(config, redis_url, state_dir),
        lambda store: store.create(name, permission, rate, size, expires_in_s=expires_in_s, max_sessions=max_sessions),
    )
    typer.echo(json.dumps({"api_key": key, **record.model_dump(mode="json")}))


@keys_app.command("list")
def keys_list(
    config: Optional[Path] = ConfigOpt,
    redis_url: Optional[str] = typer.Option(None, help="Key store (default: the config's or the local cluster's)."),
    state_dir: Optional[str] = StateDirOpt,
) -> None:
    """One JSON line per key: id, name, permissions, rate (never the key); a warning on stderr per unreadable key."""
    listing = _with_key_store(_keys_redis_url(config, redis_url, state_dir), lambda store: store.list())
    for record in listing.records:
        typer.echo(record.model_dump_json())
    for key in listing.unreadable:
        typer.echo(
            f"warning: key {key.key_id} has an unreadable record ({key.problem}); calls with it are refused: "
            f"`warmpath keys revoke {key.key_id}`",
            err=True,
        )


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="Id of the key (key_...), or the key itself (wp_...: revoked by its id)."),
    config: Optional[Path] = ConfigOpt,
    redis_url: Optional[str] = typer.Option(None, help="Key store (default: the config's or the local cluster's)."),
    state_dir: Optional[str] = StateDirOpt,
) -> None:
    """Delete a key; calls with it fail from the next one on. Takes the key itself too (never echoed)."""
    from cluster.api_keys import KEY_PREFIX, hash_api_key, key_id_of

    if not _is_utf8(key_id):
        _refuse("KEY_ID must be UTF-8 text (the terminal passed bytes that are not)")
    if key_id.startswith(KEY_PREFIX):  # the key `keys create` printed: revoked by its id, which alone is shown
        key_id = key_id_of(hash_api_key(key_id))
    if not _with_key_store(_keys_redis_url(config, redis_url, state_dir), lambda store: store.revoke(key_id)):
        typer.echo(f"no key {key_id}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {key_id}")


@app.command()
def down(config: Optional[Path] = ConfigOpt, state_dir: Optional[str] = StateDirOpt) -> None:
    """Stop what `warmpath up` started."""
    from cluster import local

    cfg = _load(config, state_dir=state_dir)
    where = local.state_dir_of(cfg)
    try:
        is_there = where.exists()
    except OSError as err:  # a folder on the way this user may not enter
        typer.echo(f"error: state_dir {where} cannot be read ({err.strerror or err}): run as the user that ran "
                   "`warmpath up`", err=True)
        raise typer.Exit(1)
    if is_there and not where.is_dir():
        _refuse(f"state_dir {where} is a file, not the folder `up` records what it started in")
    named = ("--state-dir" if state_dir is not None
             else "WARMPATH_STATE_DIR" if os.environ.get("WARMPATH_STATE_DIR") else None)
    if named and not is_there:
        # A mistyped folder read as "nothing to stop" told a script the cluster was down.
        _refuse(f"{named} {where} does not exist: pass the folder `up` used (nothing was stopped)")
    try:
        with _state_dir_held(cfg) if is_there else contextlib.nullcontext():
            is_stopped = local.down(cfg, progress)
    except local.BringUpError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1)
    except OSError as err:  # its record could not be rewritten (a full disk): what it stopped is said above
        typer.echo(f"error: cannot update {err.filename or where} ({err.strerror or err}); run `warmpath down` "
                   "again once it can be written", err=True)
        raise typer.Exit(1)
    if not is_stopped:
        raise typer.Exit(1)


@app.command()
def status(config: Optional[Path] = ConfigOpt, state_dir: Optional[str] = StateDirOpt) -> None:
    """Show the application, its deployments and their replicas; exit 1 unless both apps run and Redis answers."""
    from cluster import local

    cfg = _load(config, state_dir=state_dir)
    state = _load_state(cfg)
    is_recorded = not state.is_empty()
    if not is_recorded:
        typer.echo(f"note: {_where_state_is(cfg)}; what follows is whatever runs at {state.dashboard_url}", err=True)
    elif state.ray_started and state.ray_session and local.head_session() not in (None, state.ray_session) \
            and not local.session_processes(state.ray_session):
        # Gone, the head this state directory started left its record: what answers is another's cluster.
        typer.echo(f"note: the Ray head this state directory started (session {state.ray_session}) is gone; what "
                   f"follows is whatever runs at {state.dashboard_url} (session {local.head_session()})", err=True)
        is_recorded = False
    cfg = local.recorded_config(cfg, state, lambda message: typer.echo(f"note: {message}", err=True))
    try:
        details = local.serve_details(state)
    except Exception as err:
        typer.echo(f"not running ({err.__class__.__name__}: {err})", err=True)
        raise typer.Exit(1)
    from cluster.serve_config import grpc_app_name

    statuses = {}
    for name in (cfg.app_name, grpc_app_name(cfg)):
        statuses[name], lines = local.summarize(details, name)
        typer.echo(f"application {name}: {statuses[name]}")
        for line in lines:
            typer.echo(f"  {line}")
    app_status = statuses[cfg.app_name]
    if state.http_url:
        typer.echo(f"http: {state.http_url}/v1")
    if state.grpc_address:
        typer.echo(f"grpc: {state.grpc_address}")
    redis_problem = _redis_problem(state.redis_url) if state.redis_url else None
    if state.redis_url:
        answer = f"not answering ({redis_problem})" if redis_problem else "answering"
        typer.echo(f"redis: {local.without_password(state.redis_url)} ({answer})")
    if state.http_url and app_status == "RUNNING":
        _echo_router_status(cfg, state.http_url)
    if any(s != "RUNNING" for s in statuses.values()) or redis_problem or not is_recorded:
        # Scripts and probes read the exit status: 0 only when everything serves, and it is the cluster this
        # state directory records (not another checkout's, or the tests', on the same ports).
        raise typer.Exit(1)


def _redis_problem(url: str) -> Optional[str]:
    """Why the Redis at `url` does not answer PING within 2 s, or None when it does."""
    import redis

    try:
        with redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2) as client:
            client.ping()
    except redis.RedisError as err:
        return err.__class__.__name__
    return None


def _echo_router_status(cfg, http_url: str) -> None:
    """The ingress's routers and their KV-event streams (`GET /v1/router`)."""
    import httpx

    from cluster import local
    from cluster.api_keys import bearer_headers
    from cluster.router_status import router_status_lines

    try:
        resp = httpx.get(f"{http_url}/v1/router", headers=bearer_headers(local.local_api_key(cfg)), timeout=10)
        resp.raise_for_status()
        lines = router_status_lines(resp.json())
    except Exception as err:  # status must still print what it has
        lines = [f"routing: unavailable ({err.__class__.__name__}: {err})"]
    for line in lines:
        typer.echo(line)


@render_app.command("serve-config")
def render_serve_config_cmd(
    config: Optional[Path] = ConfigOpt,
    out: Optional[Path] = typer.Option(None, help="Write here instead of stdout."),
    redis_url: Optional[str] = typer.Option(
        None, help="The session store the deployment uses (default: the config's redis_url, or REDIS_URL)."
    ),
) -> None:
    """Render the Ray Serve config file (`serve deploy`-able)."""
    from cluster.serve_config import dump_serve_config

    _check_redis_url_flag(redis_url)
    cfg = _load(config, redis_url=redis_url)
    if out is not None:
        _check_writable_file(out)
    text = dump_serve_config(cfg)
    if not cfg.redis_url:  # `up` fills in the Redis it starts; a file deployed elsewhere has none
        typer.echo("note: the file has no redis_url: pass --redis-url, or set REDIS_URL in the Ray workers' "
                   "environment, before `serve deploy` of it", err=True)
    source = cfg.model_source()
    if source.startswith("/") and not Path(source).exists():  # `up` builds the default model; this file does not
        typer.echo(f"note: model.source {source} is not on this machine (`warmpath build-model` builds the default "
                   "model there); every node that serves the file needs the model at that path", err=True)
    _warn_replica_args(cfg)
    if out is None:
        sys.stdout.write(text)
    else:
        from cluster.local import write_private
        from cluster.writable import replace_file

        # Owner-only, as `up` keeps its own copy: the config holds redis_url, its password included. Replaced
        # whole: cut short (a full disk), a file that still parses as YAML could be deployed.
        _write_or_exit(out, lambda path: replace_file(path, lambda target: write_private(target, text)))


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
            _warn_replica_args(k8s_render.load_overlay_config(o), f"{o}: ")
            changed = k8s_render.write_k8s(o)
            typer.echo(f"{o}: " + (", ".join(str(p) for p in changed) if changed else "unchanged"))
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2)
    except OSError as err:  # a generated path that is a folder, a read-only checkout: one line, not a traceback
        typer.echo(f"error: {err.strerror or err}: {err.filename or ''}".rstrip(": "), err=True)
        raise typer.Exit(1)


def _warn_replica_args(cfg: ClusterConfig, where: str = "") -> None:
    """What this machine's vLLM would refuse of the replicas' arguments, said on stderr: the file deploys
    elsewhere, maybe with another vLLM (`up` refuses them)."""
    from cluster.replica_args import replica_args_problems

    for problem in replica_args_problems(cfg):
        typer.echo(f"warning: {where}{problem}", err=True)


def _check_bench_flags(time_scale: float, sessions: Optional[int], rounds: int = 1) -> None:
    """Exits 2 with one line on a time scale, session count or round count no run can use.

    Why: 0 or a negative scale crashed in the run, and NaN or infinity would make
    every session wait forever (asyncio.sleep(nan)) after writing `NaN` JSON.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        _refuse(f"--time-scale must be a finite number > 0, got {time_scale}")
    if sessions is not None and not 1 <= sessions <= MAX_SESSIONS:
        _refuse(f"--sessions must be between 1 and {MAX_SESSIONS:,}, got {sessions}")
    if rounds < 1:
        _refuse(f"--rounds must be >= 1, got {rounds}")


@app.command()
def bench(
    config: Optional[Path] = ConfigOpt,
    workload: str = typer.Option("shared-tools", help="shared-tools, coding, fanout, or all."),
    policies: str = PoliciesOpt,
    seed: int = typer.Option(0, help="Workload seed."),
    sessions: Optional[int] = typer.Option(
        None, help="Sessions per workload (default: the workload's CPU size; at GPU sizes, 5 minutes of arrivals)."
    ),
    time_scale: float = typer.Option(1.0, help="Multiplies session arrival times and tool latencies."),
    out: Path = typer.Option(Path("bench/results"), help="Folder for bench-<workload>.json and .png."),
    rounds: int = typer.Option(
        1, help="Run the policy list this many times, rotated each round; report each policy's ratio to pow2 "
                "within a round (median and range)."
    ),
    scale: Optional[str] = typer.Option(
        None, help="Workload sizes: cpu (2 CPU replicas of the small model serve it in minutes) or gpu (the "
                   "full per-step sizes, 5 minutes of session arrivals). Default: the config's replicas.accelerator."
    ),
) -> None:
    """Run agent workloads on the local cluster once per routing policy (redeploying between policies).

    A policy that fails is marked in the table and the JSON and the others run (exit 1);
    Ctrl-C writes the policies that finished (exit 130).
    The JSON is rewritten as each policy (and each round) finishes, "in_progress": true until the end.
    """
    from bench import live
    from cluster import local

    cfg = _load(config)
    names, chosen = _workloads_and_policies(workload, policies)
    _check_bench_flags(time_scale, sessions, rounds)
    scale = scale.strip().lower() if scale is not None else cfg.replicas.accelerator
    if scale not in ("cpu", "gpu"):
        _refuse(f"--scale must be cpu or gpu, got {scale}")
    _check_writable_dir(out, [f"bench-{name}.{ext}" for name in names for ext in ("json", "png")])
    try:  # every workload rendered and checked against the window before any cluster work
        prepared = {name: live.prepare_workload(cfg, name, seed, sessions, progress, scale=scale) for name in names}
    except live.WorkloadTooLong as err:
        _refuse(f"error: {err}")
    except local.BringUpError as err:  # no model, or its tokenizer out of reach
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1)
    failed: list[str] = []
    for name in names:
        try:
            result = live.run_bench(cfg, name, chosen, seed, sessions, time_scale, progress, rounds=rounds,
                                    checkpoint=_in_progress_writer(out / f"bench-{name}.json", "policies"),
                                    scale=scale, prepared_workload=prepared.pop(name))
        except live.BenchInterrupted as stop:
            _write_bench(out, name, stop.result)
            # Stopped mid-run, the cluster routes with whichever policy the bench deployed last.
            typer.echo(f"the cluster may still route with another policy than router.policy={cfg.router.policy}: "
                       "`warmpath up --redeploy` deploys it as configured", err=True)
            _stop_interrupted()
        except KeyboardInterrupt:
            _stop_interrupted()
        except local.BringUpError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1)
        _write_bench(out, name, result)
        failed += [f"{name} {failure}" for failure in live.failures(result)]
    _exit_if_failed(failed)


def _write_bench(out: Path, name: str, result: dict) -> None:
    """Prints one workload's report, then writes its JSON and PNG (nothing when no policy finished)."""
    from bench import report

    typer.echo(report.live_report(result))  # before writing: a failed write still shows the results
    if not result["policies"]:
        return  # interrupted before the first policy finished: keep any earlier file
    json_path = out / f"bench-{name}.json"
    _write_or_exit(json_path, lambda path: report.write_json(path, result))
    try:
        _write_or_exit(out / f"bench-{name}.png", lambda path: report.plot_live(result, path))
    except ImportError:
        progress("matplotlib is not installed (pip install -e '.[bench]'): no plot")
    typer.echo(f"wrote {json_path}")


def _stop_interrupted() -> NoReturn:
    """Ctrl-C: what finished is written by now; one line, exit 130 (the shell's code for SIGINT)."""
    typer.echo("interrupted: stopped after the runs reported above", err=True)
    raise typer.Exit(130)


def _exit_if_failed(failed: list[str]) -> None:
    """Exit 1 with one line naming the failed runs (their rows are marked above), after everything was written."""
    if failed:
        typer.echo(f"error: {len(failed)} failed: " + "; ".join(failed), err=True)
        raise typer.Exit(1)


@app.command()
def chaos(
    config: Optional[Path] = ConfigOpt,
    scenario: list[str] = typer.Option([], "--scenario", "-s", help="Scenario to run (repeat; default: all)."),
    out: Path = typer.Option(Path("chaos.json"), help="Where to write the results as JSON."),
) -> None:
    """Break parts of the running local cluster (replica, orchestrator, Redis, tools, clients) and count lost turns."""
    from bench import chaos as chaos_mod
    from cluster import local

    cfg = _load(config)
    unknown = [s for s in scenario if s not in chaos_mod.SCENARIOS]
    if unknown:
        typer.echo(f"unknown scenario {', '.join(unknown)}; choose from {', '.join(chaos_mod.SCENARIOS)}", err=True)
        raise typer.Exit(2)
    _check_writable_file(out)
    state = _load_state(cfg)
    if not state.http_url:
        typer.echo("the local cluster is not up: run `warmpath up` first", err=True)
        raise typer.Exit(1)
    try:
        api_key = local.local_api_key(cfg)
    except OSError as err:
        typer.echo(f"error: cannot read the API key `warmpath up` wrote ({err.strerror or err}): {local.api_key_file(cfg)}", err=True)
        raise typer.Exit(1)
    from bench.report import write_json

    def write(results: list) -> None:  # after each scenario: one that hangs or is interrupted keeps the others'
        _write_or_exit(out, lambda path: write_json(path, {"kind": "warmpath-chaos",
                                                          "results": [r.to_json() for r in results]}))

    results = chaos_mod.run_chaos(cfg, state.http_url, api_key, scenario or list(chaos_mod.SCENARIOS), progress,
                                  on_result=write)
    typer.echo(chaos_mod.report(results))
    typer.echo(f"wrote {out}")
    if any(r.num_lost or r.broken_promises for r in results):
        raise typer.Exit(1)


def _workloads_and_policies(workload: str, policies: str) -> tuple[list[str], list[str]]:
    """The workload names (`all` expanded) and comma-separated policies of `bench` and `simulate`; exit 2 on a bad one."""
    from bench.workloads import WORKLOAD_NAMES

    names = list(WORKLOAD_NAMES) if workload == "all" else [workload]
    # A policy named twice runs once: a second run would only overwrite the first in the results.
    chosen = list(dict.fromkeys(p.strip() for p in policies.split(",") if p.strip()))
    known_policies = get_args(RouterPolicy)
    problems = []
    if bad_workloads := [n for n in names if n not in WORKLOAD_NAMES]:
        problems.append(f"unknown workload {', '.join(bad_workloads)} (choose {', '.join(WORKLOAD_NAMES)} or all)")
    if bad_policies := [p for p in chosen if p not in known_policies]:
        problems.append(f"unknown policy {', '.join(bad_policies)} (choose from {', '.join(known_policies)})")
    if not chosen:
        problems.append(f"no policy given (choose from {', '.join(known_policies)})")
    if problems:
        typer.echo("; ".join(problems), err=True)
        raise typer.Exit(2)
    return names, chosen


# `simulate --replicas` above this is refused: the replicas' state is allocated up front, so
# a mistyped count ended in a MemoryError (or an OverflowError) after the flags were taken.
MAX_SIM_REPLICAS = 4096
# `--sessions` above this is refused (`simulate` and `bench`): the workload is generated up front, so a
# mistyped count grew until memory ran out (10,000 coding sessions already take several GB).
MAX_SESSIONS = 1_000_000


def _replica_counts(replicas: list[int]) -> list[int]:
    """The distinct `--replicas` counts in order; exits 2 with one line on one out of 1..MAX_SIM_REPLICAS."""
    if bad := [n for n in replicas if not 1 <= n <= MAX_SIM_REPLICAS]:
        _refuse(f"--replicas must be between 1 and {MAX_SIM_REPLICAS}, got {bad[0]}")
    return list(dict.fromkeys(replicas))  # a count given twice runs once


@app.command()
def simulate(
    workload: str = typer.Option("all", help="shared-tools, coding, fanout, or all."),
    replicas: list[int] = typer.Option(
        [16], "--replicas", help=f"Replica count, 1 to {MAX_SIM_REPLICAS} (repeatable)."
    ),
    sessions: int = typer.Option(100, help="Sessions per workload."),
    seed: int = typer.Option(0, help="Workload and router seed."),
    policies: str = PoliciesOpt,
    out: Path = typer.Option(Path("bench/results/simulate.json"), help="JSON output file."),
    jobs: int = typer.Option(
        0, help=f"Simulations run at once, one process each (0: one per CPU core, at most {MAX_DEFAULT_JOBS})."
    ),
) -> None:
    """Simulate routing policies at scale with the production router code (GPU cost profile).

    A cell that fails is marked in the table and the JSON and the others run (exit 1);
    Ctrl-C writes the cells that finished (exit 130).
    The JSON is rewritten as each cell finishes ("in_progress": true until the grid ends).
    """
    from bench import report, sim_cost, simulator

    names, chosen = _workloads_and_policies(workload, policies)
    if not 1 <= sessions <= MAX_SESSIONS:
        _refuse(f"--sessions must be between 1 and {MAX_SESSIONS:,}, got {sessions}")
    if jobs < 0:
        _refuse(f"--jobs must be >= 0 (0: one per CPU core), got {jobs}")
    counts = _replica_counts(replicas)
    _check_writable_file(out)
    if not jobs:
        jobs = min(simulator.available_cores(), MAX_DEFAULT_JOBS)

    def document_of(runs: list) -> dict:
        return {"kind": "warmpath-simulate", "profile": sim_cost.GPU_PROFILE.__dict__, "seed": seed,
                "runs": [run.to_json() for run in runs]}

    keep = _in_progress_writer(out, "cells")
    interrupted = False
    try:
        runs = simulator.run_grid(names, counts, sessions, seed=seed, policies=chosen, progress=progress, jobs=jobs,
                                  checkpoint=lambda finished: keep(document_of(finished)))
    except simulator.GridInterrupted as stop:
        runs, interrupted = stop.runs, True
    document = document_of(runs)
    if interrupted:
        document["interrupted"] = True
    typer.echo(report.simulation_report(document["runs"]))  # before writing: a failed write still shows the results
    if runs:  # interrupted before the first cell finished: keep any earlier file
        _write_or_exit(out, lambda path: report.write_json(path, document))
        typer.echo(f"wrote {out}")
    if interrupted:
        _stop_interrupted()
    _exit_if_failed([f"{r.workload} x{r.num_replicas} {r.policy}: {r.error}" for r in runs if r.error])


if __name__ == "__main__":
    app()
