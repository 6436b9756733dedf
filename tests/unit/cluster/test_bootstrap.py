"""`cluster/bootstrap.sh` refuses what would fail minutes later, before installing anything."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _bootstrap(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "cluster" / "bootstrap.sh"), *args], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **env})


def test_a_python_other_than_3_11_is_refused_as_a_set_up_failure_before_installing():
    """pip refuses the package on another Python; its retry then blamed torch's build, on every run."""
    result = _bootstrap("install", env={"PYTHON": "/bin/false"})
    assert result.returncode == 10
    assert "/bin/false is not Python 3.11" in result.stderr and "installing" not in result.stderr


def test_an_unknown_command_is_refused_before_anything():
    result = _bootstrap("serve", env={})
    assert result.returncode == 2 and "unknown command 'serve'" in result.stderr
