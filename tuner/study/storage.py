"""Open the Optuna storage a :class:`trainer.contracts.StorageSpec` names: for writing
(``ppotune search``) or read-only (report, export, notebook, dashboard).

The grammar of ``--storage`` lives in :func:`trainer.contracts.parse_storage`; this module
only turns a parsed spec into an Optuna storage, and closes it (:func:`close_storage`).

A database server (PostgreSQL, MySQL) is opened with a small connection pool whose connections
are checked before use (a server restart or a dropped idle connection costs a reconnect, not an
error), TCP keepalives and a connect timeout (an unreachable server is a one-line error after
``CONNECT_TIMEOUT_S``, not a hang), and, when writing, Optuna's own trial heartbeat
(``heartbeat_interval``/``grace_period``). Every error is one line naming the storage with its
password masked.

A file that is not a study (random bytes, a damaged SQLite file, another program's SQLite database, a text
file where a journal was expected) is refused before Optuna touches it (:func:`check_storage_file`): one line
saying so, and never Optuna's tables written into someone else's database. A storage that cannot be opened
for writing leaves nothing behind: the directories and the file the attempt created are removed again.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import unquote, urlsplit

import optuna
from optuna.storages import BaseStorage

from trainer.contracts import StorageError, StorageSpec, parse_storage, storage_in_out_dir

__all__ = [
    "open_storage",
    "check_storage_file",
    "Leftovers",
    "close_storage",
    "storage_engine",
    "network_filesystem",
    "resolve_read_spec",
    "load_study",
    "trial_id",
]

CONNECT_TIMEOUT_S = 10  # a database server or storage proxy that does not answer within this is an error
POOL_SIZE = 4  # connections a process keeps open to a database server (more are opened under load, then closed)
POOL_MAX_OVERFLOW = 8
POOL_RECYCLE_S = 1800  # reopen connections older than this (a firewall may drop idle ones silently)

_SCHEMA_LOCK_KEY = 0x7070_6F74_756E_6531  # "pptune1": the advisory lock around Optuna's table creation
# the SQLAlchemy engine behind each storage we opened on a database server (the lock and close_storage use it)
_ENGINES: "weakref.WeakKeyDictionary[BaseStorage, Any]" = weakref.WeakKeyDictionary()


def _server_kwargs(url: str, heartbeat_s: Optional[float], grace_s: Optional[float]) -> dict:
    """RDBStorage arguments for a database server: pool, liveness checks, Optuna's heartbeat."""
    engine: dict = {
        "pool_size": POOL_SIZE,
        "max_overflow": POOL_MAX_OVERFLOW,
        "pool_pre_ping": True,
        "pool_recycle": POOL_RECYCLE_S,
    }
    if url.startswith("postgresql"):
        # libpq: give up on an unreachable server, and notice a peer that vanished mid-connection
        engine["connect_args"] = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "keepalives": 1,
            "keepalives_idle": 30,
            "keepalives_interval": 10,
            "keepalives_count": 3,
            "application_name": "ppotune",
        }
    elif url.startswith("mysql"):
        engine["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    kwargs: dict = {"engine_kwargs": engine}
    if heartbeat_s is not None:
        # Optuna's heartbeat table (database clock); our own sweep acts on stale trials (tuner.study.lifecycle)
        kwargs["heartbeat_interval"] = max(1, round(heartbeat_s))
        if grace_s is not None:
            kwargs["grace_period"] = max(1, round(grace_s))
    return kwargs


def _scrub(text: str, spec: StorageSpec) -> str:
    """Remove the storage's password from an error text (drivers may echo the URL or parts of it)."""
    password = urlsplit(spec.url).password if "://" in spec.url else None
    for secret in {password, unquote(password) if password else None} - {None, ""}:
        text = text.replace(secret, "***")
    return text.replace(spec.url, spec.display)


_SQLITE_MAGIC = b"SQLite format 3\x00"
#: the tables every Optuna RDB storage has (any schema version): a file holding other tables but not these is not ours
_OPTUNA_TABLES = frozenset({"studies", "version_info"})


def check_storage_file(spec: StorageSpec) -> None:
    """Refuse (:class:`StorageError`, one line naming the file) a storage file that exists and is not a study:
    not an SQLite file, a damaged one, one with other tables but not Optuna's, or a journal file whose first line
    is not a journal record. A missing or empty file passes (a new study)."""
    path = spec.path
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return
    if spec.kind == "sqlite":
        _check_sqlite(path)
    else:
        _check_journal(path)


def _check_sqlite(path: Path) -> None:
    import sqlite3

    with open(path, "rb") as f:
        head = f.read(len(_SQLITE_MAGIC))
    if head != _SQLITE_MAGIC:
        raise StorageError(f"{path}: not a study database (not an SQLite file)")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise StorageError(f"{path}: not a study database (a damaged SQLite file: {e})") from None
    if tables and not _OPTUNA_TABLES <= tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise StorageError(f"{path}: not a study database (an SQLite file without Optuna's tables; it holds {shown})")


def _check_journal(path: Path) -> None:
    import json

    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "op_code" not in record:
        raise StorageError(f"{path}: not a study journal (its first line is not an Optuna journal record)")


def _missing_dirs(path: Path) -> list[Path]:
    """The directories above ``path`` that do not exist yet, outermost first."""
    return [d for d in reversed(path.parents) if not d.exists()]


class Leftovers:
    """What a command is about to create (files, directories), noted before it starts: :meth:`undo` removes those
    that did not exist then (a directory with all it holds), and then the parent directories it made, while empty.
    Nothing that was there before is touched."""

    def __init__(self, *paths: Optional[Path]):
        real = [Path(p) for p in paths if p is not None]
        self._new = [p for p in real if not p.exists()]
        self._dirs = sorted({d for p in real for d in _missing_dirs(p)}, key=lambda d: len(d.parts), reverse=True)

    def undo(self) -> None:
        import shutil

        for p in self._new:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
        for d in self._dirs:  # deepest first
            with contextlib.suppress(OSError):
                d.rmdir()  # only while empty


@contextlib.contextmanager
def _undo_on_failure(spec: StorageSpec) -> Iterator[None]:
    """If opening ``spec`` for writing fails, remove the file and the directories the attempt created."""
    left = Leftovers(spec.path, spec.path.with_name(spec.path.name + "-journal") if spec.path else None)
    try:
        yield
    except BaseException:
        left.undo()
        raise


def open_storage(
    spec: StorageSpec,
    *,
    read_only: bool = False,
    heartbeat_s: Optional[float] = None,
    grace_s: Optional[float] = None,
) -> BaseStorage:
    """An Optuna storage for ``spec``.

    Read-only: a SQLite file is reopened as a ``mode=ro`` URI, other RDBs skip table creation
    and migration, a journal file must exist and is only read; nothing is ever written.
    ``heartbeat_s``/``grace_s`` (writers on a database server): Optuna's trial heartbeat.
    A gRPC storage proxy must answer within ``CONNECT_TIMEOUT_S``. A file that is not a study is refused
    (:func:`check_storage_file`); a failed open for writing leaves nothing behind. Close with :func:`close_storage`.
    """
    check_storage_file(spec)
    if read_only:
        return _open(spec, read_only=True, heartbeat_s=None, grace_s=None)
    with _undo_on_failure(spec):
        return _open(spec, read_only=False, heartbeat_s=heartbeat_s, grace_s=grace_s)


def _open(spec: StorageSpec, *, read_only: bool, heartbeat_s: Optional[float], grace_s: Optional[float]) -> BaseStorage:
    try:
        if spec.kind == "journal":
            from optuna.storages.journal import JournalFileBackend

            if read_only and not spec.path.is_file():
                raise StorageError(f"{spec.path}: journal file not found")
            spec.path.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(str(spec.path)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if spec.kind == "grpc":
                return _open_proxy(spec)
            if read_only:
                url = spec.url
                kwargs: dict = {"skip_compatibility_check": True, "skip_table_creation": True}
                if spec.path is not None:
                    if not spec.path.is_file():
                        raise StorageError(f"{spec.path}: SQLite file not found")
                    url = f"sqlite:///file:{spec.path}?mode=ro&uri=true"
                elif spec.kind == "rdb":
                    kwargs.update(_server_kwargs(url, None, None))
                rdb = optuna.storages.RDBStorage(url, **kwargs)
                _ENGINES[rdb] = rdb.engine
                return rdb
            kwargs = {}
            if spec.kind == "sqlite":
                if spec.path is not None:
                    spec.path.parent.mkdir(parents=True, exist_ok=True)
                # several processes write one SQLite file: wait for the lock instead of failing at once
                kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
            elif spec.kind == "rdb":
                kwargs.update(_server_kwargs(spec.url, heartbeat_s, grace_s))
            with _schema_lock(spec.url):
                rdb = optuna.storages.RDBStorage(spec.url, **kwargs)
            storage = optuna.storages.get_storage(rdb)
            _ENGINES[storage] = rdb.engine
            return storage
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - bad URL, missing driver, unreachable server: one line
        first = _scrub(str(e).strip().splitlines()[0] if str(e).strip() else "", spec)
        raise StorageError(f"cannot open storage {spec.display}: {type(e).__name__}: {first}") from None


@contextlib.contextmanager
def _schema_lock(url: str) -> Iterator[None]:
    """On PostgreSQL, serialise Optuna's table creation and migration check across processes:
    workers started together on an empty database otherwise race on ``CREATE TABLE``."""
    if not url.startswith("postgresql"):
        yield
        return
    import sqlalchemy

    engine = sqlalchemy.create_engine(
        url, poolclass=sqlalchemy.pool.NullPool, connect_args={"connect_timeout": CONNECT_TIMEOUT_S}
    )
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _SCHEMA_LOCK_KEY})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": _SCHEMA_LOCK_KEY})
    finally:
        engine.dispose()


def _open_proxy(spec: StorageSpec) -> BaseStorage:
    host, port = spec.url[len("grpc://") :].rsplit(":", 1)
    proxy = optuna.storages.GrpcStorageProxy(host=host, port=int(port))
    try:
        proxy.wait_server_ready(timeout=CONNECT_TIMEOUT_S)
    except ConnectionError:
        proxy.close()
        raise StorageError(
            f"cannot open storage {spec.display}: no storage proxy answered within {CONNECT_TIMEOUT_S} s "
            "(start one with `ppotune storage-proxy --storage URL --port P`)"
        ) from None
    return proxy


def storage_engine(storage: BaseStorage) -> Optional[Any]:
    """The SQLAlchemy engine of a storage :func:`open_storage` opened on an RDB (None otherwise)."""
    return _ENGINES.get(storage)


def close_storage(storage: Optional[BaseStorage]) -> None:
    """Close a storage's connections: the RDB engine's pool, or the gRPC channel. Safe to call twice."""
    if storage is None:
        return
    engine = _ENGINES.pop(storage, None)
    try:
        if engine is not None:
            engine.dispose()
        elif isinstance(storage, optuna.storages.GrpcStorageProxy):
            storage.close()
    except Exception:  # noqa: BLE001 - closing is best effort: the process is about to exit
        pass


# file systems shared between hosts, where SQLite's locking does not hold ("database disk image is malformed")
NETWORK_FILESYSTEMS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "lustre",
    "gpfs",
    "beegfs",
    "glusterfs",
    "ceph",
    "9p",
    "fuse.sshfs",
)


def network_filesystem(path: Path, *, mounts: str = "/proc/self/mounts") -> Optional[str]:
    """The type of the network file system ``path`` lives on (``nfs``, ``lustre``, ...), or None."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    target = str(Path(path).resolve())
    best: tuple[int, str] = (-1, "")
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best[0]:
            best = (len(point), parts[2])
    return best[1] if best[1] in NETWORK_FILESYSTEMS else None


def resolve_read_spec(*, storage: Optional[str] = None, out: Optional[str | Path] = None) -> StorageSpec:
    """``--storage URL`` or ``--out DIR`` of a reader (report, export, notebook) -> a spec."""
    if storage and out:
        raise StorageError("give --storage or --out, not both")
    if storage:
        return parse_storage(storage)
    if out is None:
        raise StorageError("give --storage URL (with --study NAME) or --out DIR")
    return storage_in_out_dir(Path(out))


def load_study(storage: BaseStorage, study_name: Optional[str], *, where: str = "the storage") -> optuna.Study:
    """Load a study; without a name, the storage must hold exactly one."""
    from tuner.study.schema import comment_safe

    try:
        names = [s.study_name for s in storage.get_all_studies()]
    except Exception as e:  # noqa: BLE001
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise StorageError(f"cannot read studies from {where}: {type(e).__name__}: {first}") from None
    shown = ", ".join(comment_safe(n)[:80] for n in names[:10]) + (", ..." if len(names) > 10 else "")
    if study_name is None:
        if len(names) != 1:
            raise StorageError(f"{where} holds {len(names)} studies ({shown or 'none'}); name one with --study")
        study_name = names[0]
    elif study_name not in names:
        raise StorageError(f"no study {comment_safe(study_name)!r} in {where} (found: {shown or 'none'})")
    return optuna.load_study(study_name=study_name, storage=storage)


def trial_id(storage: BaseStorage, study: optuna.Study, number: int) -> int:
    """The storage's id of trial ``number`` (Optuna's public storage API, no private attribute)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)
