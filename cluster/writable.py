"""Whether a command can write its output file, asked before the work that produces it; and its writing.

Why a module of its own: every command that writes results (`warmpath simulate`, `bench`,
`render`, `chaos`, `bench/router_decision.py`) checks its output path first, so a long run
never ends in a path error that loses what it computed, and they all say the same thing;
and each replaces its file whole, so a failed write leaves the previous results.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional


def replace_file(path: Path, write: Callable[[Path], None]) -> None:
    """Has `write` write the file at `path`, replacing a regular file whole.

    Written beside it, then renamed over it: a process killed mid-write, or a disk
    that fills, leaves the previous results, not half a document; the file a link
    points to is the one replaced. Anything else (`/dev/stdout`, a FIFO), or a file
    in a folder this process cannot create files in, is written in place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.resolve()
    if (target.exists() and not target.is_file()) or not os.access(target.parent, os.W_OK):
        write(path)
        return
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def unwritable_file_problem(path: Path, option: str = "--out") -> Optional[str]:
    """One line saying why `path` cannot be written as a file, or None when it can.

    Creates missing parent folders (the write would). Leaves an existing file's content as is
    and removes a file it created to probe; never opens a FIFO or device just to probe it. A
    symbolic link is probed at its target (where the write goes) and is itself left in place.
    """
    try:
        return _problem(path, path.resolve(), option)
    except OSError as err:  # a folder on the way that this user may not search
        return f"{option} {path} cannot be written ({err.strerror or err})"


def _problem(path: Path, target: Path, option: str) -> Optional[str]:
    if target.is_dir():
        return f"{option} {path} is a directory; give a file path"
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{option} {path}: {ancestor} is not a directory"
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not existed or target.is_file():
            with target.open("a"):
                pass
    except OSError as err:
        return f"{option} {path} cannot be written ({err.strerror or err})"
    if not existed:
        target.unlink(missing_ok=True)
    return None
