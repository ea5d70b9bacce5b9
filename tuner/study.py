"""The Optuna side of a search: study set-up, ownership, heartbeat, resume, telling.

Layout of a study in storage: docs/contracts.md section 3 (report, export and the notebook
read it); the words (statuses, attributes, storage spellings) are :mod:`trainer.contracts`.
What this module adds on top of Optuna:

* **one creator**: the study is created, its user attrs set and the baseline enqueued
  under a file lock next to a file storage, so two ``ppotune search`` processes started
  together never race (SQLite's "table already exists").
* **ownership and resume**: a RUNNING trial records its owner (host, pid, process start
  time) and a heartbeat. A RUNNING trial whose owner is dead (same host) or whose heartbeat
  is stale (another host) is marked FAIL with status ``interrupted`` and its params are
  enqueued again (``retry_of``). This works for every storage (Optuna's own heartbeat is
  RDB-only and lives inside ``optimize()``, which a tuner driving ask/tell never calls).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import optuna
import psutil
from optuna.exceptions import DuplicatedStudyError, UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from trainer.contracts import (
    ASKED_FIELDS,
    CONSTRAINT_KEY,
    DIRECTIONS,
    MEASUREMENT_FIELDS,
    Status,
    StorageSpec,
    TrialRecord,
)
from tuner.storage import open_storage, trial_id

__all__ = [
    "SCHEMA_ATTR",
    "StudyLock",
    "open_study",
    "default_study_name",
    "owner_info",
    "is_stale",
    "sweep_stale",
    "interrupt",
    "claim",
    "finish",
    "Heartbeat",
]

SCHEMA_ATTR = "ppotune_schema"  # study user attr set last by the creating process: "the study is set up"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0  # a RUNNING trial of another host with no heartbeat for this long is stale


class StudyLock:
    """A thread lock plus, for file storages, an flock on a file next to the storage."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: Optional[int] = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._thread_lock:
            if self._depth == 0 and self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                    os.close(self._fd)
                    self._fd = None


def default_study_name(base_path: Optional[str], space_path: str) -> str:
    base = Path(base_path).stem if base_path else "defaults"
    return f"{base}--{Path(space_path).stem}"


def open_study(
    spec: StorageSpec,
    name: str,
    lock: StudyLock,
    *,
    sampler: optuna.samplers.BaseSampler,
    setup: Any,
    wait_s: float = 60.0,
) -> tuple[optuna.Study, BaseStorage, bool]:
    """Create or load the study; the creating process (under the lock) runs ``setup(study)``,
    which must set :data:`SCHEMA_ATTR` last. Returns (study, storage, created)."""
    with lock():
        storage = open_storage(spec)
        try:
            study = optuna.create_study(storage=storage, study_name=name, directions=list(DIRECTIONS), sampler=sampler)
            created = True
        except DuplicatedStudyError:
            study = optuna.load_study(storage=storage, study_name=name, sampler=sampler)
            created = False
        if SCHEMA_ATTR not in study.user_attrs and (created or spec.lock_path is not None):
            setup(study)
    deadline = time.monotonic() + wait_s
    while SCHEMA_ATTR not in study.user_attrs:  # another process (no shared lock) sets it up
        if time.monotonic() > deadline:
            raise RuntimeError(f"study {name!r} exists but was never set up by the process that created it")
        time.sleep(0.5)
    return study, storage, created


# --------------------------------------------------------------------------- ownership, resume
_HOST = socket.gethostname()


def owner_info() -> dict:
    me = psutil.Process()
    return {"host": _HOST, "pid": me.pid, "started": round(me.create_time(), 2)}


def _pid_alive(pid: int, started: Optional[float]) -> bool:
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(p.create_time() - started) < 1.0
    except psutil.Error:
        return False


def is_stale(t: FrozenTrial, *, now: Optional[float] = None, stale_after_s: float = STALE_AFTER_S) -> bool:
    """A RUNNING trial whose tuner is gone: dead owner pid on this host, or no heartbeat for
    ``stale_after_s`` from another host (or from a trial with no owner record at all)."""
    if t.state != TrialState.RUNNING:
        return False
    rec = TrialRecord.from_user_attrs(t.user_attrs)
    owner = rec.owner
    now = time.time() if now is None else now
    if isinstance(owner, dict) and owner.get("host") == _HOST:
        return not _pid_alive(int(owner.get("pid", -1)), owner.get("started"))
    beat = rec.heartbeat
    if beat is None:
        beat = t.datetime_start.timestamp() if t.datetime_start else now
    return now - float(beat) > stale_after_s


def interrupt(
    study: optuna.Study, storage: BaseStorage, t: FrozenTrial, reason: str, *, measured: Optional[TrialRecord] = None
) -> bool:
    """Mark a RUNNING trial FAIL/interrupted and enqueue its params again. Only the process
    whose FAIL transition wins enqueues, so concurrent sweepers never double it.

    ``measured``: what the trial recorded before it was stopped (kept on the failed trial)."""
    rec = TrialRecord.from_user_attrs(t.user_attrs)
    fields = {"status", "error"}
    if measured is not None:
        fields |= {f for f, v in measured.to_user_attrs().items() if f not in ASKED_FIELDS and v not in (None, {}, [])}
        for f in fields - {"status", "error"}:
            setattr(rec, f, getattr(measured, f))
    rec.status, rec.error = Status.INTERRUPTED, reason
    tid = trial_id(storage, study, t.number)
    try:
        for k, v in rec.to_user_attrs(only=fields).items():
            storage.set_trial_user_attr(tid, k, v)
        storage.set_trial_state_values(tid, TrialState.FAIL)
    except UpdateFinishedTrialError:
        return False
    retry = TrialRecord(retry_of=t.number, baseline=rec.baseline, confirm_of=rec.confirm_of)
    study.enqueue_trial(
        dict(t.params),
        user_attrs=retry.to_user_attrs(only={"retry_of", "baseline", "confirm_of"}),
        skip_if_exists=False,
    )
    return True


def sweep_stale(study: optuna.Study, storage: BaseStorage, *, stale_after_s: float = STALE_AFTER_S) -> list[int]:
    """Interrupt every stale RUNNING trial (see :func:`is_stale`); returns their numbers."""
    swept = []
    now = time.time()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if is_stale(t, now=now, stale_after_s=stale_after_s):
            owner = TrialRecord.from_user_attrs(t.user_attrs).owner or {}
            reason = (
                f"interrupted: its tuner (pid {owner.get('pid')} on {owner.get('host')}) died; params enqueued again"
            )
            if interrupt(study, storage, t, reason):
                swept.append(t.number)
    return swept


class Heartbeat(threading.Thread):
    """Writes ``heartbeat`` (epoch seconds) on this process's RUNNING trials every ``interval_s``."""

    def __init__(self, storage: BaseStorage, interval_s: float = HEARTBEAT_S):
        super().__init__(name="ppotune-heartbeat", daemon=True)
        self.storage = storage
        self.interval_s = interval_s
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def add(self, trial_id: int) -> None:
        with self._lock:
            self._ids.add(trial_id)

    def remove(self, trial_id: int) -> None:
        with self._lock:
            self._ids.discard(trial_id)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            with self._lock:
                ids = list(self._ids)
            for tid in ids:
                beat = TrialRecord(heartbeat=time.time()).to_user_attrs(only={"heartbeat"})
                try:
                    for k, v in beat.items():
                        self.storage.set_trial_user_attr(tid, k, v)
                except Exception:  # noqa: BLE001 - finished meanwhile, or a transient storage error
                    pass

    def stop(self) -> None:
        self._stop_event.set()


def claim(trial: optuna.trial.Trial) -> None:
    """Record this process as the RUNNING trial's owner, with a first heartbeat."""
    for k, v in (
        TrialRecord(owner=owner_info(), heartbeat=time.time()).to_user_attrs(only={"owner", "heartbeat"}).items()
    ):
        trial.set_user_attr(k, v)


# --------------------------------------------------------------------------- telling
def finish(
    study: optuna.Study, trial: optuna.trial.Trial, record: TrialRecord, *, values: Optional[tuple[float, float]] = None
) -> FrozenTrial:
    """Write the trial's record and tell Optuna: COMPLETE (feasible only if ``ok``) or FAIL.

    Only the record's measurement and outcome fields are written: the attrs set when the trial
    was asked (owner, heartbeat, overrides, baseline) stay as they are."""
    status = record.status
    assert isinstance(status, Status), status
    for k, v in record.to_user_attrs().items():
        if k not in ASKED_FIELDS and (v is not None or k in MEASUREMENT_FIELDS):
            trial.set_user_attr(k, v)
    if status.complete:
        assert values is not None
        trial.set_constraint(CONSTRAINT_KEY, -1.0 if status.feasible else 1.0)
        return study.tell(trial, list(values))
    return study.tell(trial, state=TrialState.FAIL)
