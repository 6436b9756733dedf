"""Whether a command can write its output file, asked before the work that produces it.

Why a module of its own: every command that writes results (`warmpath simulate`, `bench`,
`render`, `bench/router_decision.py`) checks its output path first, so a long run never
ends in a path error that loses what it computed, and they all say the same thing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def unwritable_file_problem(path: Path, option: str = "--out") -> Optional[str]:
    """One line saying why `path` cannot be written as a file, or None when it can.

    Creates missing parent folders (the write would). Leaves an existing file's content as is
    and removes a file it created to probe; never opens a FIFO or device just to probe it.
    """
    if path.is_dir():
        return f"{option} {path} is a directory; give a file path"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{option} {path}: {ancestor} is not a directory"
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not existed or path.is_file():
            with path.open("a"):
                pass
    except OSError as err:
        return f"{option} {path} cannot be written ({err.strerror or err})"
    if not existed:
        path.unlink(missing_ok=True)
    return None
