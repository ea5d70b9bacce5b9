"""A ppotune study read once, read-only: its attributes and one row per trial.

Shared by ``ppotune report``, ``ppotune export``, the notebook and ``ppotune search``'s
summary (so no matplotlib here). The layout read is docs/contracts.md section 3, through
:class:`trainer.contracts.TrialRecord`; the storage is named with the one ``--storage``
grammar (:func:`trainer.contracts.parse_storage`) and opened read-only by
:func:`tuner.study.storage.open_storage`, so reading a study that is still running is safe.

The table of trials, the Pareto front and the headroom filter are :mod:`tuner.study.frame`'s (re-exported
here), shared with the search's after-search stages.

What is read is data, checked before use (:mod:`tuner.study.schema`): a study whose name holds control characters
or is absurdly long is refused (one line); an attribute that does not fit its schema is ignored, a trial that
does not fit is left out; :attr:`StudyView.notes` says which (the commands print them).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Optional

import optuna
import pandas as pd

from trainer.contracts import (
    DEFAULT_OUT_DIR,
    OUT_DIR_FILES,
    StorageError,
    StorageSpec,
    TrialRecord,
    parse_storage,
    storage_in_out_dir,
)
from tuner.space import decode_trial
from tuner.space.registry import ALGORITHM_NOTE, algorithm_knobs
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
from tuner.study.schema import name_problem, override_keys_of, read_study_attrs, read_trial
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
    "study_spec",
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
        """The study's attributes that fit their schema (the others are left out: :attr:`notes`)."""
        return self._attrs

    @property
    def notes(self) -> list[str]:
        """What was left out of the study as read: attributes ignored, trials skipped, each with the reason."""
        return self._attr_notes + list(self.trials.attrs.get("skipped") or [])

    @property
    def algorithm_warning(self) -> Optional[str]:
        """One line when the study's space varied algorithm knobs on purpose (``algorithm: true``), else None."""
        knobs = algorithm_knobs(self.attrs.get("space"))
        if not knobs:
            return None
        return (
            f"{ALGORITHM_NOTE}: the space varied {', '.join(knobs)} (marked algorithm: true), so throughput and "
            "memory compare different PPO updates, not execution knobs of one algorithm"
        )

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
        """Trial ``number``'s user attributes, checked (:func:`tuner.study.schema.read_trial`) and typed; a trial
        left out of the table reads as an empty record."""
        attrs, _ = read_trial(self._by_number[number], override_keys=self._override_keys)
        return TrialRecord.from_user_attrs(attrs or {})

    def __post_init__(self) -> None:
        why = name_problem(self.study.study_name, what="the study's name")
        if why:
            raise StorageError(f"{self.storage.display}: refused: {why}")
        self._attrs, self._attr_notes = read_study_attrs(self.study.user_attrs)
        self._override_keys = override_keys_of(self._attrs.get("space"))
        self._by_number, self._sound = {}, []
        for t in self.study.get_trials(deepcopy=False):
            attrs, _ = read_trial(t, override_keys=self._override_keys)
            if attrs is None:  # left out of the table: kept as stored, never decoded or read further
                self._by_number[t.number] = t
                continue
            checked = decode_trial(t)
            checked = copy.copy(t) if checked is t else checked
            checked.user_attrs = attrs  # the checked copy (long text clipped), never the stored dict
            self._by_number[t.number] = checked
            self._sound.append(checked)

    def sound_trials(self) -> list[optuna.trial.FrozenTrial]:
        """The trials that fit the schema (those in :attr:`trials`), params as knob values, attributes checked."""
        return list(self._sound)


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
    """``--storage URL|DIR --study NAME``: the study a reader (report, export, validate) reads. Its ``--out``
    (where it writes) is its own."""
    g = parser.add_argument_group("which study")
    g.add_argument(
        "--storage",
        metavar="URL",
        help="the study to read: an Optuna storage (sqlite:///study.db, journal:PATH, a .db/.log file, "
        "postgresql://...) or a `ppotune search` output dir (default: the --out dir when it holds a study, else "
        f"./{DEFAULT_OUT_DIR})",
    )
    g.add_argument("--study", metavar="NAME", help="study name (default: the only study in the storage)")


def _holds_study(d: Optional[str | Path]) -> bool:
    return d is not None and any((Path(d) / n).is_file() for n in OUT_DIR_FILES)


def study_spec(args) -> StorageSpec:
    """The study ``args`` name: ``--storage``, else the ``--out`` dir when a search left a study there (what
    ``--out`` meant to report, export and validate before), else ``./ppotune_out``. StorageError when none."""
    if getattr(args, "storage", None):
        return parse_storage(args.storage)
    for d in (getattr(args, "out", None), DEFAULT_OUT_DIR):
        if _holds_study(d):
            return storage_in_out_dir(Path(d))
    raise StorageError(
        f"no study to read: pass --storage URL or a `ppotune search` output dir (./{DEFAULT_OUT_DIR} holds none)"
    )


def view_from_args(args) -> StudyView:
    return load(storage=study_spec(args), study_name=args.study)
