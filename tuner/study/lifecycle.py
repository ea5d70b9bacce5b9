"""The Optuna side of a search: study set-up, ownership, heartbeat, resume, telling.

Layout of a study in storage: docs/contracts.md section 3 (report, export and the notebook
read it); the words (statuses, attributes, storage spellings) are :mod:`trainer.contracts`.
What this module adds on top of Optuna:

* **one lock per study across processes** (:class:`StudyLock`): an flock on a file next to a
  file storage, a transaction-scoped advisory lock in the database for PostgreSQL. The study
  is created, its user attrs set and the baseline enqueued under it, so two ``ppotune
  search`` processes started together never race (SQLite's "table already exists"); every
  ``ask()`` counts the budget under it, so workers never overshoot ``--trials``. Storages
  with no such lock (the gRPC proxy, MySQL) are exact by another route: see
  :func:`tuner.rules.budget.over_budget`.
* **ownership and resume**: a RUNNING trial records its owner (host, pid, process start
  time) and a heartbeat. A RUNNING trial whose owner is dead (same host) or whose heartbeat
  is older than the grace period (another host) is marked FAIL with status ``interrupted``
  and its params are enqueued again (``retry_of``), once: only the process whose FAIL
  transition wins enqueues. This works for every storage. On a database server the
  heartbeat is also recorded in Optuna's own heartbeat table (``RDBStorage(heartbeat_interval,
  grace_period)``), but Optuna's stale-trial handling (``fail_stale_trials``) is not used: it
  fails the trial first, after which its user attrs (our ``interrupted`` status) can no
  longer be written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
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
from tuner.study.storage import open_storage, storage_engine, trial_id

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
    "owned_here",
    "advisory_key",
]

SCHEMA_ATTR = "ppotune_schema"  # study user attr set last by the creating process: "the study is set up"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0  # the grace period: a RUNNING trial of another host with no heartbeat for this long is stale
# A holder of the database lock that stops answering (a frozen node) loses it after this long
# idle in its lock transaction; the lock is normally held for one ask() (milliseconds).
LOCK_IDLE_TIMEOUT_S = 300


def advisory_key(study_name: str) -> int:
    """The study's PostgreSQL advisory lock key (a signed 64-bit int, stable across processes)."""
    return int.from_bytes(hashlib.sha256(f"ppotune:{study_name}".encode()).digest()[:8], "big", signed=True)


class StudyLock:
    """One study's lock: a thread lock, plus a cross-process lock where the storage has one.

    * file storage (SQLite file, journal file): an flock on ``path``, next to the file;
    * PostgreSQL: ``pg_advisory_xact_lock`` on a connection of the storage's own pool, held for
      the length of a transaction (bind it with :meth:`bind` once the storage is open). A
      worker that dies releases it with its connection; a frozen one after ``LOCK_IDLE_TIMEOUT_S``.
    * anything else (the gRPC proxy, MySQL, in-memory SQLite): the thread lock only, and
      :attr:`exact` is False: the search then checks its trial's rank after ``ask()``.
    Re-entrant within a process.
    """

    def __init__(self, path: Optional[Path]):
        self.path = path
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: Optional[int] = None
        self._engine: Any = None
        self._key: Optional[int] = None
        self._conn: Any = None
        self._txn: Any = None

    def bind(self, storage: BaseStorage, study_name: str) -> "StudyLock":
        """Use the database's advisory lock when ``storage`` is on a PostgreSQL server."""
        engine = storage_engine(storage)
        if self.path is None and engine is not None and engine.dialect.name == "postgresql":
            self._engine, self._key = engine, advisory_key(study_name)
        return self

    @property
    def kind(self) -> str:
        return "file" if self.path is not None else "postgresql-advisory" if self._engine is not None else "none"

    @property
    def exact(self) -> bool:
        """Does holding this lock serialise every process on the study (not only this one's threads)?"""
        return self.kind != "none"

    def _acquire(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        elif self._engine is not None:
            from sqlalchemy import text

            self._conn = self._engine.connect()
            try:
                self._txn = self._conn.begin()
                self._conn.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = '{LOCK_IDLE_TIMEOUT_S}s'"))
                self._conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": self._key})
            except BaseException:
                self._conn.close()
                self._conn = self._txn = None
                raise

    def _release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._conn is not None:
            try:
                self._txn.commit()  # ends the transaction: the advisory lock goes with it
            finally:
                self._conn.close()  # back to the pool
                self._conn = self._txn = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._thread_lock:
            if self._depth == 0:
                self._acquire()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._release()


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
    heartbeat_s: Optional[float] = None,
    grace_s: Optional[float] = None,
) -> tuple[optuna.Study, BaseStorage, bool]:
    """Create or load the study; the creating process (under the lock) runs ``setup(study)``,
    which must set :data:`SCHEMA_ATTR` last. Returns (study, storage, created).

    ``lock`` is bound to the storage (:meth:`StudyLock.bind`); ``heartbeat_s``/``grace_s`` go to
    the storage (Optuna's heartbeat on a database server)."""
    with lock():  # the file lock, when there is a file: it also covers creating the file
        storage = open_storage(spec, heartbeat_s=heartbeat_s, grace_s=grace_s)
    lock.bind(storage, name)
    with lock():
        try:
            study = optuna.create_study(storage=storage, study_name=name, directions=list(DIRECTIONS), sampler=sampler)
            created = True
        except DuplicatedStudyError:
            study = optuna.load_study(storage=storage, study_name=name, sampler=sampler)
            created = False
        if SCHEMA_ATTR not in study.user_attrs and (created or lock.exact):
            setup(study)
    deadline = time.monotonic() + wait_s
    while SCHEMA_ATTR not in study.user_attrs:  # another process (no shared lock) sets it up
        if time.monotonic() > deadline:
            raise RuntimeError(f"study {name!r} exists but was never set up by the process that created it")
        time.sleep(0.5)
    return study, storage, created


# --------------------------------------------------------------------------- ownership, resume
# The host a worker records as its trials' owner. PPOTUNE_HOST overrides the hostname where workers
# in separate PID namespaces share one (containers with the host's UTS namespace).
_HOST = os.environ.get("PPOTUNE_HOST") or socket.gethostname()


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


def owned_here(t: FrozenTrial) -> bool:
    """Is this RUNNING trial this process's own (one of its ``--parallel`` slots)?"""
    owner = TrialRecord.from_user_attrs(t.user_attrs).owner
    me = owner_info()
    return isinstance(owner, dict) and owner.get("host") == me["host"] and owner.get("pid") == me["pid"]


class Heartbeat(threading.Thread):
    """Writes ``heartbeat`` (epoch seconds) on this process's RUNNING trials every ``interval_s``,
    and Optuna's own heartbeat where the storage keeps one (a database server)."""

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
        if self._optuna_heartbeat:  # Optuna's heartbeat row exists from the start, as in optimize()
            self.beat(trial_id)

    def remove(self, trial_id: int) -> None:
        with self._lock:
            self._ids.discard(trial_id)

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            with self._lock:
                ids = list(self._ids)
            for tid in ids:
                self.beat(tid)

    def beat(self, trial_id: int) -> None:
        beat = TrialRecord(heartbeat=time.time()).to_user_attrs(only={"heartbeat"})
        try:
            for k, v in beat.items():
                self.storage.set_trial_user_attr(trial_id, k, v)
            if self._optuna_heartbeat:
                self.storage.record_heartbeat(trial_id)
        except Exception:  # noqa: BLE001 - finished meanwhile, or a transient storage error
            pass

    @property
    def _optuna_heartbeat(self) -> bool:
        get = getattr(self.storage, "get_heartbeat_interval", None)
        return get is not None and get() is not None

    def stop(self) -> None:
        """Stop beating; returns once no beat is being written (the storage may be closed next)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=30)


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
    """Write the trial's record and tell Optuna: COMPLETE when there are ``values`` (with the record's
    graded ``constraint``; a record without one: -1 if ``ok``, else +1), else FAIL.

    Only the record's measurement and outcome fields are written: the attrs set when the trial
    was asked (owner, heartbeat, overrides, baseline) stay as they are."""
    status = record.status
    assert isinstance(status, Status), status
    assert values is not None or not status.complete, status
    for k, v in record.to_user_attrs().items():
        if k not in ASKED_FIELDS and (v is not None or k in MEASUREMENT_FIELDS):
            trial.set_user_attr(k, v)
    if values is not None:
        graded = record.constraint if record.constraint is not None else -1.0 if status.feasible else 1.0
        trial.set_constraint(CONSTRAINT_KEY, float(graded))
        return study.tell(trial, list(values))
    return study.tell(trial, state=TrialState.FAIL)
