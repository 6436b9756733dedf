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
import socket
import tempfile
from pathlib import Path
from typing import IO, Mapping

from cluster.serve_config import KV_EVENTS_HOST_ENV

# Above Ray's worker ports (10002-19999 by default) and below Linux's default ephemeral range (32768-60999).
CANDIDATE_PORTS = range(20000, 32768)
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = range(32768, 61000)
_MAX_TRIES = 200
# Claims held by this process (a replica): open, locked files, kept open for the process's life.
_HELD_CLAIMS: list[IO[bytes]] = []


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


def _claim(claims_dir: Path, port: int) -> tuple[bool, IO[bytes] | None]:
    """(whether no other process claims `port` in `claims_dir`, this process's claim on it: the open file holding
    the lock, or None where no claim can be made there, such as a folder this user cannot write in)."""
    try:
        if not claims_dir.is_dir():
            claims_dir.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                claims_dir.chmod(0o1777)  # every user's replicas claim there; only a file's owner removes it
        claim = open(claims_dir / str(port), "ab")
    except OSError:
        return True, None
    try:
        fcntl.flock(claim.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        claim.close()
        return False, None
    return True, claim


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
                    claim.close()
                continue
            if claim is not None:
                _HELD_CLAIMS.append(claim)
            chosen.append(stack.enter_context(sock))
        while len(chosen) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            chosen.append(stack.enter_context(sock))
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in chosen]


def kv_event_endpoints(port: int, replay_port: int, node_ip: str,
                       environ: Mapping[str, str] = os.environ) -> tuple[dict[str, str], dict[str, str]]:
    """(the publisher's bind endpoints, the endpoints the replica advertises to routers) of a replica's ports.

    Why bound to one address: the events carry every prompt's token ids, whosever, with no authentication;
    bound to every interface (`tcp://*`), any host that reached the machine read every tenant's prompts.
    They bind the address the routers connect to: the node's (Ray's), or `KV_EVENTS_HOST_ENV`'s. An IPv6
    address stays `*` (vLLM's publisher opens IPv4 sockets only).
    """
    host = environ.get(KV_EVENTS_HOST_ENV) or node_ip
    bind = "*" if ":" in host else host
    return ({"endpoint": f"tcp://{bind}:{port}", "replay_endpoint": f"tcp://{bind}:{replay_port}"},
            {"kv_events_endpoint": f"tcp://{host}:{port}", "kv_events_replay_endpoint": f"tcp://{host}:{replay_port}"})
