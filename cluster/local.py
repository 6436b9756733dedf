"""Local bring-up: Redis, a Ray head, and the Serve application, started in order.

Why a module of its own: `warmpath up/down/status` and the integration tests
start the same cluster the same way. What this process starts is recorded in
`<state_dir>/local.json`, so `down` stops exactly that and nothing the user
started themselves (a Ray cluster from `RAY_ADDRESS`, a Redis from `REDIS_URL`).

Ordering: model -> Redis -> Ray head -> `serve deploy` of the rendered config
-> wait until every replica is RUNNING. Each step reports through `progress`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterator, Optional
from urllib.parse import urlsplit

from cluster.config import LOCAL_PATH_PREFIXES, ClusterConfig, without_password
from cluster.model_builder import build_model, is_built, is_rebuildable
from cluster.redis_pool import refuse_unsuitable_redis
from cluster.serve_config import (
    KV_EVENTS_IPC_DIR_ENV,
    SERVICE_NUM_CPUS,
    grpc_proxy_env,
    own_application_names,
    render_serve_config,
    with_other_applications,
    without_own_applications,
)

Progress = Callable[[str], None]
DASHBOARD_PORT = 8265
GCS_PORT = 6379  # `ray start --head`'s default, which a system redis-server also takes
# Longest one call to Ray's dashboard may take: a deploy returns once Serve has the config, but deleting
# the applications waits for Serve to shut down (replicas drain for up to 20 s each, in parallel).
DASHBOARD_CALL_TIMEOUT_S = 120.0
LOCAL_DASHBOARD_URL = f"http://127.0.0.1:{DASHBOARD_PORT}"
# `ray status` answers in a few seconds; a head that takes longer is not usable, and `up` must not hang on it.
RAY_STATUS_TIMEOUT_S = 60
RAY_START_TIMEOUT_S = 300
RAY_STOP_TIMEOUT_S = 120
# How long `up` waits for a redis-server it started earlier to answer (it loads its AOF first).
OWN_REDIS_ANSWER_TIMEOUT_S = 60
# How often a wait that sees no change says it is still waiting.
STILL_WAITING_EVERY_S = 30
# Of a Serve deployment message: Serve's "cannot be scheduled" line, with the resources asked for and
# available, runs to about 450 characters.
MESSAGE_CHARS = 600


class BringUpError(RuntimeError):
    """A step of the local bring-up failed; the message says which and why."""


@dataclass
class LocalState:
    """What `up` started, so `down` stops only that."""

    redis_pid: Optional[int] = None
    # The port of the redis-server `up` started (redis_pid), which names it among other Redis servers.
    redis_port: Optional[int] = None
    # The Redis the cluster uses: that server's, or the one `redis_url` gave.
    redis_url: Optional[str] = None
    ray_started: bool = False
    # The session folder of the head `up` started (`session_<date>_<pid>`): a head started later by
    # anyone else has another, so `down` never stops a head it did not start.
    ray_session: Optional[str] = None
    ray_address: Optional[str] = None
    dashboard_url: str = LOCAL_DASHBOARD_URL
    http_url: Optional[str] = None
    grpc_address: Optional[str] = None
    # The Serve application `up` deployed (`app_name`; its gRPC one is named after it): `down` and
    # `status` run without the config that named it still find it.
    app_name: Optional[str] = None

    @staticmethod
    def path(state_dir: Path) -> Path:
        return state_dir / "local.json"

    @classmethod
    def load(cls, state_dir: Path) -> "LocalState":
        file = cls.path(state_dir)
        try:
            if not file.is_file():
                return cls()
            text = file.read_text()
        except OSError as err:  # another user's (`sudo warmpath up` writes it 0600, root's; under umask 077, its folder)
            raise BringUpError(f"{file} cannot be read ({err.strerror}): run as the user that ran `warmpath up`, "
                               "or pass another --state-dir") from None
        try:
            recorded = json.loads(text)
        except ValueError as err:
            raise BringUpError(
                f"{file} is not valid JSON ({err}); stop what it recorded by hand (redis-server, `ray stop`) "
                "and delete it"
            ) from None
        if not isinstance(recorded, dict):
            raise BringUpError(
                f"{file} holds {type(recorded).__name__}, not a record of what `warmpath up` started; stop what it "
                "recorded by hand (redis-server, `ray stop`) and delete it"
            )
        state = cls()
        for field in fields(cls):
            value = recorded.get(field.name, getattr(state, field.name))
            if not _is_recorded_type(value, field.name):
                raise BringUpError(
                    f"{file}: {field.name} is {value!r}, which `warmpath up` never records; stop what it recorded "
                    "by hand (redis-server, `ray stop`) and delete it"
                )
            setattr(state, field.name, value)
        return state

    def save(self, state_dir: Path) -> None:
        """Writes the state whole or not at all (a temporary file renamed over the old one).

        Private to its owner (mode 0600): a recorded `redis_url` may hold the Redis password.
        """
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        replace_private(self.path(state_dir), json.dumps(asdict(self), indent=2) + "\n")

    def is_empty(self) -> bool:
        """Nothing recorded as started."""
        return self.redis_pid is None and not self.ray_started and self.ray_address is None


def _is_recorded_type(value: object, name: str) -> bool:
    """Whether `value` has the type `LocalState.<name>` is recorded with."""
    if name == "ray_started":
        return isinstance(value, bool)
    if name in ("redis_pid", "redis_port"):
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    if name == "dashboard_url":
        return isinstance(value, str)
    return value is None or isinstance(value, str)


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


def redis_dir_of(cfg: ClusterConfig) -> Path:
    """Where the redis-server `up` starts keeps its data and log, and works (its `--dir`)."""
    return state_dir_of(cfg) / "redis"


@contextlib.contextmanager
def state_dir_lock(cfg: ClusterConfig) -> Iterator[None]:
    """Holds the state directory for one `up` or `down`; refuses while another holds it.

    Why: two at once on one directory raced for its Redis and its record; the loser took the winner's Redis
    for another process's, and then named it as left running by itself.
    """
    where = state_dir_of(cfg)
    where.mkdir(parents=True, exist_ok=True, mode=0o700)  # made here first: it holds the sessions' Redis data
    with open(where / "lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BringUpError(f"another `warmpath up` or `warmpath down` is running on {where}: let it finish "
                               "first") from None
        yield


def ensure_model(cfg: ClusterConfig, progress: Progress) -> None:
    """Builds the default model when the config points at it and it is missing; refuses a local folder that
    is not there, when the replicas run on this machine (vLLM would fail in every replica, minutes later)."""
    if cfg.model.source:
        source, address = cfg.model.source, os.environ.get("RAY_ADDRESS")
        # Only paths that cannot be Hugging Face ids ("org/name"): a relative "org/name" may be either.
        is_path = source.startswith(LOCAL_PATH_PREFIXES)
        if is_path and not Path(cfg.model_source()).exists() and not (address and is_remote_address(address)):
            raise BringUpError(f"model.source {source}: no such file or folder on this machine")
        if not is_path and Path(source).exists():
            # The replicas run in Ray's workers, in another directory: there it is a Hugging Face id.
            progress(f"model: model.source {source!r} is read as a Hugging Face id, though a folder of that name is "
                     f"here: to serve the folder, write ./{source} (or its absolute path)")
        return
    out = Path(cfg.model_source())
    if is_built(out):
        progress(f"model: {out} (already built)")
        return
    if not is_rebuildable(out):  # as `warmpath build-model` refuses: a build there would overwrite someone's files
        raise BringUpError(f"{out} holds files no build of warmpath wrote, and model.source is empty: set "
                           "model.source to serve that folder, or empty it to have the default model built there")
    progress(f"model: building {cfg.model.model_id} into {out}")
    build_model(out, progress=lambda msg: progress(f"  {msg}"))


def _redis_ping(url: str, timeout_s: float) -> bool:
    """Whether Redis at `url` answers PING within `timeout_s`.

    Raises:
        BringUpError: Redis answered but refused (a wrong password, a database it lacks): waiting
            would not change that, and "does not answer" would send the operator the wrong way.
    """
    import redis

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if redis.Redis.from_url(url, socket_timeout=1).ping():
                return True
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError,
                redis.exceptions.ResponseError) as err:
            raise BringUpError(f"redis at {without_password(url)} refused PING: {err}") from None
        except redis.exceptions.RedisError:  # not listening yet, loading its data, or away
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
        progress(f"redis: using {without_password(cfg.redis_url)}")
        if not _redis_ping(cfg.redis_url, 5):
            raise BringUpError(f"redis at {without_password(cfg.redis_url)} does not answer PING")
        try:
            refuse_unsuitable_redis(cfg.redis_url)
        except ValueError as err:
            raise BringUpError(str(err)) from None
        state.redis_url = cfg.redis_url  # where `warmpath keys` and `status` find the cluster's store
        return cfg.redis_url
    port = cfg.ports.local_redis_port
    url = f"redis://127.0.0.1:{port}/0"
    if state.redis_pid and _is_redis_process(state.redis_pid, state.redis_port, redis_dir_of(cfg)):
        # Never a second server on the same data directory: both would write its AOF.
        if state.redis_port and state.redis_port != port:
            raise BringUpError(
                f"the redis-server this state directory started (pid {state.redis_pid}) listens on port "
                f"{state.redis_port}, not {port}: `warmpath down` first to move it to ports.local_redis_port {port}"
            )
        if not _redis_ping(url, OWN_REDIS_ANSWER_TIMEOUT_S):  # a big AOF loads for a while
            raise BringUpError(
                f"the redis-server this state directory started (pid {state.redis_pid}) does not answer on {url} "
                f"after {OWN_REDIS_ANSWER_TIMEOUT_S} s; see {redis_dir_of(cfg) / 'redis.log'}"
            )
        progress(f"redis: already running at {url} (pid {state.redis_pid})")
        state.redis_port, state.redis_url = port, url
        return url
    server = shutil.which("redis-server")
    if server is None:
        raise BringUpError("redis-server is not installed (apt-get install redis-server) and REDIS_URL is not set")
    if _bind_error("127.0.0.1", port) == errno.EADDRINUSE:  # else found only once redis-server gave up on it
        raise BringUpError(f"port {port} (ports.local_redis_port) is in use by another process; stop it or set "
                           "ports.local_redis_port")
    data_dir = redis_dir_of(cfg)
    data_dir.mkdir(parents=True, exist_ok=True)
    # Its AOF holds every transcript and the API keys' records (an admin key for whoever can write one): its
    # owner's only, whatever the state directory's mode.
    data_dir.chmod(0o700)
    progress(f"redis: starting redis-server on port {port} (AOF in {data_dir})")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
         # `always`: Redis fsyncs each write before replying, so an acknowledged turn survives a host crash.
         "--appendonly", "yes", "--appendfsync", "always", "--save", "60 1",
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
    state.redis_pid, state.redis_port, state.redis_url = proc.pid, port, url
    return url


def check_head_startable(cfg: ClusterConfig, state: LocalState, progress: Progress) -> bool:
    """Refuses what `start_ray` cannot start or join: another state directory's cluster recorded here,
    another process's Ray head on this machine, or the ports a new head and the proxies take held by
    another process. `up` asks first, before it builds the model, starts Redis and makes a key: asked
    only as the head started, it refused a bring-up that had done all that, and left Redis running.

    Returns:
        Whether the local head this state directory started is running (to be used again).
    """
    address = os.environ.get("RAY_ADDRESS")
    if (problem := _other_cluster_recorded(state, address)) is not None:
        raise BringUpError(problem)
    if address:
        if state.ray_started and _ray_head_up() and not is_started_head(state):
            # Kept, the record of a head that is gone made `up` delete every application of the head it joins,
            # and `down` leave warmpath's there.
            _forget_gone_head(state, progress)
        return False
    if not _ray_head_up():
        if (refused := privileged_ports(cfg)):
            raise BringUpError(f"{', '.join(refused)}: only root may listen on ports below 1024; set ports of 1024 "
                               "or above in the config (ports.*)")
        if (taken := ports_in_use(cfg)):
            if state.ray_started and state.ray_session and session_processes(state.ray_session):
                raise BringUpError(
                    f"{', '.join(taken)} in use: the Ray head this state directory started (session "
                    f"{state.ray_session}) does not answer but its processes still run; `warmpath down` stops "
                    "them, then `warmpath up` again"
                )
            raise BringUpError(_ports_taken(taken))
        return False
    if state.ray_started and not is_started_head(state):
        _forget_gone_head(state, progress)
    if not state.ray_started:
        raise BringUpError(_foreign_head(cfg))
    return True


def _forget_gone_head(state: LocalState, progress: Progress) -> None:
    """Forgets the recorded head where another runs in its place; refuses where the recorded one still runs."""
    if state.ray_session and session_processes(state.ray_session):
        raise BringUpError(
            f"the head this state directory started (session {state.ray_session}) runs beside another Ray head "
            f"started after it ({head_session()}), which Ray's tools now address: `warmpath down` stops ours "
            "(and leaves the other running), then `warmpath up` again"
        )
    progress(
        f"ray: the head this state directory started (session {state.ray_session}) is gone; "
        f"the one running now ({head_session()}) was started elsewhere"
    )
    state.ray_started, state.ray_session, state.ray_address = False, None, None


def _foreign_head(cfg: ClusterConfig) -> str:
    return ("a Ray head is already running on this machine and was not started from this state directory "
            f"({state_dir_of(cfg)}): another `warmpath up` (or the integration tests' cluster) may be serving "
            "there, and deploying would replace its application. Stop it (`warmpath down` with its config, or "
            "`ray stop`), or set RAY_ADDRESS=auto to deploy into it anyway.")


def _ports_taken(taken: list[str]) -> str:
    configurable = [port for port in taken if "(ports." in port]
    fix = "Stop that process" + (", or set other ports in the config (ports.*)" if configurable else "")
    if any(f"port {GCS_PORT} " in port for port in taken):
        # Not configurable: a system redis-server (the distribution's package starts one) holds it.
        fix += (f"; port {GCS_PORT} is Ray's own, often held by a system redis-server "
                "(sudo systemctl disable --now redis-server: warmpath starts the Redis it needs)")
    return f"{', '.join(taken)} in use by another process, and a new Ray head listens there. {fix}"


def start_ray(cfg: ClusterConfig, state: LocalState, progress: Progress) -> str:
    """Joins `RAY_ADDRESS` if set, else starts a local Ray head with enough logical CPUs.

    A local head that this state directory did not start is refused, not joined: deploying would
    replace the application serving there (another `warmpath up`, the integration tests' cluster)
    and `down` would delete it. `RAY_ADDRESS=auto` joins it deliberately; `down` then removes only
    warmpath's applications from it and leaves the head running.
    """
    address = os.environ.get("RAY_ADDRESS")
    is_own_head_up = check_head_startable(cfg, state, progress)  # asked again: the model build took a while
    if address:
        state.dashboard_url = dashboard_url_for(address)
        progress(f"ray: joining {address} (dashboard {state.dashboard_url})")
        state.ray_address = address
        return address
    state.dashboard_url = LOCAL_DASHBOARD_URL
    if is_own_head_up:
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
    if cfg.replicas.ray_resources:
        # One node holds every replica here, so it offers every replica's share.
        cmd.append("--resources=" + json.dumps(replicas_need(cfg, with_gpus=False)))
    # The head's workers inherit its environment: the replicas publish their KV events (every prompt's tokens)
    # on sockets in a folder of this user's only, which the router on this one machine reaches and no other
    # host or user does.
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **grpc_proxy_env(cfg), KV_EVENTS_IPC_DIR_ENV: str(kv_events_dir())})
    try:
        stdout, stderr = process.communicate(timeout=RAY_START_TIMEOUT_S)
    except BaseException as err:  # Ctrl-C or a hung start: recorded, so `down` stops whatever came up
        process.kill()
        process.wait()
        _record_started_head(cfg, state, process.pid)
        if isinstance(err, subprocess.TimeoutExpired):
            raise BringUpError(f"`ray start --head` did not finish in {RAY_START_TIMEOUT_S} s") from None
        raise
    if process.returncode != 0:
        # `ray start` leaves what it spawned running when it fails ("the node timed out during startup"):
        # a session of its own means it spawned a head, recorded so that `down` stops it.
        _record_started_head(cfg, state, process.pid)
        raise BringUpError(f"`ray start --head` failed:\n{stdout}\n{stderr}")
    state.ray_started, state.ray_address = True, "auto"
    state.ray_session = session_started_by(process.pid) or head_session()
    return "auto"


def _record_started_head(cfg: ClusterConfig, state: LocalState, pid: int) -> None:
    """Records the head the `ray start` of `pid` spawned, if it spawned one (saved at once: `up` is failing)."""
    if (session := session_started_by(pid)) is not None:
        state.ray_started, state.ray_address, state.ray_session = True, "auto", session
        state.save(state_dir_of(cfg))


def session_started_by(pid: int) -> Optional[str]:
    """The Ray session the `ray start --head` of process `pid` made, or None.

    Why by pid: Ray names a head's session `session_<date>_<pid of the process that started it>`, and
    `session_latest` names the newest of any: a failed or interrupted start recorded another `up`'s head,
    running at once from another state directory, and its `down` stopped that head.
    """
    sessions = _ray_temp_dir()
    try:
        return max((entry.name for entry in sessions.glob(f"session_*_{pid}") if entry.is_dir()), default=None)
    except OSError:
        return None


def _other_cluster_recorded(state: LocalState, address: Optional[str]) -> Optional[str]:
    """Why `up` must not deploy to `address` (None: a local head) from this state, or None.

    A state directory records one cluster: deploying to another would leave the first unrecorded
    (nothing would stop it), and `down` would treat the second as the first (deleting every
    application of a joined cluster, as it does on a head `up` started).
    """
    joins_local_head = address is None or _names_this_machine(address)
    if state.ray_started and not joins_local_head:
        return (
            f"this state directory records the local Ray head `warmpath up` started (session {state.ray_session}), "
            f"not the cluster at RAY_ADDRESS={address}: `warmpath down` first, or use another --state-dir"
        )
    if not state.ray_started and state.ray_address and state.ray_address != address:
        where = f"RAY_ADDRESS={address}" if address else "a local head"
        return (
            f"this state directory records warmpath deployed on the Ray cluster at {state.ray_address} (dashboard "
            f"{state.dashboard_url}), not {where}: `warmpath down` first (it removes warmpath's applications "
            "there), or use another --state-dir"
        )
    return None


def ports_in_use(cfg: ClusterConfig) -> list[str]:
    """The ports a new local head listens on (Serve's proxies, Ray's metrics, dashboard and GCS) that something holds.

    Why: a proxy that cannot bind leaves `up` waiting minutes for an endpoint, and a taken metrics port
    makes `ray start` fail with "the current node timed out during startup".
    """
    return [f"port {port} ({name})" for name, host, port in _head_ports(cfg) if _bind_error(host, port) == errno.EADDRINUSE]


def privileged_ports(cfg: ClusterConfig) -> list[str]:
    """The configured ports this user may not listen on (below 1024 without root): the proxy failed to bind,
    and `up` waited out its timeout for an endpoint."""
    return [f"{name} {port}" for name, host, port in _head_ports(cfg)
            if name.startswith("ports.") and _bind_error(host, port) == errno.EACCES]


def _head_ports(cfg: ClusterConfig) -> list[tuple[str, str, int]]:
    """(what, host, port) of every port a new local head listens on."""
    ports = cfg.ports
    return [("ports.http_port", ports.host, ports.http_port), ("ports.grpc_port", ports.host, ports.grpc_port),
            ("ports.metrics_export_port", "0.0.0.0", ports.metrics_export_port),
            ("Ray's dashboard", "127.0.0.1", DASHBOARD_PORT), ("Ray's GCS", "0.0.0.0", GCS_PORT)]


def _bind_error(host: str, port: int) -> int | None:
    """The errno binding (host, port) fails with now, or None; SO_REUSEADDR as servers set it, so TIME_WAIT is no bar.

    Callers ask for "address in use" and "permission denied": an address this machine lacks is for the
    server to report.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            return err.errno
    return None


def _ray_head_up() -> bool:
    """Whether `ray status` finds a head (the local one, or `RAY_ADDRESS`'s)."""
    if os.environ.get("RAY_ADDRESS") in (None, "", "auto", "local"):
        _use_machine_token()  # `ray status` itself does not, and fails on a head that requires the token
    try:
        result = subprocess.run([_bin("ray"), "status"], capture_output=True, text=True, timeout=RAY_STATUS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BringUpError(
            f"`ray status` did not answer in {RAY_STATUS_TIMEOUT_S} s: a Ray head on this machine is not "
            "responding; stop it (`ray stop --force`) and try again"
        ) from None
    return result.returncode == 0


def _ray_temp_dir() -> Path:
    """The folder of this machine's Ray sessions (`RAY_TMPDIR`'s, else the system's temporary folder's)."""
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"


def head_session() -> Optional[str]:
    """Name of the newest local Ray session folder (`session_<date>_<pid>`, new at every `ray start`)."""
    latest = _ray_temp_dir() / "session_latest"
    try:
        return Path(os.readlink(latest)).name
    except OSError:
        return None


def is_started_head(state: LocalState) -> bool:
    """Whether the local head running now is the one `up` started (not one started after it stopped).

    A state file from before sessions were recorded trusts any head, as it always did.
    """
    return state.ray_started and (state.ray_session is None or state.ray_session == head_session())


_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def _address_host(address: str) -> str | None:
    """The host a `RAY_ADDRESS` names (`ray://h:10001`, `h:6379`); None for `auto`/`local`."""
    if address in ("auto", "local"):
        return None
    try:
        return urlsplit(address if "://" in address else f"ray://{address}").hostname
    except ValueError as err:  # an unclosed IPv6 bracket
        raise BringUpError(f"RAY_ADDRESS {address!r} is not an address ({err}): write ray://host:10001, "
                           "host:6379, auto or local") from None


def _names_this_machine(address: str) -> bool:
    """Whether `RAY_ADDRESS` names a head on this machine by name (`auto`, `local`, a loopback host)."""
    return _address_host(address) in (None, *_LOCAL_HOSTS)


def is_remote_address(address: str) -> bool:
    """Whether `RAY_ADDRESS` names a cluster on other machines: its nodes cannot read this machine's files or loopback."""
    host = _address_host(address)
    if not host or host in _LOCAL_HOSTS:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False  # unresolvable: joining fails anyway, and says why
    return not any(_is_this_machine(ip) for ip in addresses)


def _is_this_machine(ip: str) -> bool:
    """Whether `ip` is one of this machine's addresses: only those can be bound to."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False
    return True


def check_remote_join(cfg: ClusterConfig, address: str | None) -> None:
    """Refuses, before anything starts, a join whose cluster could reach neither the model nor Redis.

    Without `model.source` the replicas would load the model built in this machine's state
    directory, and without `redis_url` the session store would be a redis-server on this
    machine's loopback: on another machine's nodes both fail only minutes later, replica by replica.
    """
    if not address or not is_remote_address(address):
        return
    problems = []
    if not cfg.model.source:
        problems.append(
            f"model.source is unset, so the replicas would load the model built at {cfg.model_source()} on this "
            "machine: set it to a Hugging Face id or a folder on the cluster's nodes"
        )
    if not cfg.redis_url:
        problems.append(
            "redis_url is unset, so the session store would be a redis-server on this machine's 127.0.0.1: "
            "set redis_url (or REDIS_URL) to a Redis the cluster's nodes reach"
        )
    if problems:
        raise BringUpError(f"RAY_ADDRESS={address} is a cluster on other machines, and " + "; ".join(problems))


def check_proxy_host(cfg: ClusterConfig, address: str | None) -> None:
    """Refuses, before anything starts, a `ports.host` the proxies could not listen on here.

    Why: a proxy that cannot bind its address never answers, and `up` would wait out its
    two minutes for the endpoints with nothing to say but a timeout. A cluster on other
    machines binds its own addresses, so a join there is not checked.
    """
    if address and is_remote_address(address):
        return
    host = cfg.ports.host
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError as err:
        raise BringUpError(f"ports.host {host!r} does not resolve to an address ({err}); set it to one of this "
                           "machine's addresses (0.0.0.0 for all of them)") from None
    if not any(_is_this_machine(ip) for ip in addresses):
        raise BringUpError(f"ports.host {host!r} ({', '.join(sorted(addresses))}) is not an address of this machine, "
                           "so the proxies could not listen there; set it to one of its addresses (0.0.0.0 for all)")


def dashboard_url_for(address: str) -> str:
    """The dashboard (Serve's REST API) of the cluster at `RAY_ADDRESS` `address`.

    `RAY_DASHBOARD_ADDRESS` wins, as for Ray's own `serve deploy`; else the address's host on the
    dashboard's default port (a KubeRay head service serves both); `auto` is this machine.
    """
    explicit = os.environ.get("RAY_DASHBOARD_ADDRESS")
    if explicit:
        return explicit.rstrip("/") if "://" in explicit else f"http://{explicit.rstrip('/')}"
    host = _address_host(address)
    if not host or host in _LOCAL_HOSTS:
        return LOCAL_DASHBOARD_URL
    return f"http://{host}:{DASHBOARD_PORT}" if ":" not in host else f"http://[{host}]:{DASHBOARD_PORT}"


def _alive(pid: int) -> bool:
    """Whether process `pid` runs: an exited child of this process (a zombie until reaped) does not."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    except ChildProcessError:  # not this process' child: its parent reaps it
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask (not Linux): the signal alone
    return state != "Z"


def _is_redis_process(pid: int, port: Optional[int] = None, data_dir: Optional[Path] = None) -> bool:
    """Whether `pid` is alive and a redis-server, listening on `port` and working in `data_dir` when given:
    after a reboot a recorded pid can name anything, another Redis (the system's, on 6379, or another state
    directory's on the same default port) included."""
    if not _alive(pid):
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc to ask (not Linux): the pid alone
    if b"redis-server" not in command:
        return False
    # redis-server titles itself "redis-server 127.0.0.1:<port>": the port as a whole word (`:6380` is in
    # `:63801` too, another server's title).
    if port is not None and re.search(rb":%d(?![0-9])" % port, command) is None:
        return False
    try:  # redis-server works in its --dir: another state directory's Redis works in that one's
        return data_dir is None or Path(os.readlink(f"/proc/{pid}/cwd")) == data_dir.resolve()
    except OSError:
        return True


def _serve_client(state: LocalState):
    """Ray's Serve SDK client for the recorded dashboard, each call bounded by `DASHBOARD_CALL_TIMEOUT_S`."""
    _local_token_auth(state)
    return _bounded_serve_client_class()(state.dashboard_url)


@functools.cache
def _bounded_serve_client_class():
    """Ray's `ServeSubmissionClient` with a timeout on every call, its constructor's version check included.

    Ray's SDK sets none: a dashboard that accepts and never answers would hang `status`, `down` and
    `up` for good. Every call goes through `_do_request`, which hands its keywords on to `requests`.
    """
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    class BoundedServeSubmissionClient(ServeSubmissionClient):
        def _do_request(self, method, endpoint, **kwargs):
            kwargs.setdefault("timeout", DASHBOARD_CALL_TIMEOUT_S)
            return super()._do_request(method, endpoint, **kwargs)

    return BoundedServeSubmissionClient


def _local_token_auth(state: LocalState) -> None:
    """Calls a local head's dashboard with the machine's Ray token where Ray itself would.

    Why: with `RAY_AUTH_MODE` unset, a head started while `~/.ray/auth_token` exists
    (written by any earlier `ray.init()` that started a cluster) requires that token, and
    Ray's own clients of a local head send it. As in `ray.init`, an explicit address (a
    joined cluster) never turns it on: set `RAY_AUTH_MODE=token` for such a cluster.
    """
    if state.ray_started or state.ray_address in (None, "auto", "local"):
        _use_machine_token()


def _use_machine_token() -> None:
    """Turns Ray's token authentication on for this process and its children (`ray status`, `ray stop`) when
    `RAY_AUTH_MODE` is unset and this machine has a token, as `ray start` decides for the head it starts."""
    from ray._private.authentication import authentication_token_setup

    # Quietly: `ray start` already said so when it started the head, and `status` would say it at every call.
    token_logger = logging.getLogger(authentication_token_setup.__name__)
    level = token_logger.level
    token_logger.setLevel(logging.ERROR)
    try:
        authentication_token_setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        token_logger.setLevel(level)


def deploy(cfg: ClusterConfig, state: LocalState, progress: Progress) -> None:
    """Deploys the rendered Serve config through the dashboard, like `serve deploy`."""
    doc = render_serve_config(cfg)
    out = state_dir_of(cfg) / "serve_config.yaml"
    import yaml

    write_private(out, yaml.safe_dump(doc, sort_keys=True))  # it holds the Redis URL, password and all
    progress(f"serve: deploying {out}")
    deploy_document(state, doc, progress)


def deploy_document(state: LocalState, doc: dict, progress: Progress = lambda msg: None) -> None:
    """`serve deploy` of a Serve config document through the dashboard.

    The applications others deployed the same way on that head are deployed along, unchanged: a
    document is the head's whole desired state, and leaving them out would delete them.
    """
    own = {app["name"] for app in doc["applications"]}

    def put() -> None:
        client = _serve_client(state)
        merged = with_other_applications(doc, client.get_serve_details(), own)
        if kept := [app["name"] for app in merged["applications"] if app["name"] not in own]:
            progress(f"serve: keeping the head's other applications as they are: {', '.join(kept)}")
        client.deploy_applications(merged)

    _when_dashboard_ready(put, "serve deploy")


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


def replicas_need(cfg: ClusterConfig, with_gpus: bool = True) -> dict[str, float]:
    """Ray resources every replica together takes beyond CPUs: GPUs and `replicas.ray_resources`."""
    replicas = cfg.replicas
    need = {name: amount * replicas.num_replicas for name, amount in replicas.ray_resources.items()}
    if with_gpus and replicas.accelerator == "gpu":
        need["GPU"] = float(replicas.num_gpus * replicas.num_replicas)
    return need


def resource_shortfall(cfg: ClusterConfig, totals: dict[str, float]) -> Optional[str]:
    """What the replicas need that `totals` (a cluster's resources) lacks, in words; None when it has it all.

    CPU replicas' CPUs count too, with those of warmpath's other deployments: a local head is sized for the
    replicas of the `up` that started it, and a later `up` asking for more reuses it.
    """
    need = replicas_need(cfg)
    if cfg.replicas.accelerator == "cpu":
        need["CPU"] = cfg.replicas.num_replicas * cfg.replicas.num_cpus + SERVICE_NUM_CPUS
    short = {name: amount for name, amount in need.items() if totals.get(name, 0.0) < amount}
    if not short:
        return None
    parts = [f"{amount:g} {name} (the head has {totals.get(name, 0.0):g})" for name, amount in sorted(short.items())]
    hints = []
    if "GPU" in short:
        fits_one = totals.get("GPU", 0.0) >= cfg.replicas.num_gpus
        hints.append(
            "Ray found too few GPUs on this machine (check `nvidia-smi` and CUDA_VISIBLE_DEVICES); or set "
            + ("replicas.num_replicas lower" if fits_one else "replicas.accelerator: cpu")
        )
    if "CPU" in short:
        hints.append(
            "the running head was started for fewer or smaller replicas (`warmpath down`, then `warmpath up` "
            "starts one sized for these), or set replicas.num_replicas or replicas.num_cpus lower"
        )
    if set(short) - {"GPU", "CPU"}:
        hints.append(
            "a local head offers replicas.ray_resources only when `warmpath up` starts it with them "
            "(`warmpath down`, then `warmpath up`)"
        )
    replicas = f"{cfg.replicas.num_replicas} replicas need" if cfg.replicas.num_replicas > 1 else "the replica needs"
    return f"{replicas} {', '.join(parts)}: " + "; ".join(hints)


def check_local_head_resources(cfg: ClusterConfig, state: LocalState, progress: Progress) -> None:
    """Refuses to deploy replicas a local head can never place (no autoscaler adds nodes to it).

    Why: Serve would keep them pending, and `up` would wait its whole timeout to say so.
    A cluster joined through RAY_ADDRESS is not checked: its autoscaler may add what is missing.
    """
    if os.environ.get("RAY_ADDRESS"):
        return
    from ray.util.state import list_nodes

    _local_token_auth(state)
    totals: dict[str, float] = {}

    def read() -> None:
        totals.clear()
        for node in list_nodes(address=state.dashboard_url):
            if node.state == "ALIVE":
                for name, amount in (node.resources_total or {}).items():
                    totals[name] = totals.get(name, 0.0) + amount

    try:
        _when_dashboard_ready(read, "reading the Ray head's resources")
    except BringUpError as err:
        progress(f"ray: {err}; deploying without checking")
        return
    shortfall = resource_shortfall(cfg, totals)
    if shortfall:
        raise BringUpError(shortfall)


def serve_details(state: LocalState) -> dict:
    return _serve_client(state).get_serve_details()


def message_line(message: str) -> str:
    """A Serve deployment message on one line: its first line (what happened) and, of a longer one, the
    traceback's last exception with the line after it (else its last line); whitespace runs collapsed."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if len(lines) <= 2:
        return " ".join(map(_squeezed, lines))[:MESSAGE_CHARS]
    raised = [at for at, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    tail = lines[raised[-1]:raised[-1] + 2] if raised else lines[-1:]
    half = MESSAGE_CHARS // 2
    return f"{_squeezed(lines[0])[:half]} ... {' '.join(map(_squeezed, tail))[:half]}"


# A traceback's "SomeError: what" line (unindented; a chained one may follow another).
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure): \S")


def _squeezed(line: str) -> str:
    return " ".join(line.split())


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
            lines.append(f"  {message_line(dep['message'])}")
    if app["status"] == "DEPLOY_FAILED" and app.get("message"):
        lines += [f"  {line}" for line in app["message"].strip().splitlines()[-12:]]
    return app["status"], lines


def _local_logs(state: LocalState) -> Optional[Path]:
    """The logs folder of the local head `up` started, where it still exists; None for a joined cluster."""
    if not (state.ray_started and state.ray_session):
        return None
    logs = _ray_temp_dir() / state.ray_session / "logs"
    return logs if logs.is_dir() else None


def wait_running(cfg: ClusterConfig, state: LocalState, progress: Progress, timeout_s: float) -> dict:
    """Polls the Serve status until warmpath's applications run, one fails, or `timeout_s` passes.

    Returns the Serve details that showed them running.

    Other applications on a shared head are not waited for. A wait that sees no change still
    reports every `STILL_WAITING_EVERY_S` (replicas load a model for minutes).
    """
    start = time.monotonic()
    last, last_said = None, start
    said_messages: set[str] = set()
    own = [cfg.app_name] + sorted(own_application_names(cfg) - {cfg.app_name})
    while True:
        try:
            details = serve_details(state)
        except OSError as err:  # requests' errors are OSErrors: the dashboard dropped or stalled
            if time.monotonic() - start > timeout_s:
                raise BringUpError(f"Ray's dashboard at {state.dashboard_url} stopped answering: {err}") from None
            progress(f"[{time.monotonic() - start:5.0f}s] serve: the dashboard did not answer ({type(err).__name__}); asking again")
            time.sleep(2)
            continue
        status, lines = "RUNNING", []
        for name in own:
            app_status, app_lines = summarize(details, name)
            lines += app_lines
            status = app_status if status == "RUNNING" else status
        line = f"serve: {status}; " + "; ".join(l for l in lines if not l.startswith("  "))
        now = time.monotonic()
        if line != last or now - last_said >= STILL_WAITING_EVERY_S:
            progress(f"[{now - start:5.0f}s] {line}" + (" (still waiting)" if line == last else ""))
            last, last_said = line, now
        # Serve's own word on a deployment (a replica it cannot place, a failing constructor), once each.
        for message in (l.strip() for l in lines if l.startswith("  ")):
            if message not in said_messages and status not in ("RUNNING", "DEPLOY_FAILED"):
                progress(f"[{now - start:5.0f}s] serve says: {message}")
                if not said_messages and (logs := _local_logs(state)) is not None:
                    # Serve's message ends at the engine's last words ("See root cause above"): its cause is
                    # in the engine's own output, which only these files hold.
                    progress(f"[{now - start:5.0f}s] serve: the replicas' logs are in {logs / 'serve'}, their "
                             f"engines' output in {logs}/worker-*.out and worker-*.err")
                said_messages.add(message)
        if status == "RUNNING":
            return details
        if status == "DEPLOY_FAILED":
            raise BringUpError("the Serve application failed to deploy:\n" + "\n".join(lines))
        if now - start > timeout_s:
            raise BringUpError(f"not running after {timeout_s:.0f}s:\n" + "\n".join(lines))
        time.sleep(2)


def serving_ports(details: dict) -> tuple[int, int]:
    """The HTTP and gRPC ports Serve's proxies listen on (fixed when Serve first started on the head)."""
    return details["http_options"]["port"], details["grpc_options"]["port"]


_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def proxy_host(details: dict, state: LocalState) -> str:
    """The address that reaches Serve's proxies: the one they bind (`ports.host`, fixed when Serve first
    started on the head), or the head's own address (its dashboard's) where they bind every interface."""
    bound = str((details.get("http_options") or {}).get("host") or "")
    if bound not in _WILDCARD_HOSTS:
        return bound
    return urlsplit(state.dashboard_url).hostname or "127.0.0.1"


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _accepts(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def wait_proxies(state: LocalState, progress: Progress, timeout_s: float = 120) -> None:
    """Waits until Serve's proxies take calls: HTTP health answers and the gRPC port accepts.

    Why: applications report RUNNING before a proxy has bound its ports (a fresh head starts them
    last), and `up` must not print an endpoint that refuses the first call.
    """
    host = urlsplit(state.http_url).hostname
    grpc_port = int(state.grpc_address.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    while not (_answers(f"{state.http_url}/-/healthz") and _accepts(host, grpc_port)):
        if time.monotonic() > deadline:
            raise BringUpError(
                f"the applications run, but Serve's proxies do not take calls after {timeout_s:.0f} s "
                f"({state.http_url}/-/healthz, gRPC {state.grpc_address}); see `warmpath status`"
            )
        time.sleep(1)
    progress(f"serve: proxies take calls (http {state.http_url}, grpc {state.grpc_address})")


def remove_applications(state: LocalState, own: set[str], progress: Progress, timeout_s: float = 120) -> None:
    """Removes warmpath's applications and waits until they are gone (code changes need fresh ones).

    On a head `up` started, Serve is shut down whole (its applications are all warmpath's); on a
    joined head only `own` go, and whatever else runs there stays.
    """
    client = _serve_client(state)
    if is_started_head(state):  # not a head started since in its place, whose applications are not all ours
        client.delete_applications()
    else:
        client.deploy_applications(without_own_applications(client.get_serve_details(), own))
    deadline = time.monotonic() + timeout_s
    while own & set(client.get_serve_details().get("applications", {})):
        if time.monotonic() > deadline:
            raise BringUpError(f"applications still shutting down after {timeout_s:.0f}s")
        time.sleep(1)
    progress(f"serve: applications {', '.join(sorted(own))} deleted")


def up(cfg: ClusterConfig, progress: Progress, timeout_s: float = 900, redeploy: bool = False) -> LocalState:
    """Starts everything `cfg` needs and returns what was started.

    Serve redeploys only when the rendered config changes; `redeploy` deletes the
    running application first so new code is picked up with the same config.
    """
    check_remote_join(cfg, os.environ.get("RAY_ADDRESS"))
    check_proxy_host(cfg, os.environ.get("RAY_ADDRESS"))
    state_dir = state_dir_of(cfg)
    state = LocalState.load(state_dir)
    check_head_startable(cfg, state, progress)
    ensure_model(cfg, progress)
    redis_url = start_redis(cfg, state, progress)
    state.save(state_dir)
    if not cfg.redis_url:
        cfg = cfg.model_copy(update={"redis_url": redis_url})
    if cfg.access.is_auth_enabled:
        ensure_local_api_key(cfg, redis_url, progress)
    else:
        progress("API keys are off (access.is_auth_enabled=false): anyone who reaches the ports can call")
    start_ray(cfg, state, progress)
    state.save(state_dir)
    check_local_head_resources(cfg, state, progress)
    own = own_application_names(cfg)
    if redeploy:
        _when_dashboard_ready(lambda: remove_applications(state, own, progress), "deleting the running application")
    state.app_name = cfg.app_name  # before deploying: a deploy that fails part way leaves it for `down`
    state.save(state_dir)
    deploy(cfg, state, progress)
    details = wait_running(cfg, state, progress, timeout_s)
    http_port, grpc_port = serving_ports(details)
    if (http_port, grpc_port) != (cfg.ports.http_port, cfg.ports.grpc_port):
        progress(
            f"serve: the head's proxies were started on ports {http_port} (HTTP) and {grpc_port} (gRPC), "
            f"not the {cfg.ports.http_port} and {cfg.ports.grpc_port} asked for; Serve keeps its first ports "
            "until it stops (`warmpath down`, then `warmpath up`)"
        )
    bound = str((details.get("http_options") or {}).get("host") or "")
    if bound and bound != cfg.ports.host:
        progress(f"serve: the head's proxies listen on {bound}, not the {cfg.ports.host} asked for; Serve keeps its "
                 "first options until it stops (`warmpath down`, then `warmpath up`)")
        if not cfg.access.is_auth_enabled and bound in _WILDCARD_HOSTS:
            progress(f"WARNING: API keys are off and the proxies listen on every address ({bound}): anyone who "
                     "reaches this machine can call, server-side HTTP tools included")
    host = proxy_host(details, state)
    host = f"[{host}]" if ":" in host else host
    state.http_url, state.grpc_address = f"http://{host}:{http_port}", f"{host}:{grpc_port}"
    state.save(state_dir)
    wait_proxies(state, progress)
    return state


# The operator's own key is not what rate limits protect against; keys made with `warmpath keys create` are.
ADMIN_REQUESTS_PER_S = 1000.0
ADMIN_BURST = 2000


def api_key_file(cfg: ClusterConfig) -> Path:
    return state_dir_of(cfg) / "api-key"


def local_api_key(cfg: ClusterConfig) -> Optional[str]:
    """The admin key `warmpath up` keeps in the state directory; None when keys are off, or when `up` wrote
    none (`--no-auth`: a cluster brought up so answers calls without a key)."""
    file = api_key_file(cfg)
    return file.read_text().strip() if cfg.access.is_auth_enabled and file.is_file() else None


def ensure_local_api_key(cfg: ClusterConfig, redis_url: str, progress: Progress) -> str:
    """The local admin key (all permissions): kept in `<state_dir>/api-key` (mode 0600), registered in Redis.

    Reused across `up`s; registered again if Redis lost it (a new Redis, a flushed one). A
    key revoked with `warmpath keys revoke` is never registered again (`ApiKeyStore.create`
    refuses it): a new key replaces it, in the file too.
    """
    from cluster.api_keys import (
        ALL_PERMISSIONS, KeyIdTaken, KeyRevoked, StoreUnavailable, hash_api_key, key_id_of, run_with_store,
    )

    file = api_key_file(cfg)
    existing = file.read_text().strip() if file.is_file() else None

    async def create(store, key: Optional[str] = None):
        return await store.create("local-admin", [ALL_PERMISSIONS], ADMIN_REQUESTS_PER_S, ADMIN_BURST, key=key)

    async def register(store) -> str:
        if not existing:
            key, record = await create(store)
            progress(f"api key: created {record.key_id} (all permissions) in {file}")
            return key
        if await store.lookup(existing) is not None:
            return existing
        try:
            key, record = await create(store, existing)  # Redis lost it
            progress(f"api key: registered {record.key_id} (all permissions) in {file}")
        except (KeyRevoked, KeyIdTaken) as err:
            key, record = await create(store)
            why = "was revoked" if isinstance(err, KeyRevoked) else "has an id another key holds now"
            progress(
                f"api key: the key in {file} ({key_id_of(hash_api_key(existing))}) {why}; "
                f"created {record.key_id} (all permissions) and wrote it there instead"
            )
        return key

    try:
        key = run_with_store(redis_url, register)
    except StoreUnavailable as err:  # a Redis that answers PING but takes no writes (a replica, full, MISCONF)
        raise BringUpError(f"could not register the admin API key in Redis at {without_password(redis_url)}: {err}") from None
    if existing != key:
        file.parent.mkdir(parents=True, exist_ok=True)
        replace_private(file, key + "\n")  # cut short (a full disk), an empty file made the next `up` mint a key
    return key


def write_private(file: Path, text: str) -> None:
    """Writes `text` to `file` readable by its owner only (mode 0600), an existing file's mode included.

    A device or FIFO (`/dev/stdout`) keeps its mode: made private, run as root, `/dev/null` or a
    terminal was closed to every other user of the machine.
    """
    # O_CREAT's mode applies to a new file only: fchmod makes an existing one private too.
    with os.fdopen(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        if stat.S_ISREG(os.fstat(out.fileno()).st_mode):
            os.fchmod(out.fileno(), 0o600)
        out.write(text)


def replace_private(file: Path, text: str) -> None:
    """`write_private` whole or not at all, for the state directory's own files: a temporary file renamed over
    `file` (a link there is replaced, not followed)."""
    partial = file.with_name(file.name + ".tmp")
    try:
        write_private(partial, text)
        os.replace(partial, file)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def stop_redis(state: LocalState, progress: Progress, timeout_s: float = 10, data_dir: Optional[Path] = None) -> bool:
    """Stops the redis-server `up` started (working in `data_dir`, where given), waiting up to `timeout_s` for it
    to exit (it writes its AOF first).

    Returns:
        False when it is still running (it is then left to the operator, and stays recorded).
    """
    if not state.redis_pid:
        return True
    if not _is_redis_process(state.redis_pid, state.redis_port, data_dir):
        progress(f"redis: pid {state.redis_pid} is no longer the redis-server `up` started; nothing to stop")
        return True
    os.kill(state.redis_pid, signal.SIGTERM)  # redis flushes its AOF on SIGTERM
    if _running_after([state.redis_pid], timeout_s):
        progress(f"redis: pid {state.redis_pid} still running {timeout_s:.0f} s after SIGTERM; stop it by hand")
        return False
    progress(f"redis: stopped (pid {state.redis_pid})")
    return True


def reap_orphaned_engines() -> list[int]:
    """Kills vLLM engine processes whose replica is gone.

    Why: vLLM's engine core and worker processes outlive a replica actor that
    is killed hard (`ray stop --force`, a crashed or killed replica), each
    keeping its model and KV cache in memory. Once the head `up` started is
    stopped, such orphans serve no one.

    An engine is orphaned when it was re-parented to init, or adopted by a
    subreaper (`systemd --user` on a desktop) out of a process group whose
    leader is gone: Ray makes each worker the leader of its own group, which
    the engines it starts inherit, so that leader is the replica. Its other
    engines (a worker under an engine core) go with it.
    """
    engines = _engine_processes()
    parent_groups = {pid: _process_group(ppid) for pid, (ppid, _) in engines.items()}
    # A group one of whose engines still has its owner in it (a live replica, where Ray's workers share a
    # group; a frontend) is not orphaned, whatever became of its leader.
    owned_groups = {group for pid, (ppid, group) in engines.items()
                    if ppid not in engines and parent_groups[pid] == group}
    orphaned_groups = {group for pid, (ppid, group) in engines.items()
                       if ppid != 1 and not _runs(group) and parent_groups[pid] != group} - owned_groups
    reaped = []
    for pid, (ppid, group) in engines.items():
        if ppid == 1 or group in orphaned_groups:
            try:
                os.kill(pid, signal.SIGKILL)
                reaped.append(pid)
            except OSError:
                pass
    return reaped


_ENGINE_TITLES = (b"VLLM::EngineCore", b"VLLM::Worker")


def _engine_processes() -> dict[int, tuple[int, int]]:
    """Each of this user's vLLM engine processes' parent and process group, by pid."""
    engines = {}
    for pid in processes_titled(lambda title: title in _ENGINE_TITLES):
        try:
            engines[pid] = _parent_and_group(pid)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return engines


def processes_titled(is_wanted: Callable[[bytes], bool]) -> list[int]:
    """The pids of this user's processes whose title (their command line's first word: vLLM's processes set it,
    `VLLM::EngineCore`) `is_wanted` takes. Another user's are theirs to stop (root's `down` killed every user's
    orphans)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == os.getuid() and is_wanted((entry / "cmdline").read_bytes().split(b"\0", 1)[0]):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not this user's to read
            continue
    return pids


def _parent_and_group(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2])


def _process_group(pid: int) -> Optional[int]:
    try:
        return _parent_and_group(pid)[1]
    except (OSError, ValueError, IndexError):
        return None


def _runs(pid: int) -> bool:
    """Whether a process `pid` exists (a group's leader: the kernel reuses no pid while a group has it)."""
    return Path(f"/proc/{pid}").exists()


def kv_events_dir() -> Path:
    """The folder of this user's replicas' KV-event sockets on a head `up` started (`KV_EVENTS_IPC_DIR_ENV`)."""
    return Path(tempfile.gettempdir()) / f"warmpath-kv-events-{os.getuid()}"


def remove_stale_sockets(folder: Path) -> int:
    """Removes the Unix sockets in `folder` nothing listens on any more; returns how many.

    Why: a replica's engine leaves its two socket files when it ends, so every replica a head ever ran left
    two behind. One that a live process still answers on (a head started elsewhere, beside this one) stays.
    """
    removed = 0
    try:
        entries = list(folder.iterdir())
    except OSError:  # never made, or not this user's to read
        return 0
    for entry in entries:
        try:
            if not stat.S_ISSOCK(entry.lstat().st_mode):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1)
                probe.connect(str(entry))
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                entry.unlink()
                removed += 1
        except OSError:
            continue  # answering, gone meanwhile, or not to be probed: left as it is
    return removed


def _stop_started_head(state: LocalState, progress: Progress) -> bool:
    """Deletes the applications and stops the local head `up` started, if that head still runs.

    Returns:
        False when the head may still run (`ray stop` failed or hung): it then stays recorded.
    """
    is_stopped = True
    if not _ray_head_up():
        leftovers = session_processes(state.ray_session) if state.ray_session else []
        if not leftovers:
            progress("ray: the head `up` started is not running")
        else:  # a head that never finished starting, or stopped answering: its processes still go
            progress(f"ray: the head `up` started does not answer; stopping its {len(leftovers)} processes")
            is_stopped = _ray_stop(progress)
    elif not is_started_head(state):
        own = session_processes(state.ray_session) if state.ray_session else []
        if not own:
            progress(
                f"ray: the head `up` started (session {state.ray_session}) is gone; the one running now "
                f"({head_session()}) was started elsewhere and is left running"
            )
            return True
        # Another head started after it (`ray stop` would stop both): this one's own processes go, by session,
        # its Serve controller and applications with them. Not through the dashboard: the one Ray's tools
        # reach now is the other head's, whose applications were deleted.
        progress(f"ray: the head `up` started (session {state.ray_session}) runs beside one started elsewhere "
                 f"({head_session()}), which is left running; stopping its {len(own)} processes")
        is_stopped = _stop_processes(own, state.ray_session, progress)
    else:
        try:
            _serve_client(state).delete_applications()  # replicas stop their engines before the head goes
            progress("serve: applications deleted")
        except Exception as err:
            progress(f"serve: could not delete applications ({err})")
        is_stopped = _ray_stop(progress)
    reaped = reap_orphaned_engines()
    if reaped:
        progress(f"vllm: stopped {len(reaped)} engine processes left behind by their replicas")
    if is_stopped:
        remove_stale_sockets(kv_events_dir())
    return is_stopped


def _stop_processes(pids: list[int], session: str, progress: Progress, timeout_s: float = 10.0) -> bool:
    """SIGTERM to `pids`, SIGKILL to those left after `timeout_s` that are still of `session` (a pid may have
    been reused meanwhile); False (said why) when some outlive both."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    alive = set(_running_after(pids, timeout_s)) & set(session_processes(session))
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if left := _running_after(sorted(alive), 5.0):
        progress(f"ray: processes {', '.join(map(str, left))} did not stop; kill them by hand")
        return False
    return True


def _running_after(pids: list[int], timeout_s: float) -> list[int]:
    """Those of `pids` still running once all stopped or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _ray_stop(progress: Progress) -> bool:
    """`ray stop --force`; False (said why) when it failed or did not finish."""
    try:
        result = subprocess.run(
            [_bin("ray"), "stop", "--force"], capture_output=True, text=True, timeout=RAY_STOP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        progress(f"ray: `ray stop --force` did not finish in {RAY_STOP_TIMEOUT_S} s; run it by hand")
        return False
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        progress(f"ray: `ray stop --force` failed ({said[-1] if said else f'exit {result.returncode}'}); run it by hand")
        return False
    progress("ray: head stopped")
    return True


def session_processes(session: str) -> list[int]:
    """Ids of this user's processes of the Ray session `session` (`session_<date>_<pid>`): its GCS, raylet and
    agents name it in one of Ray's own options (`_SESSION_OPTIONS`); a process merely naming a file there
    (`tail -f .../logs/raylet.out`) is not one."""
    needle = session.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(argument.startswith(_SESSION_OPTIONS) and needle in argument for argument in arguments):
            found.append(int(entry.name))
    return found


# Ray's options naming a node's session (or a folder of it) on its processes' command lines (ray 2.60).
_SESSION_OPTIONS = tuple(option.encode() for option in (
    "--session-name=", "--session_name=", "--session-dir=", "--session_dir=", "--log_dir=", "--log-dir=",
    "--logs-dir=", "--raylet_socket_name=", "--temp-dir=", "--temp_dir=",
))


def recorded_config(cfg: ClusterConfig, state: LocalState, progress: Progress) -> ClusterConfig:
    """`cfg` naming the application `up` recorded deploying, where that is another than `cfg`'s (run without
    the config that named it, `down` deleted applications that were never there and forgot the ones that were)."""
    if state.app_name is None or state.app_name == cfg.app_name:
        return cfg
    progress(f"serve: the recorded application is {state.app_name!r}, not this config's {cfg.app_name!r}; "
             f"acting on {state.app_name!r}")
    return cfg.model_copy(update={"app_name": state.app_name})


def down(cfg: ClusterConfig, progress: Progress) -> bool:
    """Stops the Serve applications, and the Ray head and Redis if `up` started them.

    Returns False when something could not be stopped; it stays recorded for the next `down`.

    A joined head (`RAY_ADDRESS`) keeps running with everything but warmpath's applications. A
    local head that is not the one `up` started (it stopped, and someone started another) is left
    alone entirely.
    """
    state_dir = state_dir_of(cfg)
    state = LocalState.load(state_dir)
    if state.is_empty():
        progress(f"nothing to stop: {LocalState.path(state_dir)} records nothing started")
        return True
    cfg = recorded_config(cfg, state, progress)
    left = LocalState()
    if state.ray_started:
        if not _stop_started_head(state, progress):
            left.ray_started, left.ray_session, left.ray_address = True, state.ray_session, state.ray_address
            left.app_name = state.app_name
    elif state.ray_address:
        own = own_application_names(cfg)
        try:
            remove_applications(state, own, progress)
            progress(f"ray: {state.ray_address} was joined, not started: left running")
        except Exception as err:
            if isinstance(err, OSError) and _names_this_machine(state.ray_address) and not _ray_head_up():
                # A local head joined and since stopped: its applications went with it. Kept, the join failed
                # every `down` and refused every plain `up`.
                progress(f"ray: the local head joined at {state.ray_address} is no longer running; warmpath's "
                         "applications went with it, and the join is forgotten")
            elif state.http_url is None and isinstance(err, OSError):
                # A dashboard that cannot be reached where `up` never saw the applications serve (a head that
                # was not running, a mistyped address): kept, the join would fail every `down` and refuse
                # every plain `up`. One that answers but fails the delete keeps the record: they may run.
                progress(f"serve: could not delete applications {', '.join(sorted(own))} at {state.ray_address} "
                         f"({err}); `up` never saw them serve there, so the join is forgotten (if they do run "
                         "there, delete them with `serve shutdown` against that head)")
            else:
                progress(f"serve: could not delete applications {', '.join(sorted(own))} ({err}); still recorded")
                left.ray_address, left.dashboard_url = state.ray_address, state.dashboard_url
                left.http_url, left.grpc_address, left.app_name = state.http_url, state.grpc_address, state.app_name
    if not stop_redis(state, progress, data_dir=redis_dir_of(cfg)):
        left.redis_pid, left.redis_port, left.redis_url = state.redis_pid, state.redis_port, state.redis_url
    left.save(state_dir)
    if not left.is_empty():
        progress(f"not everything stopped: {LocalState.path(state_dir)} still records it; `warmpath down` tries again")
    return left.is_empty()
