"""The replica's KV-event ports: free, distinct, and outside the range outgoing connections take ports from."""

import socket
import subprocess
import sys

import zmq

from serve_apps.kv_event_ports import CANDIDATE_PORTS, ephemeral_ports, free_kv_event_ports, kv_event_endpoints

PAIR = 24_750  # three candidates below the ephemeral range, unused by anything this suite starts


def test_the_ports_are_distinct_free_and_outside_the_hosts_ephemeral_range():
    """The engine binds them minutes after they are chosen: a port of the ephemeral range could be any outgoing
    connection's local port by then, and the engine's bind failed (Ray restarted the replica)."""
    ephemeral = ephemeral_ports()
    for _ in range(20):
        ports = free_kv_event_ports(2)
        assert len(set(ports)) == 2
        assert all(port in CANDIDATE_PORTS and port not in ephemeral for port in ports)
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("", port))


def test_a_taken_candidate_is_never_chosen():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("", 0))
        port = taken.getsockname()[1]
        ports = free_kv_event_ports(1, ephemeral=range(0), candidates=range(port, port + 1))
    assert len(ports) == 1 and ports != [port]


def test_where_every_candidate_is_ephemeral_the_kernel_chooses():
    ports = free_kv_event_ports(2, ephemeral=range(1, 65536))
    assert len(set(ports)) == 2 and all(port > 0 for port in ports)


def test_the_ephemeral_range_is_read_from_the_kernel_or_linuxs_default(tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t50000\n")
    assert ephemeral_ports(ranges) == range(40000, 50001)
    assert ephemeral_ports(tmp_path / "missing") == range(32768, 61000)
    ranges.write_text("garbage\n")
    assert ephemeral_ports(ranges) == range(32768, 61000)


def test_a_port_another_replica_on_this_host_claimed_is_not_chosen_until_it_ends(tmp_path):
    """Two replicas choose before either engine binds: the second could draw the first's port, and its engine's
    bind failed minutes later (Ray restarted the replica)."""
    other_replica = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from serve_apps.kv_event_ports import free_kv_event_ports; "
         f"print(*free_kv_event_ports(2, ephemeral=range(0), candidates=range({PAIR}, {PAIR} + 3), "
         f"claims_dir=Path({str(tmp_path)!r})), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = {int(port) for port in other_replica.stdout.readline().split()}
        assert len(theirs) == 2
        # Free to bind (no engine bound them yet), but claimed: this replica gets the third, and claims it.
        (mine,) = free_kv_event_ports(1, ephemeral=range(0), candidates=range(PAIR, PAIR + 3), claims_dir=tmp_path)
        assert mine in range(PAIR, PAIR + 3) and mine not in theirs
    finally:
        other_replica.stdin.close()
        other_replica.wait(timeout=30)
    # Ended, the other replica's claims went with it; this one keeps its own.
    (again,) = free_kv_event_ports(1, ephemeral=range(0), candidates=range(PAIR, PAIR + 3), claims_dir=tmp_path)
    assert again in theirs


def test_the_events_bind_the_address_routers_connect_to_not_every_interface():
    """They carry every tenant's prompt tokens, unauthenticated: on `tcp://*`, any host reaching the machine read
    them. A local head's replicas bind loopback; elsewhere, the node's address."""
    bound, advertised = kv_event_endpoints(25_001, 25_002, node_ip="10.1.2.3", environ={})
    assert bound == {"endpoint": "tcp://10.1.2.3:25001", "replay_endpoint": "tcp://10.1.2.3:25002"}
    assert advertised == {"kv_events_endpoint": "tcp://10.1.2.3:25001",
                          "kv_events_replay_endpoint": "tcp://10.1.2.3:25002"}
    bound, advertised = kv_event_endpoints(25_001, 25_002, node_ip="10.1.2.3",
                                           environ={"WARMPATH_KV_EVENTS_HOST": "127.0.0.1"})
    assert bound["endpoint"] == advertised["kv_events_endpoint"] == "tcp://127.0.0.1:25001"
    bound, advertised = kv_event_endpoints(25_001, 25_002, node_ip="fd00::5", environ={})
    assert bound["endpoint"] == "tcp://*:25001"  # vLLM's publisher opens IPv4 sockets only


def test_a_publisher_bound_to_loopback_is_reached_there_only():
    (port,) = free_kv_event_ports(1)
    bound, advertised = kv_event_endpoints(port, 0, node_ip="10.1.2.3", environ={"WARMPATH_KV_EVENTS_HOST": "127.0.0.1"})
    context = zmq.Context.instance()
    with context.socket(zmq.PUB) as publisher:
        publisher.bind(bound["endpoint"])
        assert publisher.getsockopt(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            other.bind(("127.0.0.2", port))  # another address of the machine: free, where `*` would hold it
