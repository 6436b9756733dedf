"""The replica's KV-event ports: free, distinct, and outside the range outgoing connections take ports from."""

import socket

from serve_apps.kv_event_ports import CANDIDATE_PORTS, ephemeral_ports, free_kv_event_ports


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
