"""`warmpath down` stops vLLM engine processes orphaned by killed replicas, and only those."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.local import reap_orphaned_engines

ORPHAN = """
import os, sys, time, setproctitle
if os.fork():
    os._exit(0)  # the parent exits: the child is re-parented, like an engine whose replica was killed
setproctitle.setproctitle(sys.argv[1])
print(os.getpid(), flush=True)
time.sleep(120)
"""


def _spawn_orphan(title: str) -> int:
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN, title], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())  # the orphan keeps the pipe open: read its line, not to EOF
    proc.wait(timeout=30)
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0] != title.encode():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return pid


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_orphaned_engines_are_reaped_and_other_processes_are_not():
    engine = _spawn_orphan("VLLM::EngineCore")
    bystander = _spawn_orphan("some-other-daemon")
    try:
        if _ppid(engine) != 1:
            pytest.skip("orphans are re-parented to a subreaper here, not to init")
        reaped = reap_orphaned_engines()
        assert engine in reaped and bystander not in reaped
        deadline = time.monotonic() + 10
        while _alive(engine):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _alive(bystander)
    finally:
        for pid in (engine, bystander):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
