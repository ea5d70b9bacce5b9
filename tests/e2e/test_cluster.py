"""Many ``ppotune search`` workers on one study in a REAL PostgreSQL server, directly and through
Optuna's gRPC proxy (``ppotune storage-proxy``). The server is the session's throwaway cluster
(tests/pg.py: Debian's initdb/pg_ctl in a temp dir, loopback, password auth); the trials are real
(``ppotune train`` on the tiny preset, 1 CPU process, 1 PPO step). Without a PostgreSQL server the
tests skip, saying why.

A "node" is a worker with its own ``PPOTUNE_HOST`` (the name it records as its trials' owner): to
the other workers its trials are another host's, so a dead worker is found by its stale
heartbeat after ``--grace`` seconds, as across the nodes of a cluster, not by its dead pid.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from support import REPO, TINY_BASE, processes_with, wait_until
from trainer.contracts import Status, TrialRecord, parse_storage
from tuner.rules.budget import counted
from tuner.study.storage import close_storage, open_storage

pytestmark = pytest.mark.slow

STUDY = "cluster"
# a knob that only vLLM reads (a no-op under the HF rollout): many distinct configs, every trial equally fast
SPACE = """
knobs:
  actor_rollout_ref.rollout.max_num_seqs: {type: int, low: 1, high: 1000}
"""
HEARTBEAT_S, GRACE_S = 1, 6


def start_worker(tmp_path: Path, storage: str, trials: int, i: int, *extra) -> subprocess.Popen:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    env = dict(os.environ, PYTHONPATH=str(REPO), PPOTUNE_HOST=f"node{i}")
    args = [
        *(TINY_BASE, "--space", space, "--storage", storage, "--study", STUDY, "--trials", trials),
        *("--nproc", 1, "--steps", 1, "--warmup", 0, "--seed", i, "--out", tmp_path / f"node{i}"),
        *("--heartbeat", HEARTBEAT_S, "--grace", GRACE_S, "--kill-grace", 3, "--trial-timeout", 240, "--confirm", 0),
        *("--probe", 0),  # the workers' after-search stages are not what these tests are about
        *extra,
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "tuner.cli", "search", *map(str, args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def load_trials(url: str) -> list:
    storage = open_storage(parse_storage(url), read_only=True)
    try:
        return optuna.load_study(study_name=STUDY, storage=storage).get_trials()
    finally:
        close_storage(storage)


def rec(t) -> TrialRecord:
    return TrialRecord.from_user_attrs(t.user_attrs)


def check_exact(trials: list, budget: int) -> list:
    """Exactly ``budget`` counted trials, all finished, no config measured twice. Returns them."""
    assert all(t.state.is_finished() for t in trials), [(t.number, t.state) for t in trials]
    cnt = [t for t in trials if counted(t)]
    assert len(cnt) == budget, [(t.number, rec(t).status) for t in trials]
    configs = [tuple(sorted(t.params.items())) for t in cnt]
    assert len(set(configs)) == len(configs), configs
    assert sum(1 for t in trials if rec(t).baseline and counted(t)) == 1
    return cnt


def running_trial_of(out: Path) -> int | None:
    """The number of a trial of this worker whose PPO ranks are running now: a cold trial's ranks name its
    directory; a warm job's ranks (trainer.rank.serve, under <out>/jobs) run the trial whose log exists and whose
    result does not yet."""
    for p in processes_with(str(out / "trials")):
        cmd = " ".join(p.cmdline())
        if "trainer.rank.run" in cmd:
            part = cmd.split(str(out / "trials") + "/", 1)[1]
            return int(part.split("/", 1)[0])
    if any("trainer.rank.serve" in " ".join(p.cmdline()) for p in processes_with(str(out / "jobs"))):
        running = [
            int(d.name)
            for d in (out / "trials").glob("*")
            if d.name.isdigit() and (d / "train.log").is_file() and not (d / "result.json").exists()
        ]
        return max(running) if running else None
    return None


def start_workers(tmp_path: Path, storage: str, trials: int, n: int) -> list[subprocess.Popen]:
    """``n`` workers, node0 first: the others start once node0 runs a trial, so that node0 (the one the tests kill)
    has a trial to be killed in however slowly the loaded machine starts it (it once found the budget spent)."""
    first = start_worker(tmp_path, storage, trials, 0)
    assert wait_until(lambda: running_trial_of(tmp_path / "node0") is not None or first.poll() is not None, 240)
    return [first, *(start_worker(tmp_path, storage, trials, i) for i in range(1, n))]


def kill_mid_trial(worker: subprocess.Popen, out: Path) -> tuple[int, float]:
    """SIGKILL the worker while one of its trials runs: (that trial's number, when)."""
    assert wait_until(lambda: running_trial_of(out) is not None or worker.poll() is not None, 240)
    number = running_trial_of(out)
    assert number is not None, worker.communicate()[0]
    worker.kill()
    killed_at = time.time()
    worker.wait()
    return number, killed_at


def check_recovered(trials: list, number: int, killed_at: float, dead_host: str) -> None:
    """The killed worker's trial is interrupted, re-enqueued once and run by another node after the grace period."""
    by_number = {t.number: t for t in trials}
    dead = by_number[number]
    assert dead.state == TrialState.FAIL and rec(dead).status == Status.INTERRUPTED
    assert f"on {dead_host}) died" in rec(dead).error
    (retry,) = [t for t in trials if rec(t).retry_of == number]
    assert rec(retry).status == Status.OK and retry.params == dead.params
    assert rec(retry).owner["host"] != dead_host
    # stale once the last heartbeat (about HEARTBEAT_S before the kill; later under load) is GRACE_S
    # old; a waiting worker sweeps every HEARTBEAT_S, a busy one only before its next ask, i.e. after its
    # own trial (tens of seconds on a loaded CI machine), so the upper bound is loose
    after = retry.datetime_start.timestamp() - killed_at
    assert 2.0 <= after <= GRACE_S + 120, after


# --------------------------------------------------------------------------- PostgreSQL, directly
def test_four_workers_on_postgres_reach_exactly_the_budget_and_recover_a_killed_ones_trial(
    tmp_path, postgres, no_processes_left, cli
):
    """Four nodes on one database; one is SIGKILLed mid-trial: its trial is recovered by another node after the
    grace period, the total stays exact, no ask ever races past the budget (the advisory lock), the work is
    shared, and every connection is closed (the killed worker's too). Then report and export of the study: the
    password shows in no output, file or trial log, the URL masked where it is named."""
    db = postgres.create_database()
    url = postgres.url(db)
    workers = start_workers(tmp_path, url, 8, 4)
    number, killed_at = kill_mid_trial(workers[0], tmp_path / "node0")
    outs = [w.communicate(timeout=900)[0] for w in workers[1:]]
    assert [w.returncode for w in workers[1:]] == [0, 0, 0], outs
    trials = load_trials(url)
    cnt = check_exact(trials, 8)
    check_recovered(trials, number, killed_at, "node0")
    assert any("left RUNNING by a dead tuner" in o for o in outs)
    assert not [t for t in trials if rec(t).status == Status.OVER_BUDGET]  # the advisory lock: no race at all
    assert len({rec(t).owner["host"] for t in cnt}) >= 2  # the work was shared
    assert all("lock postgresql-advisory" in o for o in outs)
    assert all(postgres.password not in o for o in outs)  # masked in every line
    assert no_processes_left(str(tmp_path / "node0"), timeout=10) == []  # the trial died with its worker
    assert postgres.wait_connections(db, at_most=0) == 0  # every worker closed its pool, the killed one's too
    assert no_processes_left(str(tmp_path), timeout=10) == []

    r1 = cli("report", "--storage", url, "--study", STUDY, "--out", tmp_path / "report")
    r2 = cli("export", "--storage", url, "--study", STUDY, "--out", tmp_path / "export")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    texts = [*outs, workers[0].stdout.read(), r1.stdout, r1.stderr, r2.stdout, r2.stderr]
    texts += [p.read_text(errors="replace") for d in ("report", "export") for p in (tmp_path / d).rglob("*")]
    texts += [p.read_text(errors="replace") for p in tmp_path.glob("node*/**/*.log")]
    assert not [t[:200] for t in texts if postgres.password in t]
    masked = f"postgresql://ppotune:***@127.0.0.1:{postgres.port}/{db}"
    assert all(masked in o for o in outs) and masked in (tmp_path / "export" / "why.md").read_text()


# --------------------------------------------------------------------------- through the gRPC proxy
def test_workers_through_the_grpc_proxy(tmp_path, postgres, storage_proxy, cli, no_processes_left):
    """Four nodes on ``grpc://``: one is SIGKILLed mid-trial; the total stays exact; report and
    export read the study through the proxy too."""
    db = postgres.create_database()
    url = postgres.url(db)
    proxy = storage_proxy(url)
    workers = start_workers(tmp_path, proxy, 6, 4)
    number, killed_at = kill_mid_trial(workers[0], tmp_path / "node0")
    outs = [w.communicate(timeout=900)[0] for w in workers[1:]]
    assert [w.returncode for w in workers[1:]] == [0, 0, 0], outs
    assert all("lock none" in o for o in outs)  # no database lock through the proxy: the rank check
    trials = load_trials(url)
    check_exact(trials, 6)
    check_recovered(trials, number, killed_at, "node0")
    assert no_processes_left(str(tmp_path / "node0"), timeout=10) == []

    r = cli("report", "--storage", proxy, "--study", STUDY, "--out", tmp_path / "report")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "report" / "report.html").is_file()
    r = cli("export", "--storage", proxy, "--study", STUDY, "--out", tmp_path / "export")
    assert r.returncode == 0, r.stdout + r.stderr
    assert proxy in (tmp_path / "export" / "why.md").read_text()


# --------------------------------------------------------------------------- errors
def test_a_bad_database_is_one_line_exit_2(tmp_path, postgres, cli):
    cases = {
        "password authentication failed": postgres.url("postgres", password="wrong-pw"),
        "Connection refused": "postgresql://ppotune:wrong-pw@127.0.0.1:1/db",
        "no storage proxy answered": "grpc://127.0.0.1:1",
    }
    for why, storage in cases.items():
        r = cli("search", TINY_BASE, "--space", "search_spaces/tiny_cpu.yaml", "--trials", 1, "--storage", storage)
        assert r.returncode == 2, (storage, r.stdout, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert why in line and parse_storage(storage).display in line, line
        assert "wrong-pw" not in r.stdout + r.stderr and postgres.password not in r.stdout + r.stderr
    r = cli("storage-proxy", "--storage", str(tmp_path / "x.db"), "--port", 1)
    assert r.returncode == 2 and "database server" in r.stderr
    with socket.socket() as s:  # a port somebody else serves
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("storage-proxy", "--storage", postgres.url("postgres"), "--host", "127.0.0.1", "--port", port)
    assert r.returncode == 1 and "Address already in use" in r.stderr and "serving" not in r.stdout


# --------------------------------------------------------------------------- the load test, small
def test_load_benchmark_loses_and_duplicates_nothing(tmp_path):
    """benchmarks/bench_storage.py at a small size: its own throwaway server, PostgreSQL and proxy."""
    pytest.importorskip("psycopg")
    out = tmp_path / "rows.json"
    r = subprocess.run(
        [sys.executable, "benchmarks/bench_storage.py", "--workers", "3", "--trials-per-worker", "4", "--json", out],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "PostgreSQL server binaries" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert [row["storage"] for row in rows] == ["postgresql", "grpc"]
    for row in rows:
        assert row["counted"] == row["budget"] == 12 and row["lost"] == 0 and row["configs_measured_twice"] == 0
        assert row["unfinished"] == 0 and row["connections_left"] == 0 and not row["failed_workers"]
        assert row["trials_per_s"] > 0


def test_storage_proxy_stops_on_sigterm(postgres, storage_proxy):
    proxy = storage_proxy(postgres.url(postgres.create_database()))
    (p,) = storage_proxy.procs
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 143
    assert "stopped" in p.stdout.read()
    assert proxy.startswith("grpc://127.0.0.1:")
