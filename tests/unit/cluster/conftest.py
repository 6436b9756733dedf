"""A stand-in for `ray start --head` (`cluster.local.start_ray` runs it with `subprocess.Popen`), and a way to
run a check as a user without root's powers (CI runs the tests as root, who enters every folder and binds any
port)."""

from __future__ import annotations

import itertools
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest

from cluster import local

_PIDS = itertools.count(900_001)


class RayStartStandIn:
    """`ray start`'s process: it makes a session named after its pid (when `spawns` is set, as Ray's head
    does) and ends with `returncode`, or raises `raises` from `communicate` (Ctrl-C, a timeout)."""

    def __init__(self, ray_tmp: Path, returncode: int = 0, stderr: str = "", spawns: bool = True,
                 raises: BaseException | None = None) -> None:
        self.ray_tmp, self.spawns, self.raises = ray_tmp, spawns, raises
        self.result = (returncode, stderr)
        self.commands: list[list[str]] = []
        self.environments: list[dict[str, str] | None] = []
        self.pid = 0
        self.returncode: int | None = None

    def __call__(self, cmd, **kwargs) -> "RayStartStandIn":
        self.commands.append(list(cmd))
        self.environments.append(kwargs.get("env"))
        self.pid = next(_PIDS)
        return self

    @property
    def session(self) -> str:
        return f"session_2026-12-07_10-00-00_000000_{self.pid}"

    def communicate(self, timeout=None):
        if self.spawns:
            (self.ray_tmp / "ray" / self.session).mkdir(parents=True)
        if self.raises is not None:
            raise self.raises
        self.returncode = self.result[0]
        return "", self.result[1]

    def kill(self) -> None:
        pass

    def wait(self, timeout=None) -> int:
        return self.returncode or -9


@pytest.fixture(autouse=True)
def _own_kv_events_dir(tmp_path_factory, monkeypatch):
    """`down` clears the KV-event sockets of this user's head: in a test, a folder of the test's own."""
    monkeypatch.setattr(local, "kv_events_dir", lambda: tmp_path_factory.getbasetemp() / "kv-events")


@pytest.fixture
def ray_start(tmp_path_factory, monkeypatch):
    """Makes `ray start` a `RayStartStandIn` (configure its fields); Ray's session folders in a folder of their own."""
    ray_tmp = tmp_path_factory.mktemp("ray-tmp")
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    stand_in = RayStartStandIn(ray_tmp)
    monkeypatch.setattr(local.subprocess, "Popen", stand_in)
    return stand_in


NOBODY = 65534
CANNOT_DROP_PRIVILEGES = 77
CHECK_TIMEOUT_S = 60


@pytest.fixture
def as_unprivileged() -> Callable[[Callable[[], None]], None]:
    """Runs a check as an unprivileged user: in a forked child that became `nobody` where the tests run as root,
    else in this process; a failure in the child fails the test with its traceback."""
    def run(check: Callable[[], None]) -> None:
        if os.geteuid() != 0:
            check()
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            os.close(read)
            status = 0
            try:
                try:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                except OSError:  # root without the powers to change user (a user namespace)
                    os._exit(CANNOT_DROP_PRIVILEGES)
                check()
            except BaseException:
                os.write(write, traceback.format_exc().encode())
                status = 1
            os._exit(status)
        os.close(write)
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the check as nobody did not end in {CHECK_TIMEOUT_S} s")
            time.sleep(0.01)
        with os.fdopen(read, "rb") as pipe:
            report = pipe.read().decode()
        code = os.waitstatus_to_exitcode(ended[1])
        if code == CANNOT_DROP_PRIVILEGES:
            pytest.skip("root here cannot become another user")
        assert code == 0, report

    return run
