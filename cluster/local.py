"""Local bring-up: Redis, a Ray head, and the Serve application, started in order.

Why a module of its own: `warmpath up/down/status` and the integration tests
start the same cluster the same way. What this process starts is recorded in
`<state_dir>/local.json`, so `down` stops exactly that and nothing the user
started themselves (a Ray cluster from `RAY_ADDRESS`, a Redis from `REDIS_URL`).

Ordering: model -> Redis -> Ray head -> `serve deploy` of the rendered config
-> wait until every replica is RUNNING. Each step reports through `progress`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Optional

from cluster.config import ClusterConfig
from cluster.model_builder import build_model, is_built
from cluster.serve_config import render_serve_config

Progress = Callable[[str], None]
DASHBOARD_PORT = 8265


class BringUpError(RuntimeError):
    """A step of the local bring-up failed; the message says which and why."""


@dataclass
class LocalState:
    """What `up` started, so `down` stops only that."""

    redis_pid: Optional[int] = None
    redis_url: Optional[str] = None
    ray_started: bool = False
    ray_address: Optional[str] = None
    dashboard_url: str = f"http://127.0.0.1:{DASHBOARD_PORT}"
    http_url: Optional[str] = None

    @staticmethod
    def path(state_dir: Path) -> Path:
        return state_dir / "local.json"

    @classmethod
    def load(cls, state_dir: Path) -> "LocalState":
        file = cls.path(state_dir)
        if not file.is_file():
            return cls()
        try:
            recorded = json.loads(file.read_text())
        except ValueError as err:
            raise BringUpError(
                f"{file} is not valid JSON ({err}); stop what it recorded by hand (redis-server, `ray stop`) "
                "and delete it"
            ) from None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in recorded.items() if k in known})

    def save(self, state_dir: Path) -> None:
        """Writes the state whole or not at all (a temporary file renamed over the old one)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        target = self.path(state_dir)
        partial = target.with_suffix(".json.tmp")
        partial.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(partial, target)

    def is_empty(self) -> bool:
        """Nothing recorded as started."""
        return self.redis_pid is None and not self.ray_started and self.ray_address is None


def _bin(name: str) -> str:
    """Executable next to this interpreter (the venv's `ray`), else from PATH."""
    local = Path(sys.executable).with_name(name)
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise BringUpError(f"`{name}` not found next to {sys.executable} or on PATH")
    return found


def state_dir_of(cfg: ClusterConfig) -> Path:
    return Path(cfg.state_dir).expanduser().resolve()


def ensure_model(cfg: ClusterConfig, progress: Progress) -> None:
    """Builds the default model when the config points at it and it is missing."""
    if cfg.model.source:
        return
    out = Path(cfg.model_source())
    if is_built(out):
        progress(f"model: {out} (already built)")
        return
    progress(f"model: building {cfg.model.model_id} into {out}")
    build_model(out, progress=lambda msg: progress(f"  {msg}"))


def _redis_ping(url: str, timeout_s: float) -> bool:
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if redis.Redis.from_url(url, socket_timeout=1).ping():
                return True
        except redis.exceptions.RedisError:
            time.sleep(0.1)
    return False


def _kill(proc: subprocess.Popen) -> None:
    """Kills a child and reaps it (no zombie left to the caller's process)."""
    proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _redis_pid(url: str) -> Optional[int]:
    """The process id of the Redis answering at `url` (its `INFO server`), or None."""
    import redis

    try:
        return int(redis.Redis.from_url(url, socket_timeout=2).info("server")["process_id"])
    except (redis.exceptions.RedisError, KeyError, ValueError):
        return None


def start_redis(cfg: ClusterConfig, state: LocalState, progress: Progress) -> str:
    """Uses `cfg.redis_url`, else starts redis-server with AOF persistence in the state dir."""
    if cfg.redis_url:
        progress(f"redis: using {cfg.redis_url}")
        if not _redis_ping(cfg.redis_url, 5):
            raise BringUpError(f"redis at {cfg.redis_url} does not answer PING")
        return cfg.redis_url
    port = cfg.ports.local_redis_port
    url = f"redis://127.0.0.1:{port}/0"
    if state.redis_pid and _is_redis_process(state.redis_pid) and _redis_ping(url, 2):
        progress(f"redis: already running at {url} (pid {state.redis_pid})")
        return url
    server = shutil.which("redis-server")
    if server is None:
        raise BringUpError("redis-server is not installed (apt-get install redis-server) and REDIS_URL is not set")
    data_dir = state_dir_of(cfg) / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    progress(f"redis: starting redis-server on port {port} (AOF in {data_dir})")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
         "--appendonly", "yes", "--appendfsync", "everysec", "--save", "60 1",
         "--logfile", str(data_dir / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        is_answering = _redis_ping(url, 10)
    except BaseException:  # Ctrl-C while waiting: stop what was started, leave nothing behind
        _kill(proc)
        raise
    if is_answering and _redis_pid(url) != proc.pid:  # the port answered, but not our server: it could not bind
        _kill(proc)
        raise BringUpError(
            f"port {port} is in use by another process (a Redis this state directory did not start); "
            f"stop it or set ports.local_redis_port (see {data_dir / 'redis.log'})"
        )
    if not is_answering:
        _kill(proc)
        raise BringUpError(f"redis-server did not answer on {url}; see {data_dir / 'redis.log'}")
    state.redis_pid, state.redis_url = proc.pid, url
    return url


def start_ray(cfg: ClusterConfig, state: LocalState, progress: Progress) -> str:
    """Joins `RAY_ADDRESS` if set, else starts a local Ray head with enough logical CPUs.

    A local head that this state directory did not start is refused, not joined: deploying would
    replace the application serving there (another `warmpath up`, the integration tests' cluster)
    and `down` would delete it. `RAY_ADDRESS=auto` joins it deliberately.
    """
    address = os.environ.get("RAY_ADDRESS")
    if address:
        progress(f"ray: joining {address}")
        state.ray_address = address
        return address
    if _ray_head_up():
        if not state.ray_started:
            raise BringUpError(
                "a Ray head is already running on this machine and was not started from this state directory "
                f"({state_dir_of(cfg)}): another `warmpath up` (or the integration tests' cluster) may be serving "
                "there, and deploying would replace its application. Stop it (`warmpath down` with its config, or "
                "`ray stop`), or set RAY_ADDRESS=auto to deploy into it anyway."
            )
        progress("ray: the local head this state directory started is running; using it")
        state.ray_address = "auto"
        return "auto"
    # Logical CPUs: one bundle per replica plus room for the ingress and proxies.
    num_cpus = int(cfg.replicas.num_replicas * cfg.replicas.num_cpus) + 4
    progress(f"ray: starting a local head ({num_cpus} logical CPUs)")
    cmd = [
        _bin("ray"), "start", "--head", f"--num-cpus={num_cpus}", "--disable-usage-stats",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={DASHBOARD_PORT}",
        "--object-store-memory=500000000", f"--metrics-export-port={cfg.ports.metrics_export_port}",
    ]
    if cfg.replicas.accelerator == "cpu":
        cmd.append("--num-gpus=0")
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except BaseException:  # Ctrl-C while the head starts: recorded, so `down` stops whatever came up
        state.ray_started, state.ray_address = True, "auto"
        state.save(state_dir_of(cfg))
        raise
    if result.returncode != 0:
        raise BringUpError(f"`ray start --head` failed:\n{result.stdout}\n{result.stderr}")
    state.ray_started, state.ray_address = True, "auto"
    return "auto"


def _ray_head_up() -> bool:
    result = subprocess.run([_bin("ray"), "status"], capture_output=True, text=True)
    return result.returncode == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _is_redis_process(pid: int) -> bool:
    """Whether `pid` is alive and a redis-server: after a reboot a recorded pid can name anything."""
    if not _alive(pid):
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc to ask (not Linux): the pid alone
    return b"redis-server" in command


def _serve_client(state: LocalState):
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    return ServeSubmissionClient(state.dashboard_url)


def deploy(cfg: ClusterConfig, state: LocalState, progress: Progress) -> None:
    """Deploys the rendered Serve config through the dashboard, like `serve deploy`."""
    doc = render_serve_config(cfg)
    out = state_dir_of(cfg) / "serve_config.yaml"
    import yaml

    out.write_text(yaml.safe_dump(doc, sort_keys=True))
    progress(f"serve: deploying {out}")
    deploy_document(state, doc)


def deploy_document(state: LocalState, doc: dict) -> None:
    """`serve deploy` of a Serve config document through the dashboard."""
    _when_dashboard_ready(lambda: _serve_client(state).deploy_applications(doc), "serve deploy")


def _when_dashboard_ready(call: Callable[[], object], what: str, timeout_s: float = 60) -> None:
    """Runs `call`, retrying while a just-started dashboard refuses requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            call()
            return
        except Exception as err:
            if time.monotonic() > deadline:
                raise BringUpError(f"{what} failed: {err}") from None
            time.sleep(1)


def serve_details(state: LocalState) -> dict:
    return _serve_client(state).get_serve_details()


def summarize(details: dict, app_name: str) -> tuple[str, list[str]]:
    """Application status and one line per deployment with replica states."""
    app = details.get("applications", {}).get(app_name)
    if app is None:
        return "NOT_DEPLOYED", []
    lines = []
    for name, dep in sorted(app.get("deployments", {}).items()):
        states: dict[str, int] = {}
        for replica in dep.get("replicas", []):
            states[replica["state"]] = states.get(replica["state"], 0) + 1
        counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "no replicas"
        lines.append(f"{name}: {dep['status']} ({counts})")
        if dep.get("message") and dep["status"] not in ("HEALTHY",):
            lines.append(f"  {dep['message'].strip().splitlines()[-1][:300]}")
    if app["status"] == "DEPLOY_FAILED" and app.get("message"):
        lines += [f"  {line}" for line in app["message"].strip().splitlines()[-12:]]
    return app["status"], lines


def wait_running(cfg: ClusterConfig, state: LocalState, progress: Progress, timeout_s: float) -> None:
    """Polls the Serve status until every application runs, one fails, or `timeout_s` passes."""
    start = time.monotonic()
    last = None
    while True:
        details = serve_details(state)
        status, lines = summarize(details, cfg.app_name)
        for name in sorted(details.get("applications", {})):
            if name != cfg.app_name:
                other_status, other_lines = summarize(details, name)
                lines += other_lines
                status = other_status if status == "RUNNING" else status
        line = f"serve: {status}; " + "; ".join(l for l in lines if not l.startswith("  "))
        if line != last:
            progress(f"[{time.monotonic() - start:5.0f}s] {line}")
            last = line
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":
            raise BringUpError("the Serve application failed to deploy:\n" + "\n".join(lines))
        if time.monotonic() - start > timeout_s:
            raise BringUpError(f"not running after {timeout_s:.0f}s:\n" + "\n".join(lines))
        time.sleep(2)


def delete_app(state: LocalState, progress: Progress, timeout_s: float = 120) -> None:
    """Deletes the Serve applications and waits until they are gone (code changes need a fresh app)."""
    client = _serve_client(state)
    client.delete_applications()
    deadline = time.monotonic() + timeout_s
    while client.get_serve_details().get("applications"):
        if time.monotonic() > deadline:
            raise BringUpError(f"applications still shutting down after {timeout_s:.0f}s")
        time.sleep(1)
    progress("serve: previous applications deleted")


def up(cfg: ClusterConfig, progress: Progress, timeout_s: float = 900, redeploy: bool = False) -> LocalState:
    """Starts everything `cfg` needs and returns what was started.

    Serve redeploys only when the rendered config changes; `redeploy` deletes the
    running application first so new code is picked up with the same config.
    """
    state_dir = state_dir_of(cfg)
    state = LocalState.load(state_dir)
    ensure_model(cfg, progress)
    redis_url = start_redis(cfg, state, progress)
    state.save(state_dir)
    if cfg.redis_url is None:
        cfg = cfg.model_copy(update={"redis_url": redis_url})
    if cfg.access.is_auth_enabled:
        ensure_local_api_key(cfg, redis_url, progress)
    else:
        progress("API keys are off (access.is_auth_enabled=false): anyone who reaches the ports can call")
    start_ray(cfg, state, progress)
    state.save(state_dir)
    if redeploy:
        _when_dashboard_ready(lambda: delete_app(state, progress), "deleting the running application")
    deploy(cfg, state, progress)
    wait_running(cfg, state, progress, timeout_s)
    state.http_url = f"http://127.0.0.1:{cfg.ports.http_port}"
    state.save(state_dir)
    return state


# The operator's own key is not what rate limits protect against; keys made with `warmpath keys create` are.
ADMIN_REQUESTS_PER_S = 1000.0
ADMIN_BURST = 2000


def api_key_file(cfg: ClusterConfig) -> Path:
    return state_dir_of(cfg) / "api-key"


def local_api_key(cfg: ClusterConfig) -> Optional[str]:
    """The admin key `warmpath up` keeps in the state directory, when keys are on."""
    return api_key_file(cfg).read_text().strip() if cfg.access.is_auth_enabled else None


def ensure_local_api_key(cfg: ClusterConfig, redis_url: str, progress: Progress) -> str:
    """The local admin key (all permissions): kept in `<state_dir>/api-key` (mode 0600), registered in Redis.

    Reused across `up`s; registered again if Redis lost it (a new Redis, a flushed one).
    """
    from cluster.api_keys import ALL_PERMISSIONS, run_with_store

    file = api_key_file(cfg)
    existing = file.read_text().strip() if file.is_file() else None

    async def register(store) -> str:
        if existing and await store.lookup(existing) is not None:
            return existing
        key, record = await store.create(
            "local-admin", [ALL_PERMISSIONS], ADMIN_REQUESTS_PER_S, ADMIN_BURST, key=existing,
        )
        progress(f"api key: {'registered' if existing else 'created'} {record.key_id} (all permissions) in {file}")
        return key

    key = run_with_store(redis_url, register)
    if existing != key:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.touch(mode=0o600)
        file.write_text(key + "\n")
    return key


def stop_redis(state: LocalState, progress: Progress, timeout_s: float = 10) -> bool:
    """Stops the redis-server `up` started, waiting up to `timeout_s` for it to exit (it writes its AOF first).

    Returns:
        False when it is still running (it is then left to the operator, and stays recorded).
    """
    if not state.redis_pid:
        return True
    if not _is_redis_process(state.redis_pid):
        progress(f"redis: pid {state.redis_pid} is no longer the redis-server `up` started; nothing to stop")
        return True
    os.kill(state.redis_pid, signal.SIGTERM)  # redis flushes its AOF on SIGTERM
    deadline = time.monotonic() + timeout_s
    while _alive(state.redis_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(state.redis_pid):
        progress(f"redis: pid {state.redis_pid} still running {timeout_s:.0f} s after SIGTERM; stop it by hand")
        return False
    progress(f"redis: stopped (pid {state.redis_pid})")
    return True


def reap_orphaned_engines() -> list[int]:
    """Kills vLLM engine processes whose replica is gone (re-parented to init).

    Why: vLLM's engine core and worker processes outlive a replica actor that
    is killed hard (`ray stop --force`, a crashed or killed replica), each
    keeping its model and KV cache in memory. Once the head `up` started is
    stopped, such orphans serve no one.
    """
    reaped = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == 1 and name in (b"VLLM::EngineCore", b"VLLM::Worker"):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                reaped.append(int(entry.name))
            except OSError:
                pass
    return reaped


def down(cfg: ClusterConfig, progress: Progress) -> None:
    """Stops the Serve app, and the Ray head and Redis if `up` started them."""
    state_dir = state_dir_of(cfg)
    state = LocalState.load(state_dir)
    if state.is_empty():
        progress(f"nothing to stop: {LocalState.path(state_dir)} records nothing started")
        return
    if state.ray_address and _ray_head_up():
        try:
            _serve_client(state).delete_applications()
            progress("serve: applications deleted")
        except Exception as err:
            progress(f"serve: could not delete applications ({err})")
    if state.ray_started:
        subprocess.run([_bin("ray"), "stop", "--force"], capture_output=True)
        progress("ray: head stopped")
        reaped = reap_orphaned_engines()
        if reaped:
            progress(f"vllm: stopped {len(reaped)} engine processes left behind by their replicas")
    is_redis_stopped = stop_redis(state, progress)
    LocalState(redis_pid=None if is_redis_stopped else state.redis_pid).save(state_dir)
