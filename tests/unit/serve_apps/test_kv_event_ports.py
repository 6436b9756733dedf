"""The replica's KV-event ports: free, distinct, and outside the range outgoing connections take ports from."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

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


def _received(endpoints: dict[str, str]) -> list:
    """What a router's source gets of vLLM's own publisher set up with `endpoints` (bound as vLLM binds them)."""
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from router.events import ZmqEventSource

    publisher = ZmqEventPublisher(data_parallel_rank=0, topic="", **endpoints[0])
    source = ZmqEventSource(endpoints[1]["kv_events_endpoint"], topic="",
                            replay_endpoint=endpoints[1]["kv_events_replay_endpoint"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            if received := source.poll_batches(16):
                return received
            time.sleep(0.02)
        return []
    finally:
        source.close()
        publisher.shutdown()


def test_on_a_local_head_the_events_are_sockets_in_a_folder_of_their_owners_only(tmp_path):
    """They carry every tenant's prompt tokens, unauthenticated: on `tcp://*`, any host reaching the machine
    read them. The router runs on the same machine there."""
    folder = tmp_path / "kv"
    endpoints = kv_event_endpoints("r1", node_ip="10.1.2.3", environ={"WARMPATH_KV_EVENTS_IPC_DIR": str(folder)})
    assert endpoints[0] == {"endpoint": f"ipc://{folder}/r1.pub", "replay_endpoint": f"ipc://{folder}/r1.replay"}
    assert endpoints[1] == {"kv_events_endpoint": f"ipc://{folder}/r1.pub",
                            "kv_events_replay_endpoint": f"ipc://{folder}/r1.replay"}
    assert folder.stat().st_mode & 0o777 == 0o700
    assert _received(endpoints)


def test_elsewhere_vllms_publisher_binds_and_the_router_reaches_it_at_the_advertised_address():
    """vLLM binds a PUB endpoint only where it is a wildcard: given a specific address, it connected, and the
    router, connecting too, received nothing."""
    endpoints = kv_event_endpoints("r1", node_ip="127.0.0.1", environ={})
    assert endpoints[0]["endpoint"].startswith("tcp://*:")
    assert endpoints[0]["replay_endpoint"].startswith("tcp://127.0.0.1:")  # vLLM binds it as given
    assert endpoints[1]["kv_events_endpoint"] == endpoints[0]["endpoint"].replace("*", "127.0.0.1")
    assert _received(endpoints)


def test_a_folder_that_is_not_this_users_own_is_not_used(tmp_path):
    """A link planted in a shared temporary folder would have put the sockets wherever it pointed."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "kv").symlink_to(tmp_path / "elsewhere")
    bound, _ = kv_event_endpoints("r1", node_ip="10.1.2.3", environ={"WARMPATH_KV_EVENTS_IPC_DIR": str(tmp_path / "kv")})
    assert bound["endpoint"].startswith("tcp://*:")
    bound, _ = kv_event_endpoints("r1", node_ip="10.1.2.3", environ={"WARMPATH_KV_EVENTS_IPC_DIR": "/" + "x" * 120})
    assert bound["endpoint"].startswith("tcp://*:")  # too long a path for a socket's address
    bound, _ = kv_event_endpoints("r1", node_ip="10.1.2.3",
                                  environ={"WARMPATH_KV_EVENTS_IPC_DIR": str(tmp_path / "missing" / "kv")})
    assert bound["endpoint"].startswith("tcp://*:")  # a folder that cannot be made: the replica still starts


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_users_claim_is_honoured():
    """Claim files were opened for writing: another user's replica could not open one, and took the port as free."""
    from serve_apps import kv_event_ports

    shared = Path(tempfile.mkdtemp())
    shared.chmod(0o1777)
    try:
        (port,) = free_kv_event_ports(1, ephemeral=range(0), candidates=range(PAIR + 5, PAIR + 6), claims_dir=shared)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.write(write, repr(kv_event_ports._claim(shared, port)).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as answer:
            seen = answer.read()
        os.waitpid(child, 0)
        assert seen == "(False, None)"
    finally:
        shutil.rmtree(shared)
