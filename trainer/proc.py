"""Process plumbing shared by the launcher, the ranks and the tuner's reaper (no torch)."""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

__all__ = ["prctl", "die_with_parent", "write_json_atomic", "PR_SET_PDEATHSIG", "PR_SET_CHILD_SUBREAPER"]

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg: int) -> bool:
    """Linux ``prctl(2)``; False where it is unavailable."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent dies, even by SIGKILL."""
    return prctl(PR_SET_PDEATHSIG, signum)


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON through a temporary file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
