"""Study bookkeeping on real Optuna storages, one suite for every storage we support (optuna's
``pytest_storages`` pattern): SQLite file, journal file, a real PostgreSQL server (tests/pg.py:
the session's throwaway cluster, a fresh database per test) and Optuna's gRPC proxy in front of
it (``ppotune storage-proxy``). Without a PostgreSQL server the last two skip, saying why."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from support import REPO
from trainer.contracts import (
    CONSTRAINT_KEY,
    STUDY_SCHEMA_VERSION,
    Status,
    StorageError,
    StorageSpec,
    TrialRecord,
    parse_storage,
)
from tuner.rules.budget import count_progress, counted
from tuner.study import lifecycle as st
from tuner.study import storage as st_storage
from tuner.study.storage import close_storage, open_storage, trial_id

STORAGE_KINDS = ["sqlite", "journal", "postgresql", "grpc"]
P = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


@pytest.fixture(params=STORAGE_KINDS)
def spec(request, tmp_path) -> StorageSpec:
    """Where this test's study lives (a fresh file, database or proxy per test)."""
    kind = request.param
    if kind in ("sqlite", "journal"):
        return parse_storage(str(tmp_path / ("study.db" if kind == "sqlite" else "study.log")))
    url = request.getfixturevalue("pg_url")
    return parse_storage(url if kind == "postgresql" else request.getfixturevalue("storage_proxy")(url))


def new_study(spec: StorageSpec, name: str = "s"):
    lock = st.StudyLock(spec.lock_path)

    def setup(study):
        study.enqueue_trial({P: 2}, user_attrs={"baseline": True})
        study.set_user_attr(st.SCHEMA_ATTR, STUDY_SCHEMA_VERSION)

    study, storage, created = st.open_study(
        spec, name, lock, sampler=optuna.samplers.RandomSampler(seed=0), setup=setup
    )
    return study, storage, created


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_default_study_name():
    assert st.default_study_name("configs/tiny_cpu.yaml", "search_spaces/default.yaml") == "tiny_cpu--default"


# --------------------------------------------------------------------------- creation
def test_open_study_sets_up_once(spec):
    study, _, created = new_study(spec)
    assert created and study.user_attrs[st.SCHEMA_ATTR] == STUDY_SCHEMA_VERSION
    again, _, created2 = new_study(spec)
    assert not created2
    waiting = again.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs["baseline"] is True
    assert [d.name for d in again.directions] == ["MAXIMIZE", "MINIMIZE"]


def test_two_processes_creating_one_fresh_study_do_not_race(spec):
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        import optuna
        from tuner.study import lifecycle as st
        from trainer.contracts import STUDY_SCHEMA_VERSION, parse_storage
        spec = parse_storage({spec.url!r})

        def setup(study):
            study.enqueue_trial({{{P!r}: 2}}, user_attrs={{"baseline": True}})
            study.set_user_attr(st.SCHEMA_ATTR, STUDY_SCHEMA_VERSION)

        st.open_study(spec, "s", st.StudyLock(spec.lock_path), sampler=optuna.samplers.RandomSampler(seed=0),
                      setup=setup)
        print("ok")
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    study, _, _ = new_study(spec)
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1  # one baseline, enqueued once


# --------------------------------------------------------------------------- counting, telling
def test_finish_records_constraints_values_and_states(spec):
    study, _, _ = new_study(spec)
    statuses = [s for s in Status if s != Status.INTERRUPTED]
    for i, status in enumerate(statuses):
        trial = study.ask()
        trial.suggest_categorical(P, [1, 2, 4])
        values = (100.0 + i, 1.5) if status == Status.OK else (0.0, 64.0) if status.complete else None
        st.finish(study, trial, TrialRecord(status=status, duration_s=1.0), values=values)
    trials = {t.user_attrs["status"]: t for t in study.get_trials()}
    assert trials["ok"].state == TrialState.COMPLETE and trials["ok"].constraints == {CONSTRAINT_KEY: -1.0}
    for s in ("oom", "inferred_oom", "predicted_oom", "hang"):
        assert trials[s].state == TrialState.COMPLETE
        assert trials[s].constraints == {CONSTRAINT_KEY: 1.0}
        assert trials[s].values == [0.0, 64.0]
    for s in ("crash", "invalid", "duplicate", "over_budget"):
        assert trials[s].state == TrialState.FAIL
    # the Pareto front holds only the feasible trial
    assert [t.user_attrs["status"] for t in study.best_trials] == ["ok"]
    # the duplicate, the inferred and the predicted OOM and the over-budget ask are not counted; the invalid
    # one (1 s: launched, exit 2) is
    assert count_progress(study.get_trials()) == len(statuses) - 4


def test_finish_tells_the_graded_constraint_and_rejections_complete(spec):
    """COMPLETE whenever there are values: a graded constraint from the record; an invalid config refused
    before launch and a duplicate of a finished trial are COMPLETE too (TPE learns from them), not counted."""
    study, _, _ = new_study(spec)
    told = [
        (TrialRecord(status=Status.OK, duration_s=5.0, constraint=-0.75), (300.0, 2.0)),
        (TrialRecord(status=Status.OOM, duration_s=5.0, constraint=1.8, oom_phase="gen"), (0.0, 64.0)),
        (TrialRecord(status=Status.INVALID, duration_s=0.0, constraint=4.0), (0.0, 64.0)),
        (TrialRecord(status=Status.DUPLICATE, duration_s=0.0, duplicate_of=0, constraint=-0.75), (300.0, 2.0)),
        (TrialRecord(status=Status.DUPLICATE, duration_s=0.0, duplicate_of=1), None),  # a running twin: FAIL
    ]
    for record, values in told:
        trial = study.ask()
        trial.suggest_int("log2:" + P, 0, 2)
        st.finish(study, trial, record, values=values)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4 + [TrialState.FAIL]
    assert [t.constraints.get(CONSTRAINT_KEY) for t in trials[:4]] == [-0.75, 1.8, 4.0, -0.75]
    assert [t.user_attrs.get("constraint") for t in trials] == [-0.75, 1.8, 4.0, -0.75, None]
    assert trials[3].values == trials[0].values
    assert [counted(t) for t in trials] == [True, True, False, False, False]
    # to Optuna the duplicate is the same point again (on its front beside its twin); the report's front,
    # which reads the status, leaves copies out (tuner.results.view.measured_feasible)
    assert [t.number for t in study.best_trials] == [0, 3]


def test_counted():
    def ft(state, **ua):
        return optuna.trial.create_trial(
            state=state, values=[1.0, 1.0] if state == TrialState.COMPLETE else None, user_attrs=ua
        )

    assert counted(ft(TrialState.COMPLETE, status="ok"))
    assert counted(ft(TrialState.FAIL, status="crash"))
    assert counted(ft(TrialState.RUNNING))
    assert not counted(ft(TrialState.WAITING))
    assert not counted(ft(TrialState.FAIL, status="interrupted"))
    assert not counted(ft(TrialState.FAIL, status="duplicate", duplicate_of=0))
    assert not counted(ft(TrialState.COMPLETE, status="duplicate", duplicate_of=0))
    assert not counted(ft(TrialState.COMPLETE, status="ok", confirm_of=3))
    # rejected before launch: not counted; an invalid config that was launched (exit 2) is
    assert not counted(ft(TrialState.COMPLETE, status="inferred_oom", inferred_from=1, duration_s=0.0))
    assert not counted(ft(TrialState.COMPLETE, status="invalid", duration_s=0.0))
    assert counted(ft(TrialState.FAIL, status="invalid", duration_s=6.5, returncode=2))


# --------------------------------------------------------------------------- resume
def test_stale_sweep_interrupts_and_reenqueues(spec):
    study, storage, _ = new_study(spec)
    dead = study.ask()  # pops the enqueued baseline
    dead.suggest_categorical(P, [1, 2, 4])
    dead.set_user_attr("owner", {"host": st.owner_info()["host"], "pid": dead_pid(), "started": 1.0})
    alive = study.ask()
    alive.suggest_categorical(P, [1, 2, 4])
    alive.set_user_attr("owner", st.owner_info())
    remote_fresh = study.ask()
    remote_fresh.set_user_attr("owner", {"host": "elsewhere", "pid": 1, "started": 1.0})
    remote_fresh.set_user_attr("heartbeat", time.time())
    remote_old = study.ask()
    remote_old.set_user_attr("owner", {"host": "elsewhere", "pid": 1, "started": 1.0})
    remote_old.set_user_attr("heartbeat", time.time() - 3600)

    swept = st.sweep_stale(study, storage)
    assert sorted(swept) == sorted([dead.number, remote_old.number])
    trials = study.get_trials()
    for n in swept:
        t = trials[n]
        assert t.state == TrialState.FAIL and t.user_attrs["status"] == "interrupted"
        assert "died" in t.user_attrs["error"]
    assert trials[alive.number].state == TrialState.RUNNING
    assert trials[remote_fresh.number].state == TrialState.RUNNING
    retries = study.get_trials(states=(TrialState.WAITING,))
    assert sorted(r.user_attrs["retry_of"] for r in retries) == sorted(swept)
    retry_of_dead = next(r for r in retries if r.user_attrs["retry_of"] == dead.number)
    assert retry_of_dead.user_attrs["baseline"] is True  # the baseline stays the baseline
    # the retry really gets the same params when asked
    t = study.ask()
    assert t.number == retry_of_dead.number
    assert t.suggest_categorical(P, [1, 2, 4]) == dead.params[P]


def test_concurrent_sweepers_enqueue_one_retry(spec):
    study_a, storage_a, _ = new_study(spec)
    study_b, storage_b, _ = new_study(spec)  # a second process's view (own storage object)
    t = study_a.ask()
    t.suggest_categorical(P, [1, 2, 4])
    t.set_user_attr("owner", {"host": st.owner_info()["host"], "pid": dead_pid(), "started": 1.0})
    frozen_a = study_a.get_trials()[t.number]
    frozen_b = study_b.get_trials()[t.number]
    won = [st.interrupt(study_a, storage_a, frozen_a, "a"), st.interrupt(study_b, storage_b, frozen_b, "b")]
    assert won == [True, False]
    retries = study_a.get_trials(states=(TrialState.WAITING,))
    assert [r.user_attrs.get("retry_of") for r in retries] == [t.number]


def test_heartbeat_thread(spec):
    study, storage, _ = new_study(spec)
    t = study.ask()
    hb = st.Heartbeat(storage, interval_s=0.2)
    hb.add(trial_id(storage, study, t.number))
    hb.start()
    time.sleep(0.8)
    hb.stop()
    beat = study.get_trials()[t.number].user_attrs.get("heartbeat")
    assert beat is not None and time.time() - beat < 5


def test_study_lock_excludes_other_processes(tmp_path):
    lock = st.StudyLock(tmp_path / "x.lock")
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from tuner.study.lifecycle import StudyLock
        lock = StudyLock(Path({str(tmp_path / "x.lock")!r}))
        print("ready", flush=True)  # imports done: what follows is the wait for the lock alone
        t = time.monotonic()
        with lock():
            print(round(time.monotonic() - t, 2))
    """)
    with lock():
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.5)
    waited = float(p.communicate(timeout=60)[0])
    assert waited >= 0.5  # it blocked until we released


def test_interrupt_keeps_what_was_measured_and_what_was_asked(spec):
    study, storage, _ = new_study(spec)
    t = study.ask()  # the enqueued baseline
    t.suggest_categorical(P, [1, 2, 4])
    t.set_user_attr("baseline", True)
    frozen = study.get_trials()[t.number]
    measured = TrialRecord(duration_s=3.5, log_path="x/train.log", engine="ppotune")  # baseline=False by default
    assert st.interrupt(study, storage, frozen, "stopped", measured=measured)
    after = TrialRecord.from_user_attrs(study.get_trials()[t.number].user_attrs)
    assert after.status == Status.INTERRUPTED and after.error == "stopped"
    assert after.duration_s == 3.5 and after.log_path == "x/train.log" and after.baseline is True
    (retry,) = study.get_trials(states=(TrialState.WAITING,))
    assert TrialRecord.from_user_attrs(retry.user_attrs).baseline is True


# --------------------------------------------------------------------------- database servers
def test_lock_kind_per_storage(spec):
    _, storage, _ = new_study(spec)
    lock = st.StudyLock(spec.lock_path).bind(storage, "s")
    expected = {"sqlite": "file", "journal": "file", "rdb": "postgresql-advisory", "grpc": "none"}[spec.kind]
    assert lock.kind == expected and lock.exact == (expected != "none")
    close_storage(storage)


def test_postgres_advisory_lock_excludes_other_processes(pg_url):
    """The budget lock on PostgreSQL lives in the database: another process (another node) waits for it."""
    spec = parse_storage(pg_url)
    _, storage, _ = new_study(spec)
    lock = st.StudyLock(None).bind(storage, "s")
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from trainer.contracts import parse_storage
        from tuner.study.storage import open_storage
        from tuner.study.lifecycle import StudyLock
        storage = open_storage(parse_storage({pg_url!r}))
        lock = StudyLock(None).bind(storage, "s")
        assert lock.kind == "postgresql-advisory", lock.kind
        print("ready", flush=True)
        t = time.monotonic()
        with lock():
            print(round(time.monotonic() - t, 2), flush=True)
    """)
    with lock():
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.5)
    waited = float(p.communicate(timeout=60)[0])
    assert p.returncode == 0 and waited >= 1.0  # it blocked until we released
    close_storage(storage)


def test_a_killed_lock_holder_releases_the_lock(pg_url):
    """A worker SIGKILLed inside the lock: the server drops its connection, and with it the lock."""
    spec = parse_storage(pg_url)
    _, storage, _ = new_study(spec)
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from trainer.contracts import parse_storage
        from tuner.study.storage import open_storage
        from tuner.study.lifecycle import StudyLock
        lock = StudyLock(None).bind(open_storage(parse_storage({pg_url!r})), "s")
        with lock():
            print("holding", flush=True)
            time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "holding"
    p.kill()
    p.wait()
    lock = st.StudyLock(None).bind(storage, "s")
    t = time.monotonic()
    with lock():
        waited = time.monotonic() - t
    assert waited < 10
    close_storage(storage)


def test_connections_are_pooled_and_closed(postgres):
    db = postgres.create_database()
    spec = parse_storage(postgres.url(db))
    study, storage, _ = new_study(spec)
    hb = st.Heartbeat(storage, interval_s=0.1)
    hb.start()
    for _ in range(20):  # threads and repeated calls reuse the pool
        t = study.ask()
        hb.add(trial_id(storage, study, t.number))
        st.finish(study, t, TrialRecord(status=Status.CRASH, duration_s=0.0))
    assert 0 < postgres.connections(db) <= st_storage.POOL_SIZE + st_storage.POOL_MAX_OVERFLOW
    hb.stop()
    close_storage(storage)
    assert postgres.wait_connections(db, at_most=0) == 0


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_optuna_heartbeat_is_recorded_on_a_database_server(postgres):
    db = postgres.create_database()
    spec = parse_storage(postgres.url(db))
    lock = st.StudyLock(None)
    study, storage, _ = st.open_study(
        spec, "s", lock, sampler=optuna.samplers.RandomSampler(), setup=_plain_setup, heartbeat_s=1, grace_s=3
    )
    assert storage.get_heartbeat_interval() == 1
    t = study.ask()
    hb = st.Heartbeat(storage, interval_s=1)
    hb.add(trial_id(storage, study, t.number))
    rows = postgres.sql("SELECT count(*) FROM trial_heartbeats", database=db)
    assert rows[0][0] == 1  # Optuna's own heartbeat row (database clock), as optimize() would keep it
    close_storage(storage)


def _plain_setup(study):
    study.set_user_attr(st.SCHEMA_ATTR, STUDY_SCHEMA_VERSION)


def test_wrong_password_is_one_line_naming_the_storage_masked(postgres):
    url = postgres.url("postgres", password="not-the-password")
    with pytest.raises(StorageError) as e:
        open_storage(parse_storage(url))
    msg = str(e.value)
    assert "\n" not in msg and "not-the-password" not in msg and postgres.password not in msg
    assert f"postgresql://ppotune:***@127.0.0.1:{postgres.port}/postgres" in msg
    assert "password authentication failed" in msg


def test_no_proxy_answering_is_one_line(monkeypatch):
    monkeypatch.setattr(st_storage, "CONNECT_TIMEOUT_S", 1)
    with pytest.raises(StorageError, match=r"grpc://127\.0\.0\.1:1: no storage proxy answered"):
        open_storage(parse_storage("grpc://127.0.0.1:1"))


def test_a_storage_file_on_a_network_file_system_is_recognised(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        "server:/export /shared nfs4 rw,relatime 0 0\n"
        "/dev/sdb1 /shared/local ext4 rw 0 0\n"
        "lfs@o2ib:/scratch /scratch lustre rw 0 0\n"
    )
    assert st_storage.network_filesystem(Path("/shared/run/study.db"), mounts=str(mounts)) == "nfs4"
    assert st_storage.network_filesystem(Path("/scratch/study.log"), mounts=str(mounts)) == "lustre"
    assert st_storage.network_filesystem(Path("/shared/local/study.db"), mounts=str(mounts)) is None  # deepest wins
    assert st_storage.network_filesystem(Path("/home/study.db"), mounts=str(mounts)) is None
    assert st_storage.network_filesystem(tmp_path / "study.db") is None  # this machine's /tmp
