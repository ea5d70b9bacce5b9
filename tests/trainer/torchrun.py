"""Run a test worker script under torchrun, the way every multi-rank test here does.

Plain (no pytest, no optuna): the GPU script imports it on a machine that has neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path | str, *args, nproc: int, env: dict | None = None, timeout: int = 900):
    """``torchrun --standalone --nproc_per_node=nproc script args`` from the repository root; asserts it exited 0.

    The worker runs as a script: the repository root goes on PYTHONPATH so the packages under test
    import whatever is installed.
    """
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
        + [str(a) for a in args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
