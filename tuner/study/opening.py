"""Opening the study a search runs on: the attributes it is created with, the checks that refuse a study made for
another search (another space, base config, world or engine), a study that cannot be resumed (its baseline failed,
or it holds what the schema cannot read), and the selection a resumed study records.

The command (:mod:`tuner.commands.search`) composes these; nothing here parses flags or launches a trial.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import optuna

from trainer.contracts import STUDY_SCHEMA_VERSION, StorageError, TrialRecord
from tuner.rules.budget import BASELINE_FAILED
from tuner.space import Space, comparable_space
from tuner.study import lifecycle as st
from tuner.study.schema import name_problem, override_keys_of, read_study_attrs, read_trial
from tuner.study.selection import SELECTION_ATTR, Selection, selection_of
from tuner.study.storage import close_storage, open_storage

__all__ = [
    "study_attrs",
    "incompatible",
    "existing_trials",
    "OpenedStudy",
    "open_for_search",
    "reselect",
    "failed_baseline",
    "unreadable",
]


def study_attrs(
    args,
    space: Space,
    base_nested: dict,
    device: dict,
    penalty_gb: float,
    selection: Selection,
    verl: Any = None,
    plan: Any = None,
) -> dict:
    """The study's attributes for the search ``args`` describe (``verl``: how verl trials run, else None;
    ``plan``: the world the trials stand for)."""
    return {
        "engine": args.engine,
        "engine_python": verl.python if verl else None,
        "engine_overrides": list(verl.base_overrides) if verl else None,
        "base_config": base_nested,
        "base_config_path": str(Path(args.base_config).resolve()),
        "space_path": str(Path(args.space).resolve()),
        "space": space.to_dict(),
        "nproc": base_nested["trainer"]["n_gpus_per_node"],
        "target": plan.to_dict() if plan is not None else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": args.precision or None,
        "device": device,
        "memory_limit_gb": args.memory_limit_gb,
        "penalty_memory_gb": penalty_gb,
        "sampler": args.sampler,
        "seed": args.seed,
        SELECTION_ATTR: selection.to_attr(),
    }


_COMPAT_KEYS = ("engine", "nproc", "target", "steps", "warmup", "memory_limit_gb", "space", "base_config")


def incompatible(study: optuna.Study, attrs: dict) -> Optional[str]:
    """Why ``study`` was made for another search than ``attrs`` describe, or None."""

    def canon(k: str, v):  # a space's advisory fields (speed hints, help) change no config: resumable across them
        v = comparable_space(v) if k == "space" and isinstance(v, dict) else v
        return json.dumps(v, sort_keys=True, default=str)

    have = study.user_attrs
    for k in _COMPAT_KEYS:
        if k in have and canon(k, have[k]) != canon(k, attrs[k]):
            what = k if k in ("space", "base_config") else f"{k}={have[k]!r} (now {attrs[k]!r})"
            return f"study {study.study_name!r} was created with a different {what}; pass --study NAME to start another"
    return None


def existing_trials(spec, name: str, attrs: dict) -> tuple[list, str]:
    """The study a search would resume, read-only (nothing written): (its trials, "new"/"resumed"); or
    ``ValueError`` with the one line a real search would refuse it with."""
    why = name_problem(name, what="the study name (--study)")
    if why:
        raise ValueError(why)
    if spec.path is not None and not spec.path.is_file():
        return [], "new"
    storage = open_storage(spec, read_only=True)
    try:
        if name not in [s.study_name for s in storage.get_all_studies()]:
            return [], "new"
        study = optuna.load_study(study_name=name, storage=storage)
        bad = unreadable(study) or incompatible(study, attrs) or failed_baseline(study)
        if bad:
            raise ValueError(bad)
        return study.get_trials(deepcopy=False), "resumed"
    finally:
        close_storage(storage)


@dataclasses.dataclass(frozen=True)
class OpenedStudy:
    """The study a search runs on, opened and checked."""

    study: optuna.Study
    storage: object
    created: bool
    lock: st.StudyLock
    name: str
    penalty_gb: float


def enqueue_first_trials(study: optuna.Study, space: Space, trial_flat: dict, fitted: Optional[dict] = None) -> None:
    """What a new study runs first: the baseline (the base config's knob values), then ``fitted`` (``--from-fit``'s
    largest sizes that fit) when it differs. benchmarks/replay.py starts its replayed searches the same way."""
    baseline = space.baseline_params(trial_flat)
    study.enqueue_trial(baseline, user_attrs=TrialRecord(baseline=True).to_user_attrs(only={"baseline"}))
    if fitted and fitted != baseline:
        study.enqueue_trial(fitted)


def open_for_search(
    spec,
    name: str,
    attrs: dict,
    *,
    space: Space,
    trial_flat: dict,
    fitted: dict,
    sampler: optuna.samplers.BaseSampler,
    heartbeat_s: float,
    grace_s: float,
    selection: Selection,
) -> "OpenedStudy | str":
    """Open (or create) the study, refusing one created for another search: the study, or the one line why not.
    A new study gets ``attrs``, the baseline trial and (``fitted``: ``--from-fit``'s sizes) the fit's trial."""
    why = name_problem(name, what="the study name (--study)")
    if why:
        return why
    lock = st.StudyLock(spec.lock_path)

    def setup(study: optuna.Study) -> None:
        for k, v in attrs.items():
            study.set_user_attr(k, v)
        enqueue_first_trials(study, space, trial_flat, fitted)
        study.set_user_attr(st.SCHEMA_ATTR, STUDY_SCHEMA_VERSION)  # last: marks the study as set up

    try:
        study, storage, created = st.open_study(
            spec, name, lock, sampler=sampler, setup=setup, heartbeat_s=heartbeat_s, grace_s=grace_s
        )
    except StorageError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - storage errors come in many types
        return f"--storage {spec.display}: {type(e).__name__}: {e}"
    bad = unreadable(study) or incompatible(study, attrs) or failed_baseline(study)
    foreign = None if bad else space.foreign_params(study.get_trials(deepcopy=False))
    if bad or foreign:
        close_storage(storage)
        return bad or f"study {name!r}: {foreign}"
    if not created:
        reselect(study, selection)
    return OpenedStudy(study, storage, created, lock, name, attrs["penalty_memory_gb"])


def reselect(study: optuna.Study, asked: Selection) -> None:
    """A resumed study confirms and probes for this run's ``--pick``/``--memory-headroom``: recorded as the study's
    selection (export's default from now on), said when it changes."""
    had = selection_of(read_study_attrs(study.user_attrs)[0])
    if had.recorded and had.same(asked):
        return
    study.set_user_attr(SELECTION_ATTR, asked.to_attr())
    if had.recorded:
        print(f"ppotune search: the study now recommends by {asked.flags()} (it had {had.flags()})", flush=True)


def failed_baseline(study: optuna.Study) -> Optional[str]:
    """A study whose baseline trial failed (crash, refused, hang) stopped because it cannot work: resuming it would
    run the same inputs again (FailureRule). Why not, or None."""
    for t in study.get_trials(deepcopy=False):
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if rec.baseline and rec.confirm_of is None and rec.status in BASELINE_FAILED:
            first = (str(rec.error or "").strip().splitlines() or ["no error recorded"])[0][:300]
            return (
                f"study {study.study_name!r}: its baseline trial #{t.number} ended {rec.status} ({first}), so a search "
                "on it cannot work; fix the input and start another study (--study NAME)"
            )
    return None


def unreadable(study: optuna.Study) -> Optional[str]:
    """Why a study cannot be resumed: an attribute or a trial that does not fit the schema (the study is data:
    a resumed search would act on it), or None. Report and export still read it, leaving those out."""
    attrs, notes = read_study_attrs(study.user_attrs)
    keys = override_keys_of(attrs.get("space"))
    for t in study.get_trials(deepcopy=False):
        _, why = read_trial(t, override_keys=keys)
        if why:
            notes.append(f"trial #{t.number}: {why}")
    if not notes:
        return None
    more = f" (and {len(notes) - 1} more)" if len(notes) > 1 else ""
    return (
        f"study {study.study_name!r} holds what a search cannot resume from: {notes[0]}{more}; report and export "
        "read it without those; pass --study NAME to start another"
    )
