"""Study bookkeeping on real Optuna storages (SQLite file and journal file, same suite)."""

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
from trainer.contracts import CONSTRAINT_KEY, STUDY_SCHEMA_VERSION, Status, StorageSpec, TrialRecord, parse_storage
from tuner import study as st
from tuner.decide import count_progress, counted
from tuner.storage import trial_id

STORAGE_KINDS = ["sqlite", "journal"]
P = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def spec_for(kind: str, tmp_path: Path) -> StorageSpec:
    return parse_storage(str(tmp_path / ("study.db" if kind == "sqlite" else "study.log")))


def new_study(kind: str, tmp_path: Path, name: str = "s"):
    spec = spec_for(kind, tmp_path)
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
@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_open_study_sets_up_once(kind, tmp_path):
    study, _, created = new_study(kind, tmp_path)
    assert created and study.user_attrs[st.SCHEMA_ATTR] == STUDY_SCHEMA_VERSION
    again, _, created2 = new_study(kind, tmp_path)
    assert not created2
    waiting = again.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs["baseline"] is True
    assert [d.name for d in again.directions] == ["MAXIMIZE", "MINIMIZE"]


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_two_processes_creating_one_fresh_study_do_not_race(kind, tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        import optuna
        from tuner import study as st
        from trainer.contracts import STUDY_SCHEMA_VERSION, parse_storage
        spec = parse_storage({str(tmp_path / ("study.db" if kind == "sqlite" else "study.log"))!r})

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
    study, _, _ = new_study(kind, tmp_path)
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1  # one baseline, enqueued once


# --------------------------------------------------------------------------- counting, telling
@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_finish_records_constraints_values_and_states(kind, tmp_path):
    study, _, _ = new_study(kind, tmp_path)
    statuses = [s for s in Status if s != Status.INTERRUPTED]
    for i, status in enumerate(statuses):
        trial = study.ask()
        trial.suggest_categorical(P, [1, 2, 4])
        values = (100.0 + i, 1.5) if status == Status.OK else (0.0, 64.0) if status.complete else None
        st.finish(study, trial, TrialRecord(status=status, duration_s=1.0), values=values)
    trials = {t.user_attrs["status"]: t for t in study.get_trials()}
    assert trials["ok"].state == TrialState.COMPLETE and trials["ok"].constraints == {CONSTRAINT_KEY: -1.0}
    for s in ("oom", "inferred_oom", "hang"):
        assert trials[s].state == TrialState.COMPLETE
        assert trials[s].constraints == {CONSTRAINT_KEY: 1.0}
        assert trials[s].values == [0.0, 64.0]
    for s in ("crash", "invalid", "duplicate"):
        assert trials[s].state == TrialState.FAIL
    # the Pareto front holds only the feasible trial
    assert [t.user_attrs["status"] for t in study.best_trials] == ["ok"]
    assert count_progress(study.get_trials()) == len(statuses) - 1  # the duplicate is not counted


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
    assert not counted(ft(TrialState.COMPLETE, status="ok", confirm_of=3))


# --------------------------------------------------------------------------- resume
@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_stale_sweep_interrupts_and_reenqueues(kind, tmp_path):
    study, storage, _ = new_study(kind, tmp_path)
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


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_concurrent_sweepers_enqueue_one_retry(kind, tmp_path):
    study_a, storage_a, _ = new_study(kind, tmp_path)
    study_b, storage_b, _ = new_study(kind, tmp_path)  # a second process's view (own storage object)
    t = study_a.ask()
    t.suggest_categorical(P, [1, 2, 4])
    t.set_user_attr("owner", {"host": st.owner_info()["host"], "pid": dead_pid(), "started": 1.0})
    frozen_a = study_a.get_trials()[t.number]
    frozen_b = study_b.get_trials()[t.number]
    won = [st.interrupt(study_a, storage_a, frozen_a, "a"), st.interrupt(study_b, storage_b, frozen_b, "b")]
    assert won == [True, False]
    retries = study_a.get_trials(states=(TrialState.WAITING,))
    assert [r.user_attrs.get("retry_of") for r in retries] == [t.number]


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_heartbeat_thread(kind, tmp_path):
    study, storage, _ = new_study(kind, tmp_path)
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
        from tuner.study import StudyLock
        t = time.monotonic()
        with StudyLock(Path({str(tmp_path / "x.lock")!r}))():
            print(round(time.monotonic() - t, 2))
    """)
    with lock():
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
    waited = float(p.communicate(timeout=60)[0])
    assert waited >= 0.5  # it blocked until we released


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_interrupt_keeps_what_was_measured_and_what_was_asked(kind, tmp_path):
    study, storage, _ = new_study(kind, tmp_path)
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
