"""bench.bounds_feed: the bounds computed in a child process equal the bounds computed in line."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time

import pytest

from bench.bounds_feed import BoundsProcess, SessionBounds, shared_prefix
from bench.sim_cost import GPU_PROFILE
from bench.simulator import simulate
from bench.workloads import default_params, generate


def h(name: str) -> bytes:
    return hashlib.md5(name.encode()).digest()


@pytest.mark.parametrize(
    ("previous", "chain", "expected"),
    [
        ([], ["a"], 0),
        (["a", "b"], ["a", "b", "c"], 2),  # the next turn extends the last
        (["a", "b", "c"], ["a", "b"], 2),
        (["a", "b", "c"], ["a", "x", "y"], 1),  # a compressed context keeps the system prompt
        (["a", "b"], ["x", "y"], 0),
        (["a", "b", "c"], ["a", "b", "c"], 3),
    ],
)
def test_shared_prefix(previous, chain, expected):
    assert shared_prefix(previous, chain) == expected


def _random_feed(rng: random.Random, num_ops: int) -> list[tuple]:
    """Sessions that grow, get compressed, cache their responses and end, interleaved."""
    ops: list[tuple] = []
    chains: dict[str, list[bytes]] = {}
    for i in range(num_ops):
        session = f"s{rng.randrange(6)}"
        chain = chains.get(session, [h("system"), h(f"{session}/task")])
        roll = rng.random()
        if roll < 0.1:
            ops.append(("end", session))
            chains.pop(session, None)
            continue
        if roll < 0.2:
            chain = chain[:1] + [h(f"{session}/summary/{i}")]  # compression keeps only the system prompt
        chain = chain + [h(f"{session}/{i}/{j}") for j in range(rng.randrange(4))]
        ops.append(("observe", session, chain, 4 * len(chain) + 1))
        if rng.random() < 0.6:
            chain = chain + [h(f"{session}/{i}/out")]
            ops.append(("cache", session, chain))
        chains[session] = chain
    return ops


def _replay(feed, ops):
    for op in ops:
        getattr(feed, op[0])(*op[1:])
    return feed.result()


@pytest.mark.parametrize("seed", range(3))
def test_the_child_process_computes_the_bounds_computed_in_line(seed):
    ops = _random_feed(random.Random(seed), 300)
    expected = _replay(SessionBounds(4, 3, 12), ops)
    with BoundsProcess(4, 3, 12) as feed:
        assert _replay(feed, ops) == expected
        assert feed.cpu_s > 0  # the child's CPU, which a simulation counts in its own
    assert 0 < expected.placed_hit_rate <= expected.infinite_hit_rate < 1


def test_a_simulation_gets_the_same_bounds_from_either_feed():
    # Small caches, so the placed bound evicts: a differing request order would show.
    profile = dataclasses.replace(GPU_PROFILE, kv_capacity_blocks=400)
    workload = generate("coding", 0, 2, params=default_params("coding", "gpu"), num_sessions=4)
    in_line = simulate("warmpath", 2, profile, workload=workload, with_bounds=True)
    child = simulate("warmpath", 2, profile, workload=workload, with_bounds=True, bounds_process=True)
    assert child.bounds == in_line.bounds
    assert child.cpu_s > 0 and in_line.cpu_s > 0
    assert in_line.bounds.placed_hit_rate < in_line.bounds.infinite_hit_rate  # capacity binds
    assert child.summary == in_line.summary


def test_a_failure_in_the_child_is_raised_with_its_cause():
    feed = BoundsProcess(4, 2, 10)
    feed.cache("never-sent", [h("a")])  # a response of a session that sent no request
    with pytest.raises(RuntimeError, match="bounds process failed: KeyError"):
        feed.result()


def test_close_stops_a_child_that_was_never_asked_for_a_result():
    feed = BoundsProcess(4, 2, 10)
    feed.observe("s", [h("a")], 5)
    feed.close()
    assert not feed._process.is_alive()


_HOLDER = """
import hashlib, sys, time
from bench.bounds_feed import BoundsProcess
feed = BoundsProcess(16, 4, 1000)
feed.observe("s", [hashlib.md5(b"x").digest()], 20, 0)
print(feed._process.pid, flush=True)
time.sleep(60)
"""


def test_the_child_ends_quietly_when_its_parent_dies():
    """A grid worker killed (out of memory, Ctrl-C's clean-up) left the child printing EOFError and BrokenPipeError
    tracebacks."""
    import os
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.getcwd()}, text=True)
    child = int(holder.stdout.readline())
    os.kill(holder.pid, signal.SIGKILL)
    _, stderr = holder.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while _runs(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _runs(child)
    assert "Traceback" not in stderr, stderr


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_child_leaves_a_terminals_interrupt_to_its_parent():
    """Ctrl-C reaches the whole process group: the child printed a KeyboardInterrupt traceback; its parent stops it."""
    import multiprocessing
    import signal

    from bench import bounds_feed

    ours, theirs = multiprocessing.Pipe()
    theirs.close()  # a parent gone: the child returns, nothing to report to
    import gc

    before, was_collecting = signal.getsignal(signal.SIGINT), gc.isenabled()
    try:
        bounds_feed._serve(ours, 16, 2, 10)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
        if was_collecting:  # the child turns the collector off for good: this is not a child
            gc.enable()
