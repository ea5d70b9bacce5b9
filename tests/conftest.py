"""Shared fixtures. Keep small: helpers used by several test files only."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TINY_BASE = REPO / "configs" / "tiny_cpu.yaml"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_base() -> Path:
    return TINY_BASE


@pytest.fixture(scope="session")
def cli():
    """Run ``python -m tuner.cli ARGS`` in the repo (no console script needed)."""

    def run(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tuner.cli", *map(str, args)], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=timeout, **kw)

    run.popen = lambda *args, **kw: subprocess.Popen(  # type: ignore[attr-defined]
        [sys.executable, "-m", "tuner.cli", *map(str, args)], cwd=REPO, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    return run


def processes_with(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose command line mentions ``marker``."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out


def wait_until(pred, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


@pytest.fixture(scope="session")
def no_processes_left():
    """``no_processes_left(marker, timeout)`` -> [] once every process mentioning marker is gone."""

    def check(marker: str, timeout: float = 20.0) -> list:
        wait_until(lambda: not processes_with(marker), timeout)
        return [(p.pid, " ".join(p.cmdline())[:200]) for p in processes_with(marker)]

    return check
