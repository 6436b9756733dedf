"""The TCP ports a replica's engine publishes its KV events on.

Why its own module: the replica chooses the ports when it starts and the engine binds them
minutes later, once its model is loaded. A port the kernel hands out for `bind(0)` comes from
its ephemeral range, the range every outgoing connection (Ray's, Redis's, a model download's)
takes its local port from, so one of those could hold it by then: the engine's bind failed and
Ray restarted the replica. Ports below that range are only ever taken by an explicit bind.

Two replicas on one host choose in the same range before either engine binds, so each also
claims its ports for as long as it lives: a lock file per port (`fcntl.flock`, released by the
kernel when the replica's process ends), which another replica's choice skips.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import socket
import stat
import tempfile
from pathlib import Path
from typing import Mapping

from cluster.serve_config import KV_EVENTS_IPC_DIR_ENV

# Above Ray's worker ports (10002-19999 by default) and below Linux's default ephemeral range (32768-60999).
CANDIDATE_PORTS = range(20000, 32768)
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = range(32768, 61000)
_MAX_TRIES = 200
# The longest socket path an `ipc://` endpoint may have (a Unix socket's address holds 107 bytes).
MAX_IPC_PATH_CHARS = 100
# Claims held by this process (a replica): descriptors of locked files, kept open for the process's life.
_HELD_CLAIMS: list[int] = []


def default_claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / "warmpath-kv-ports"


def ephemeral_ports(range_file: Path = _EPHEMERAL_RANGE_FILE) -> range:
    """The ports this host's kernel gives outgoing connections and `bind(0)`; Linux's default where unreadable."""
    try:
        low, high = (int(field) for field in range_file.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return range(low, high + 1)


def _bound_socket(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("", port))
    except OSError:
        sock.close()
        return None
    return sock


def _claim(claims_dir: Path, port: int) -> tuple[bool, int | None]:
    """(whether no other process claims `port` in `claims_dir`, this process's claim on it: the descriptor of the
    locked file, or None where no claim can be made there, such as a folder this user cannot write in).

    Read-only descriptors (a lock needs no more), so another user's claim file is locked as this user's is.
    """
    path = claims_dir / str(port)
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except PermissionError:
        return False, None  # another user's claim this user may not even read: taken as held
    except OSError:
        try:
            if not claims_dir.is_dir():
                claims_dir.mkdir(exist_ok=True)
                with contextlib.suppress(OSError):
                    claims_dir.chmod(0o1777)  # every user's replicas claim there; only a file's owner removes it
            descriptor = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            return True, None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        return False, None
    return True, descriptor


def free_kv_event_ports(count: int, ephemeral: range | None = None, candidates: range = CANDIDATE_PORTS,
                        claims_dir: Path | None = None) -> list[int]:
    """`count` distinct ports free now, outside the ephemeral range and claimed by no other replica on this host,
    where there are any; this process keeps its claims on them (in `claims_dir`, by default a folder of the
    system's temporary files) until it ends.

    Each chosen port stays bound until all are chosen, so none comes twice. Where every
    candidate is in the ephemeral range (a host that widened it), taken or claimed, the kernel
    chooses, as before.
    """
    ephemeral = ephemeral_ports() if ephemeral is None else ephemeral
    claims_dir = default_claims_dir() if claims_dir is None else claims_dir
    outside = [port for port in candidates if port not in ephemeral]
    rng = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        chosen: list[socket.socket] = []
        for _ in range(_MAX_TRIES if outside else 0):
            if len(chosen) == count:
                break
            port = rng.choice(outside)
            is_unclaimed, claim = _claim(claims_dir, port)  # a port chosen already is claimed by this process
            sock = _bound_socket(port) if is_unclaimed else None
            if sock is None:
                if claim is not None:
                    os.close(claim)
                continue
            if claim is not None:
                _HELD_CLAIMS.append(claim)
            chosen.append(stack.enter_context(sock))
        while len(chosen) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            chosen.append(stack.enter_context(sock))
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in chosen]


def kv_event_endpoints(replica_id: str, node_ip: str,
                       environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], dict[str, str]]:
    """(the publisher's endpoints, the endpoints the replica advertises to routers) of a replica's KV events.

    Why not TCP everywhere: the events carry every prompt's token ids, whosever, with no authentication,
    and vLLM's publisher binds its PUB socket only to a wildcard (`tcp://*`, every interface) or a local
    endpoint; a specific address it connects to instead, and nothing listens. On a head `up` started, whose
    router runs on the same machine, the sockets are `ipc://` files in a folder of their owner's only
    (`KV_EVENTS_IPC_DIR_ENV`, in the head's environment, which its workers inherit). Elsewhere (a pod, a
    joined node) the PUB socket binds every interface, the replay socket (the last batches on request) the
    node's address; who may reach them is the network's to say (k8s/README.md).
    """
    folder = _private_folder(environ.get(KV_EVENTS_IPC_DIR_ENV))
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", replica_id)
    if folder is not None and len(f"{folder}/{name}.replay") <= MAX_IPC_PATH_CHARS:
        endpoints = {"endpoint": f"ipc://{folder}/{name}.pub", "replay_endpoint": f"ipc://{folder}/{name}.replay"}
        return endpoints, {"kv_events_endpoint": endpoints["endpoint"],
                           "kv_events_replay_endpoint": endpoints["replay_endpoint"]}
    port, replay_port = free_kv_event_ports(2)
    replay_host = "*" if ":" in node_ip else node_ip  # vLLM's publisher opens IPv4 sockets only
    return ({"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://{replay_host}:{replay_port}"},
            {"kv_events_endpoint": f"tcp://{node_ip}:{port}", "kv_events_replay_endpoint": f"tcp://{node_ip}:{replay_port}"})


def _private_folder(path: str | None) -> Path | None:
    """`path` as a folder of this user's only (made so where missing); None where unset, or where it is another
    user's or something other than a folder (a link planted in a shared temporary folder)."""
    if not path:
        return None
    folder = Path(path)
    with contextlib.suppress(OSError):  # there already, or not to be made (its parent missing): judged below
        folder.mkdir(mode=0o700)
    try:
        info = folder.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return None
        if stat.S_IMODE(info.st_mode) != 0o700:
            folder.chmod(0o700)
    except OSError:
        return None
    return folder
