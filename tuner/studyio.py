"""Open a ppotune study read-only and turn it into one row per trial.

Shared by ``ppotune report``, ``ppotune export`` and the notebook. The layout read
here is docs/contracts.md section 3; nothing in this module ever writes to the
storage, so it is safe on a study that is still running (SQLite is opened with
``mode=ro``; a journal file is only read).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

import optuna
import pandas as pd

__all__ = [
    "StudyError",
    "StudyView",
    "STATUSES",
    "MEASURED_STATUSES",
    "PHASES",
    "MEMORY_FIELDS",
    "resolve_storage",
    "open_storage",
    "load_study",
    "load",
    "trials_frame",
    "pareto_mask",
    "measured_feasible",
    "device_memory_gb",
    "short_knob",
    "knob_columns",
    "missing",
    "add_study_arguments",
    "view_from_args",
]

#: every trial status of contracts.md §3, in display order
STATUSES = ("ok", "oom", "inferred_oom", "hang", "crash", "invalid")
#: statuses whose trial really ran and was measured (possibly up to the failure)
MEASURED_STATUSES = ("ok", "oom", "hang")
#: the timed phases of one PPO step (result schema ``summary.timing_s``), in step order
PHASES = ("gen", "reward", "ref", "old_log_prob", "values", "adv", "update_actor", "update_critic")
#: trial user_attr ``memory`` fields, external (outside the trial) first
MEMORY_FIELDS = (
    "external_peak_gb",
    "device_used_peak_gb",
    "allocated_peak_gb",
    "reserved_peak_gb",
    "rss_peak_gb",
)

PARAM_PREFIX = "params."
TIME_PREFIX = "time."
MEM_PREFIX = "mem."


class StudyError(ValueError):
    """The storage or the study cannot be read (one line, meant for the user)."""


# --------------------------------------------------------------------------- storage
def resolve_storage(
    *, storage: Optional[str] = None, out: Optional[str | Path] = None
) -> str:
    """``--storage URL`` or ``--out DIR`` -> a storage spec for :func:`open_storage`.

    A search out dir holds ``study.db`` (SQLite) or ``study.log`` (JournalStorage file).
    """
    if storage and out:
        raise StudyError("give --storage or --out, not both")
    if storage:
        p = Path(storage)
        if "://" not in storage and p.is_dir():
            return resolve_storage(out=p)
        return storage
    if out is None:
        raise StudyError("give --storage URL (with --study NAME) or --out DIR")
    d = Path(out)
    if not d.is_dir():
        raise StudyError(f"{d}: no such search output directory")
    db, log = d / "study.db", d / "study.log"
    if db.is_file():
        return f"sqlite:///{db.resolve()}"
    if log.is_file():
        return f"journal:{log.resolve()}"
    raise StudyError(f"{d}: neither study.db nor study.log found")


def _classify(spec: str) -> tuple[str, str]:
    """-> ("journal", path) or ("rdb", url). Same spellings as ``ppotune search --storage``:
    ``journal:PATH``, a ``*.log``/``*.journal`` path, a ``*.db``/``*.sqlite`` path, or an Optuna URL."""
    if spec.startswith("journal:"):
        path = spec[len("journal:"):]
        return "journal", path[2:] if path.startswith("//") else path
    if spec.startswith("file://"):
        return "journal", spec[len("file://"):]
    if "://" in spec:
        return "rdb", spec
    if Path(spec).suffix in (".db", ".sqlite", ".sqlite3"):
        return "rdb", f"sqlite:///{Path(spec).expanduser().resolve()}"
    return "journal", spec


def open_storage(spec: str) -> optuna.storages.BaseStorage:
    """Open a storage without writing to it.

    ``sqlite:///path`` is reopened as a read-only SQLite URI; other RDB URLs skip
    Optuna's table creation and schema migration; a journal file is only read.
    """
    kind, where = _classify(spec)
    if kind == "journal":
        path = Path(where).expanduser()
        if not path.is_file():
            raise StudyError(f"{path}: journal file not found")
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(path)))
    url = where
    if url.startswith("sqlite:///") and "?" not in url:
        path = url[len("sqlite:///"):]
        if path and path != ":memory:":
            if not Path(path).is_file():
                raise StudyError(f"{path}: SQLite file not found")
            url = f"sqlite:///file:{Path(path).resolve()}?mode=ro&uri=true"
    try:
        return optuna.storages.RDBStorage(url, skip_compatibility_check=True, skip_table_creation=True)
    except Exception as e:  # bad URL, missing driver, unreachable server
        raise StudyError(f"cannot open storage {spec}: {e}") from None


def load_study(storage: str | optuna.storages.BaseStorage, study_name: Optional[str] = None) -> optuna.Study:
    """Load a study; without a name, the storage must hold exactly one."""
    st = open_storage(storage) if isinstance(storage, str) else storage
    try:
        names = [s.study_name for s in st.get_all_studies()]
    except Exception as e:
        raise StudyError(f"cannot read studies from {storage}: {e}") from None
    if study_name is None:
        if len(names) != 1:
            found = ", ".join(names) if names else "none"
            raise StudyError(f"the storage holds {len(names)} studies ({found}); name one with --study")
        study_name = names[0]
    elif study_name not in names:
        raise StudyError(f"no study {study_name!r} in the storage (found: {', '.join(names) or 'none'})")
    return optuna.load_study(study_name=study_name, storage=st)


# --------------------------------------------------------------------------- one study, read once
@dataclasses.dataclass
class StudyView:
    """A study read once: its attributes and one row per trial (see :func:`trials_frame`)."""

    study: optuna.Study
    trials: pd.DataFrame
    storage: str

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
        return self._by_number[number]

    def __post_init__(self) -> None:
        self._by_number = {t.number: t for t in self.study.get_trials(deepcopy=False)}


def load(
    *,
    storage: Optional[str] = None,
    study_name: Optional[str] = None,
    out: Optional[str | Path] = None,
) -> StudyView:
    """``--storage/--study`` or ``--out`` -> a :class:`StudyView` (read-only)."""
    spec = resolve_storage(storage=storage, out=out)
    study = load_study(spec, study_name)
    return StudyView(study=study, trials=trials_frame(study), storage=spec)


def device_memory_gb(study_attrs: dict) -> tuple[Optional[float], str]:
    """The memory a config must fit: the cap the trials ran under, else the device's.

    Returns (GB or None, a label saying which). On CPU a cap is a data-size rlimit
    per rank on top of what the process maps after import, which no RSS figure can be
    held against; there the machine's RAM is the bound (the trials that finished under
    the cap have fit it by construction).
    """
    cap = study_attrs.get("memory_limit_gb")
    dev = study_attrs.get("device") or {}
    total = dev.get("memory_total_gb")
    name = dev.get("name") or dev.get("kind") or "device"
    if cap is not None and dev.get("kind") != "cpu":
        return float(cap), f"memory cap {float(cap):g} GB (--memory-limit-gb)"
    if total is not None:
        label = f"{name} memory {float(total):.1f} GB"
        if cap is not None:
            label += f" (the CPU cap of {float(cap):g} GB per rank is an rlimit, not comparable with RSS)"
        return float(total), label
    return None, "device memory unknown"


def short_knob(key: str) -> str:
    """Drop the ``actor_rollout_ref.`` prefix, which every actor/ref/rollout key shares."""
    return key[len("actor_rollout_ref."):] if key.startswith("actor_rollout_ref.") else key


def knob_columns(df: pd.DataFrame) -> list[str]:
    """The knob names (dotted config keys) present in a :func:`trials_frame`."""
    return [c[len(PARAM_PREFIX):] for c in df.columns if c.startswith(PARAM_PREFIX)]


def _num(v: Any) -> Optional[float]:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def missing(v: Any) -> bool:
    """None, NaN or pd.NA: a value the trial does not have."""
    if v is None or v is pd.NA:
        return True
    return isinstance(v, float) and math.isnan(v)


def _status(t: optuna.trial.FrozenTrial) -> str:
    s = t.user_attrs.get("status")
    if s:
        return str(s)
    if t.state == optuna.trial.TrialState.RUNNING:
        return "running"
    if t.state == optuna.trial.TrialState.WAITING:
        return "waiting"
    if t.state == optuna.trial.TrialState.FAIL:
        return "crash"  # a trial the tuner never classified (e.g. a stale heartbeat)
    return t.state.name.lower()


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per trial, whatever its state (inferred OOMs and failures included).

    Columns: number, state, status, baseline, feasible, pareto, throughput,
    throughput_cv, step_s, peak_memory_gb, memory_source,
    ``mem.<field>`` (:data:`MEMORY_FIELDS`), ``time.<phase>``, duration_s,
    value_throughput / value_memory (the objective values Optuna holds, penalized for
    OOM), inferred_from, confirm_of, duplicate_of, notes, error, datetime_start/complete, and
    ``params.<dotted key>`` for every knob.
    """
    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        status = _status(t)
        mem = ua.get("memory") or {}
        timing = ua.get("timing_s") or {}
        values = t.values if t.values is not None and len(t.values) >= 2 else (None, None)
        cons = t.constraints
        feasible = (
            t.state == optuna.trial.TrialState.COMPLETE
            and status == "ok"
            and all(c <= 0.0 for c in cons.values())
        )
        throughput = _num(ua.get("throughput"))
        peak = _num(ua.get("peak_memory_gb"))
        if feasible:
            throughput = throughput if throughput is not None else _num(values[0])
            peak = peak if peak is not None else _num(values[1])
        duration = _num(ua.get("duration_s"))
        if duration is None and status != "inferred_oom" and t.datetime_start and t.datetime_complete:
            duration = (t.datetime_complete - t.datetime_start).total_seconds()
        row = {
            "number": t.number,
            "state": t.state.name,
            "status": status,
            "baseline": bool(ua.get("baseline", False)),
            "feasible": feasible,
            "throughput": throughput,
            "throughput_cv": _num(ua.get("throughput_cv")),
            "step_s": _num(ua.get("step_s")),
            "peak_memory_gb": peak,
            "memory_source": ua.get("memory_source") or mem.get("external_source"),
            "value_throughput": _num(values[0]),
            "value_memory": _num(values[1]),
            "duration_s": duration,
            "inferred_from": ua.get("inferred_from"),
            "confirm_of": ua.get("confirm_of"),
            # the tuner records a re-sampled config without re-running it (values copied)
            "duplicate_of": ua.get("duplicate_of"),
            "notes": "; ".join(str(n) for n in (ua.get("notes") or [])),
            "error": ua.get("error"),
            "datetime_start": t.datetime_start,
            "datetime_complete": t.datetime_complete,
        }
        for f in MEMORY_FIELDS:
            row[MEM_PREFIX + f] = _num(mem.get(f))
        for p in PHASES:
            row[TIME_PREFIX + p] = _num(timing.get(p))
        for k, v in sorted(t.params.items()):
            row[PARAM_PREFIX + k] = v
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["pareto"] = pareto_mask(df)
    # params last, everything else in the order above
    front = [c for c in df.columns if not c.startswith(PARAM_PREFIX)]
    params = sorted(c for c in df.columns if c.startswith(PARAM_PREFIX))
    df = df[front + params]
    for c in ("inferred_from", "confirm_of", "duplicate_of"):
        df[c] = df[c].astype("Int64")
    # text columns hold None when absent (pandas >= 3 would make them NaN, which is truthy)
    for c in ("memory_source", "error"):
        df[c] = df[c].astype(object).where(df[c].notna(), None)
    return df.sort_values("number").reset_index(drop=True)


def measured_feasible(df: pd.DataFrame) -> pd.Series:
    """Feasible trials with both objectives measured, each config once (duplicates left out)."""
    if df.empty:
        return pd.Series(dtype=bool)
    return (df["feasible"].astype(bool) & df["throughput"].notna() & df["peak_memory_gb"].notna()
            & df["duplicate_of"].isna())


def pareto_mask(df: pd.DataFrame, among: Optional[pd.Series] = None) -> pd.Series:
    """Feasible trials not dominated in (max throughput, min peak memory).

    ``among`` restricts the candidates further (e.g. to those under a headroom).
    """
    cand = measured_feasible(df)
    if among is not None:
        cand &= among.astype(bool)
    mask = pd.Series(False, index=df.index)
    pts = df.loc[cand, ["throughput", "peak_memory_gb"]]
    for i, (thr, mem) in pts.iterrows():
        dominated = (
            (pts["throughput"] >= thr) & (pts["peak_memory_gb"] <= mem)
            & ((pts["throughput"] > thr) | (pts["peak_memory_gb"] < mem))
        ).any()
        mask[i] = not dominated
    return mask


# --------------------------------------------------------------------------- CLI plumbing
def add_study_arguments(parser) -> None:
    """``--storage URL --study NAME`` or ``--out DIR`` (a ``ppotune search`` output dir)."""
    g = parser.add_argument_group("which study")
    g.add_argument("--storage", metavar="URL", help="Optuna storage: sqlite:///study.db, postgresql://..., or a journal file path")
    g.add_argument("--study", metavar="NAME", help="study name (default: the only study in the storage)")
    g.add_argument("--out", metavar="DIR", help="a `ppotune search` output dir (DIR/study.db or DIR/study.log)")


def view_from_args(args) -> StudyView:
    return load(storage=args.storage, study_name=args.study, out=args.out)
