"""Open the Optuna storage a :class:`trainer.contracts.StorageSpec` names: for writing
(``ppotune search``) or read-only (report, export, notebook, dashboard).

The grammar of ``--storage`` lives in :func:`trainer.contracts.parse_storage`; this module
only turns a parsed spec into an Optuna storage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import optuna
from optuna.storages import BaseStorage

from trainer.contracts import StorageError, StorageSpec, parse_storage, storage_in_out_dir

__all__ = ["open_storage", "resolve_read_spec", "load_study", "trial_id"]


def open_storage(spec: StorageSpec, *, read_only: bool = False) -> BaseStorage:
    """An Optuna storage for ``spec``.

    Read-only: a SQLite file is reopened as a ``mode=ro`` URI, other RDBs skip table creation
    and migration, a journal file must exist and is only read; nothing is ever written.
    """
    try:
        if spec.kind == "journal":
            from optuna.storages.journal import JournalFileBackend

            if read_only and not spec.path.is_file():
                raise StorageError(f"{spec.path}: journal file not found")
            spec.path.parent.mkdir(parents=True, exist_ok=True)
            return optuna.storages.JournalStorage(JournalFileBackend(str(spec.path)))
        if spec.kind == "grpc":
            host, port = spec.url[len("grpc://") :].rsplit(":", 1)
            return optuna.storages.GrpcStorageProxy(host=host, port=int(port))
        if read_only:
            url = spec.url
            if spec.path is not None:
                if not spec.path.is_file():
                    raise StorageError(f"{spec.path}: SQLite file not found")
                url = f"sqlite:///file:{spec.path}?mode=ro&uri=true"
            return optuna.storages.RDBStorage(url, skip_compatibility_check=True, skip_table_creation=True)
        kwargs: dict = {}
        if spec.kind == "sqlite":
            if spec.path is not None:
                spec.path.parent.mkdir(parents=True, exist_ok=True)
            # several processes write one SQLite file: wait for the lock instead of failing at once
            kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
        return optuna.storages.get_storage(optuna.storages.RDBStorage(spec.url, **kwargs))
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - bad URL, missing driver, unreachable server: one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise StorageError(f"cannot open storage {spec.display}: {type(e).__name__}: {first}") from None


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
    try:
        names = [s.study_name for s in storage.get_all_studies()]
    except Exception as e:  # noqa: BLE001
        raise StorageError(f"cannot read studies from {where}: {e}") from None
    if study_name is None:
        if len(names) != 1:
            found = ", ".join(names) if names else "none"
            raise StorageError(f"{where} holds {len(names)} studies ({found}); name one with --study")
        study_name = names[0]
    elif study_name not in names:
        raise StorageError(f"no study {study_name!r} in {where} (found: {', '.join(names) or 'none'})")
    return optuna.load_study(study_name=study_name, storage=storage)


def trial_id(storage: BaseStorage, study: optuna.Study, number: int) -> int:
    """The storage's id of trial ``number`` (Optuna's public storage API, no private attribute)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)
