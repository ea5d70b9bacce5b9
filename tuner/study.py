"""The Optuna side of a search: storage, study set-up, trial bookkeeping, resume.

Layout of a study in storage: docs/contracts.md section 3 (report, export and the notebook
read it). What this module adds on top of Optuna:

* **storage URLs**: any Optuna RDB URL; ``journal:PATH`` or a path ending ``.log`` /
  ``.journal`` is a JournalStorage file; a bare ``.db`` path is SQLite.
* **one creator**: the study is created, its user attrs set and the baseline enqueued
  under a file lock next to a file storage, so two ``ppotune search`` processes started
  together never race (SQLite's "table already exists").
* **counting**: each process runs until the study holds ``--trials`` counted trials
  (:func:`counted`); the count and ``ask()`` happen under the lock, so processes add up.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import optuna
import psutil
from optuna.exceptions import DuplicatedStudyError, UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

__all__ = [
    "SCHEMA",
    "STATUSES",
    "COMPLETE_STATUSES",
    "FAIL_STATUSES",
    "CONSTRAINT_KEY",
    "StorageSpec",
    "resolve_storage",
    "StudyLock",
    "open_study",
    "default_study_name",
    "counted",
    "count_progress",
    "owner_info",
    "is_stale",
    "sweep_stale",
    "interrupt",
    "finish",
    "Heartbeat",
]

SCHEMA = 1
DIRECTIONS = ["maximize", "minimize"]  # throughput (tokens/s/GPU), peak memory (GB)
STATUSES = ("ok", "oom", "inferred_oom", "hang", "crash", "invalid", "interrupted", "duplicate")
COMPLETE_STATUSES = ("ok", "oom", "inferred_oom", "hang")  # COMPLETE; all but ok infeasible
FAIL_STATUSES = ("crash", "invalid", "interrupted", "duplicate")
CONSTRAINT_KEY = "infeasible"  # trial.constraints == {"infeasible": 1.0} (OOM/hang) or {-1.0} (ok)
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0  # a RUNNING trial of another host with no heartbeat for this long is stale


# --------------------------------------------------------------------------- storage
@dataclass
class StorageSpec:
    url: str  # what the user sees / what report and export get
    kind: str  # sqlite | rdb | journal
    path: Optional[Path]  # the file, for file storages
    lock_path: Optional[Path]  # where the cross-process lock lives (file storages only)


def resolve_storage(storage: Optional[str], out_dir: Path) -> StorageSpec:
    """``None`` -> ``sqlite:///<out>/study.db``; ``journal:PATH`` / ``*.log`` / ``*.journal`` ->
    a journal file; ``*.db`` / ``*.sqlite`` path -> SQLite; anything else: an RDB URL."""
    if storage is None:
        path = (out_dir / "study.db").resolve()
        return StorageSpec(f"sqlite:///{path}", "sqlite", path, path.with_name(path.name + ".ppotune-lock"))
    if storage.startswith("journal:"):
        path = Path(storage[len("journal:"):]).expanduser().resolve()
        return StorageSpec(f"journal:{path}", "journal", path, path.with_name(path.name + ".ppotune-lock"))
    if "://" not in storage:
        path = Path(storage).expanduser().resolve()
        if path.suffix in (".log", ".journal"):
            return StorageSpec(f"journal:{path}", "journal", path, path.with_name(path.name + ".ppotune-lock"))
        if path.suffix in (".db", ".sqlite", ".sqlite3"):
            return StorageSpec(f"sqlite:///{path}", "sqlite", path, path.with_name(path.name + ".ppotune-lock"))
        raise ValueError(f"--storage: {storage!r} is neither an Optuna URL nor a .db/.log/.journal path")
    if storage.startswith("sqlite:///"):
        raw = storage[len("sqlite:///"):]
        if raw and raw != ":memory:":
            path = Path(raw).expanduser().resolve()
            return StorageSpec(f"sqlite:///{path}", "sqlite", path, path.with_name(path.name + ".ppotune-lock"))
    return StorageSpec(storage, "rdb", None, None)


def open_storage(spec: StorageSpec) -> BaseStorage:
    if spec.path is not None:
        spec.path.parent.mkdir(parents=True, exist_ok=True)
    if spec.kind == "journal":
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(str(spec.path)))
    kwargs: dict = {}
    if spec.kind == "sqlite":
        # several processes write one SQLite file: wait for the lock instead of failing at once
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    return optuna.storages.get_storage(optuna.storages.RDBStorage(spec.url, **kwargs))


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


def open_study(spec: StorageSpec, name: str, lock: StudyLock, *, sampler: optuna.samplers.BaseSampler,
               setup: Any, wait_s: float = 60.0) -> tuple[optuna.Study, BaseStorage, bool]:
    """Create or load the study; the creating process (under the lock) runs ``setup(study)``,
    which must set ``ppotune_schema`` last. Returns (study, storage, created)."""
    with lock():
        storage = open_storage(spec)
        try:
            study = optuna.create_study(storage=storage, study_name=name, directions=DIRECTIONS, sampler=sampler)
            created = True
        except DuplicatedStudyError:
            study = optuna.load_study(storage=storage, study_name=name, sampler=sampler)
            created = False
        if "ppotune_schema" not in study.user_attrs and (created or spec.lock_path is not None):
            setup(study)
    deadline = time.monotonic() + wait_s
    while "ppotune_schema" not in study.user_attrs:  # another process (no shared lock) sets it up
        if time.monotonic() > deadline:
            raise RuntimeError(f"study {name!r} exists but was never set up by the process that created it")
        time.sleep(0.5)
    return study, storage, created


# --------------------------------------------------------------------------- counting
def counted(t: FrozenTrial) -> bool:
    """Does this trial count toward ``--trials``? Finished or running trials, except
    interrupted ones (their retry counts), duplicates (a proposal of a config already in the
    study: recorded, never run) and ``--confirm`` re-runs."""
    if t.state not in (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING):
        return False
    ua = t.user_attrs
    if ua.get("status") in ("interrupted", "duplicate") or ua.get("confirm_of") is not None:
        return False
    return True


def count_progress(trials: list[FrozenTrial]) -> int:
    return sum(1 for t in trials if counted(t))


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
    owner = t.user_attrs.get("owner")
    now = time.time() if now is None else now
    if isinstance(owner, dict) and owner.get("host") == _HOST:
        return not _pid_alive(int(owner.get("pid", -1)), owner.get("started"))
    beat = t.user_attrs.get("heartbeat")
    if beat is None:
        start = t.datetime_start.timestamp() if t.datetime_start else now
        beat = start
    return now - float(beat) > stale_after_s


def _retry_attrs(t: FrozenTrial) -> dict:
    ua = t.user_attrs
    attrs = {"retry_of": t.number}
    for k in ("baseline", "confirm_of"):
        if k in ua:
            attrs[k] = ua[k]
    return attrs


def interrupt(study: optuna.Study, storage: BaseStorage, t: FrozenTrial, reason: str, *,
              extra_attrs: Optional[dict] = None) -> bool:
    """Mark a RUNNING trial FAIL/interrupted and enqueue its params again. Only the process
    whose FAIL transition wins enqueues, so concurrent sweepers never double it."""
    attrs = {"status": "interrupted", "error": reason, **(extra_attrs or {})}
    try:
        for k, v in attrs.items():
            storage.set_trial_user_attr(t._trial_id, k, v)
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    except UpdateFinishedTrialError:
        return False
    study.enqueue_trial(dict(t.params), user_attrs=_retry_attrs(t), skip_if_exists=False)
    return True


def sweep_stale(study: optuna.Study, storage: BaseStorage, *, stale_after_s: float = STALE_AFTER_S) -> list[int]:
    """Interrupt every stale RUNNING trial (see :func:`is_stale`); returns their numbers."""
    swept = []
    now = time.time()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if is_stale(t, now=now, stale_after_s=stale_after_s):
            owner = t.user_attrs.get("owner") or {}
            reason = (f"interrupted: its tuner (pid {owner.get('pid')} on {owner.get('host')}) died; "
                      "params enqueued again")
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
                try:
                    self.storage.set_trial_user_attr(tid, "heartbeat", time.time())
                except Exception:  # finished meanwhile, or a transient storage error
                    pass

    def stop(self) -> None:
        self._stop_event.set()


# --------------------------------------------------------------------------- telling
def finish(study: optuna.Study, trial: optuna.trial.Trial, status: str, attrs: dict, *,
           values: Optional[tuple[float, float]] = None) -> FrozenTrial:
    """Write the trial's user attrs and tell Optuna: COMPLETE (feasible only if ``ok``) or FAIL."""
    assert status in STATUSES, status
    for k, v in {**attrs, "status": status}.items():
        trial.set_user_attr(k, v)
    if status in COMPLETE_STATUSES:
        assert values is not None
        trial.set_constraint(CONSTRAINT_KEY, -1.0 if status == "ok" else 1.0)
        return study.tell(trial, list(values))
    return study.tell(trial, state=TrialState.FAIL)
