"""Shared fixtures (plain helpers are in support.py). Keep small: only what several test files use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
for p in (str(REPO), str(TESTS)):  # the packages under test, and tests/support.py for every test directory
    if p not in sys.path:
        sys.path.insert(0, p)

from support import TINY_BASE, processes_with, wait_until  # noqa: E402


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
        return subprocess.run(
            [sys.executable, "-m", "tuner.cli", *map(str, args)],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    run.popen = lambda *args, **kw: subprocess.Popen(  # type: ignore[attr-defined]
        [sys.executable, "-m", "tuner.cli", *map(str, args)],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )
    return run


@pytest.fixture(scope="session")
def no_processes_left():
    """``no_processes_left(marker, timeout)`` -> [] once every process mentioning marker is gone."""

    def check(marker: str, timeout: float = 20.0) -> list:
        wait_until(lambda: not processes_with(marker), timeout)
        return [(p.pid, " ".join(p.cmdline())[:200]) for p in processes_with(marker)]

    return check


@pytest.fixture(scope="session")
def real_search(tmp_path_factory, cli) -> Path:
    """A real 4-trial search on CPU with the shipped tiny space (--report): one per session, read by
    the report, export and notebook tests."""
    out = tmp_path_factory.mktemp("real_search")
    r = cli(
        "search",
        "configs/tiny_cpu.yaml",
        "--space",
        "search_spaces/tiny_cpu.yaml",
        "--trials",
        4,
        "--nproc",
        2,
        "--steps",
        2,
        "--warmup",
        1,
        "--out",
        out,
        "--report",
        timeout=1800,
    )
    assert r.returncode == 0, f"search failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out
