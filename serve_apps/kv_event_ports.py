"""The TCP ports a replica's engine publishes its KV events on.

Why its own module: the replica chooses the ports when it starts and the engine binds them
minutes later, once its model is loaded. A port the kernel hands out for `bind(0)` comes from
its ephemeral range, the range every outgoing connection (Ray's, Redis's, a model download's)
takes its local port from, so one of those could hold it by then: the engine's bind failed and
Ray restarted the replica. Ports below that range are only ever taken by an explicit bind.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

# Above Ray's worker ports (10002-19999 by default) and below Linux's default ephemeral range (32768-60999).
CANDIDATE_PORTS = range(20000, 32768)
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = range(32768, 61000)
_MAX_TRIES = 200


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


def free_kv_event_ports(count: int, ephemeral: range | None = None,
                        candidates: range = CANDIDATE_PORTS) -> list[int]:
    """`count` distinct ports free now and outside the ephemeral range, where there are any.

    Each chosen port stays bound until all are chosen, so none comes twice. Where every
    candidate is in the ephemeral range (a host that widened it) or taken, the kernel
    chooses, as before.
    """
    ephemeral = ephemeral_ports() if ephemeral is None else ephemeral
    outside = [port for port in candidates if port not in ephemeral]
    rng = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        chosen: list[socket.socket] = []
        for _ in range(_MAX_TRIES if outside else 0):
            if len(chosen) == count:
                break
            sock = _bound_socket(rng.choice(outside))
            if sock is not None:
                chosen.append(stack.enter_context(sock))
        while len(chosen) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            chosen.append(stack.enter_context(sock))
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in chosen]
