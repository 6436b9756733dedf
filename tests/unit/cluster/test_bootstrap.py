"""`cluster/bootstrap.sh` refuses what would fail minutes later, before installing anything."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BASH = shutil.which("bash") or "/bin/bash"  # found here: a test may run the script with a PATH that has no bash


def _bootstrap(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(ROOT / "cluster" / "bootstrap.sh"), *args], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT), **env})


def test_a_python_other_than_3_11_is_refused_as_a_set_up_failure_before_installing():
    """pip refuses the package on another Python; its retry then blamed torch's build, on every run."""
    result = _bootstrap("install", env={"PYTHON": "/bin/false"})
    assert result.returncode == 10
    assert "/bin/false is not Python 3.11" in result.stderr and "installing" not in result.stderr


def test_an_unknown_command_is_refused_before_anything():
    result = _bootstrap("serve", env={})
    assert result.returncode == 2 and "unknown command 'serve'" in result.stderr


def _imports_this_checkout(checkout: Path, venv: str) -> bool:
    lines = (ROOT / "cluster" / "bootstrap.sh").read_text().splitlines()
    start = lines.index("venv_imports_this_checkout() {")
    function = "\n".join(lines[start:lines.index("}", start) + 1])
    script = f"VENV={venv}\n{function}\nvenv_imports_this_checkout"
    return subprocess.run(["bash", "-c", script], cwd=checkout, timeout=60).returncode == 0


def test_a_venv_made_for_a_checkout_elsewhere_is_told_apart(tmp_path):
    """A venv moved or copied with its checkout imports warmpath from where it was made: every run failed there,
    or ran the other checkout's code, and its fresh stamp kept it."""
    venv = ROOT / ".venv"
    if not (venv / "bin" / "python").exists():
        pytest.skip("no .venv in this checkout")
    assert _imports_this_checkout(ROOT, ".venv") and _imports_this_checkout(ROOT, str(venv))
    copy = tmp_path / "copy"
    (copy / "cluster").mkdir(parents=True)
    (copy / "cluster" / "__init__.py").write_text("")
    (copy / ".venv").symlink_to(venv)
    assert not _imports_this_checkout(copy, ".venv")


def test_no_python_on_path_is_said_as_such(tmp_path):
    """It said "python3 is not Python 3.11" where there was no python3 at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to("/usr/bin/dirname")
    result = _bootstrap("install", env={"PATH": str(bin_dir)})
    assert result.returncode == 10 and "no Python 3.11 found" in result.stderr, result.stderr


def test_a_venv_of_the_users_own_is_refused_not_deleted(tmp_path):
    """WARMPATH_VENV naming a venv of another Python was deleted (`rm -rf`) and made again."""
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv in this checkout")
    venv = tmp_path / "my-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # not Python 3.11
    (venv / "bin" / "python").chmod(0o755)
    result = _bootstrap("install", env={"PYTHON": str(python), "WARMPATH_VENV": str(venv)})
    assert result.returncode == 10 and "this script did not make it" in result.stderr, result.stderr
    assert (venv / "bin" / "python").is_file()


def test_a_venv_of_the_users_own_whose_python_was_removed_is_refused_not_deleted(tmp_path):
    """Its python a link to a removed interpreter (an uninstalled pyenv version): it passed as no venv, `venv`
    failed over it, and the failure's clean-up deleted the user's folder."""
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv in this checkout")
    venv = tmp_path / "my-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(tmp_path / "removed" / "python3.11")
    (venv / "mine.py").write_text("x = 1\n")
    result = _bootstrap("install", env={"PYTHON": str(python), "WARMPATH_VENV": str(venv)})
    assert result.returncode == 10 and "does not run" in result.stderr, result.stderr
    assert (venv / "mine.py").is_file() and (venv / "bin" / "python").is_symlink()


def test_a_venv_of_the_users_own_installed_into_from_another_checkout_is_kept(tmp_path):
    """Two checkouts sharing the user's venv: the second's run deleted it (`rm -rf`), the user's own packages
    with it, as a venv this script had made for a checkout elsewhere."""
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv in this checkout")
    venv = tmp_path / "my-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")  # stops the run at the next check
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".warmpath-installed").write_text("")  # installed into from another checkout, not made here
    (venv / "mine.py").write_text("x = 1\n")
    result = _bootstrap("install", env={"PYTHON": str(python), "WARMPATH_VENV": str(venv)})
    assert "installing this one into it" in result.stderr and "recreating" not in result.stderr, result.stderr
    assert (venv / "mine.py").is_file()


def test_a_folder_venv_cannot_be_made_in_is_left_as_it_was_found(tmp_path):
    """WARMPATH_VENV naming a folder of the user's where `python -m venv` fails: the clean-up deleted it."""
    venv = tmp_path / "my-folder"
    venv.mkdir()
    (venv / "notes.txt").write_text("mine\n")
    (venv / "bin").write_text("a file where venv puts a folder\n")
    python = shutil.which("python3.11") or str(ROOT / ".venv" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip("no Python 3.11 here")
    result = _bootstrap("install", env={"PYTHON": python, "WARMPATH_VENV": str(venv)})
    assert result.returncode == 10 and "could not create" in result.stderr, result.stderr
    assert (venv / "notes.txt").read_text() == "mine\n"


def _install_redis(cmd: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """bootstrap's `install_redis` alone, as a user without root on a machine without redis-server."""
    lines = (ROOT / "cluster" / "bootstrap.sh").read_text().splitlines()
    start = lines.index("install_redis() {")
    function = "\n".join(lines[start:lines.index("}", start) + 1])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")
    (bin_dir / "id").chmod(0o755)
    script = f"say() {{ printf '%s\\n' \"$*\" >&2; }}\nSETUP_FAILED=10\n{function}\ninstall_redis {cmd}\necho done"
    return subprocess.run([BASH, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": str(bin_dir)})


def test_up_without_redis_server_goes_on_for_a_config_that_names_a_redis(tmp_path):
    """A config file's `redis_url` (which only `warmpath up` reads) was no way past the missing redis-server."""
    up = _install_redis("up", tmp_path)
    assert up.returncode == 0 and up.stdout.strip() == "done" and "unless the config names a redis_url" in up.stderr
    test = _install_redis("test", tmp_path)
    assert test.returncode == 10 and "the tests start redis-servers of their own" in test.stderr
