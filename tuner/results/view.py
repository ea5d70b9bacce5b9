"""A ppotune study read once, read-only: its attributes and one row per trial.

Shared by ``ppotune report``, ``ppotune export``, the notebook and ``ppotune search``'s
summary (so no matplotlib here). The layout read is docs/contracts.md section 3, through
:class:`trainer.contracts.TrialRecord`; the storage is named with the one ``--storage``
grammar (:func:`trainer.contracts.parse_storage`) and opened read-only by
:func:`tuner.study.storage.open_storage`, so reading a study that is still running is safe.

The table of trials, the Pareto front and the headroom filter are :mod:`tuner.study.frame`'s (re-exported
here), shared with the search's after-search stages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import optuna
import pandas as pd

from trainer.contracts import StorageSpec, TrialRecord
from tuner.space import decode_trial
from tuner.study.frame import (  # re-exported: the study as a table, for the report, export and the notebook
    MEM_PREFIX,
    MEMORY_FIELDS,
    PARAM_PREFIX,
    TIME_PREFIX,
    device_memory_gb,
    knob_columns,
    measured_feasible,
    missing,
    pareto_front,
    pareto_mask,
    trials_frame,
    value_or_zero,
)
from tuner.study.storage import load_study, open_storage, resolve_read_spec

__all__ = [
    "StudyView",
    "MEMORY_FIELDS",
    "PARAM_PREFIX",
    "TIME_PREFIX",
    "MEM_PREFIX",
    "load",
    "trials_frame",
    "pareto_mask",
    "pareto_front",
    "measured_feasible",
    "device_memory_gb",
    "knob_columns",
    "missing",
    "value_or_zero",
    "add_study_arguments",
    "view_from_args",
]


# --------------------------------------------------------------------------- one study, read once
@dataclasses.dataclass
class StudyView:
    """A study read once: its attributes and one row per trial (see :func:`trials_frame`).

    ``storage`` is where it was read from; show it as ``storage.display`` (password masked).
    """

    study: optuna.Study
    trials: pd.DataFrame
    storage: StorageSpec

    @property
    def name(self) -> str:
        return self.study.study_name

    @property
    def attrs(self) -> dict:
        return self.study.user_attrs

    @property
    def knobs(self) -> list[str]:
        return knob_columns(self.trials)

    @property
    def device_memory(self) -> tuple[Optional[float], str]:
        return device_memory_gb(self.attrs)

    def trial(self, number: int) -> optuna.trial.FrozenTrial:
        """Trial ``number``, its params as knob values (``8``, not the exponent Optuna holds: tuner.space)."""
        return self._by_number[number]

    def record(self, number: int) -> TrialRecord:
        """Trial ``number``'s user attributes, typed."""
        return TrialRecord.from_user_attrs(self._by_number[number].user_attrs)

    def __post_init__(self) -> None:
        self._by_number = {t.number: decode_trial(t) for t in self.study.get_trials(deepcopy=False)}


def load(
    *,
    storage: str | StorageSpec | None = None,
    study_name: Optional[str] = None,
    out: Optional[str | Path] = None,
) -> StudyView:
    """``--storage/--study`` or ``--out`` -> a :class:`StudyView` (read-only).

    Raises :class:`trainer.contracts.StorageError` (one line) when it cannot be read.
    """
    if isinstance(storage, StorageSpec) and out is None:
        spec = storage
    else:
        spec = resolve_read_spec(storage=storage, out=out)
    study = load_study(open_storage(spec, read_only=True), study_name, where=spec.display)
    return StudyView(study=study, trials=trials_frame(study), storage=spec)


# --------------------------------------------------------------------------- CLI plumbing
def add_study_arguments(parser) -> None:
    """``--storage URL --study NAME`` or ``--out DIR`` (a ``ppotune search`` output dir)."""
    g = parser.add_argument_group("which study")
    g.add_argument(
        "--storage",
        metavar="URL",
        help="Optuna storage: sqlite:///study.db, journal:PATH, a .db/.log file, postgresql://..., "
        "or a search output dir",
    )
    g.add_argument("--study", metavar="NAME", help="study name (default: the only study in the storage)")
    g.add_argument("--out", metavar="DIR", help="a `ppotune search` output dir (DIR/study.db or DIR/study.log)")


def view_from_args(args) -> StudyView:
    return load(storage=args.storage, study_name=args.study, out=args.out)
