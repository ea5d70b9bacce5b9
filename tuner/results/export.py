"""``ppotune export``: pick one config from the feasible Pareto front and write it out.

Outputs (in ``--out``; default: the study's search output dir, else the current dir):
- ``best_config.yaml``  the complete training config: the study's base config with the
  chosen trial's overrides applied; ``ppotune train best_config.yaml`` runs it as is.
- ``verl_overrides.txt`` one Hydra ``key=value`` per line, verl keys only.
- ``verl_command.sh``    ``python -m verl.trainer.main_ppo`` with those overrides.
- ``why.md``             the chosen trial, the runner-up, the margin to the OOM boundary.

The pick never changes the algorithm: only the trial's overrides (per-GPU knobs and
their derived keys) are applied; global settings stay as the base config has them. (A space that marked
algorithm knobs on purpose is the exception, and why.md and the console say so first.)

The study is data: what is read from it is checked (:mod:`tuner.study.schema`), every value written into a
comment line is escaped and every argument of ``verl_command.sh`` quoted, and no interpreter named by the study
is written where it would run: ``verl_command.sh`` and the run file use the interpreter given with
``--engine-python`` (else ``python`` on the PATH, and the note says which one the trials ran).

Which trial is :mod:`tuner.results.pick`'s decision and why.md is :mod:`tuner.results.why`'s; both are
re-exported here (``choose``, ``Choice``, ``NoFit``, ``nearest_oom``) as the export's public surface.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import DEFAULT_HEADROOM, ExitCode, StorageError, search_dir_of
from trainer.launch.cliflags import command_error, deprecated
from trainer.verl_engine.overrides import hydra_value, verl_overrides
from tuner.results.pick import PICKS, Choice, NoFit, choose, pct, trial_row
from tuner.results.view import StudyView, add_study_arguments, view_from_args
from tuner.results.why import nearest_oom, why_md
from tuner.rules.finalists import describe
from tuner.rules.units import gb
from tuner.rules.world import WorldPlan, production_overrides
from tuner.study.frame import Fit, headroom_filter
from tuner.study.schema import comment_safe, notes_summary
from tuner.study.selection import Selection, selection_of

__all__ = [
    "PICKS",
    "Choice",
    "Fit",
    "NoFit",
    "headroom_filter",
    "choose",
    "chosen_overrides",
    "best_config",
    "nearest_oom",
    "write_export",
    "add_arguments",
    "run",
]

# Keys a trial sets to make it a short trial, not to tune it: production keeps the
# user's values (the base config holds them).
RUN_KEYS = frozenset(
    {
        "trainer.total_training_steps",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "ppotune.warmup_steps",
        "ppotune.memory_limit_gb",
        "ppotune.fault",
        "ppotune.worst_case",
        "ppotune.wandb",
    }
)


# --------------------------------------------------------------------------- the config
def production_of(view: StudyView) -> dict[str, Any]:
    """The production job's world and global batch sizes (none for a study whose trials ran them)."""
    target = view.attrs.get("target")
    return production_overrides(WorldPlan.from_dict(target)) if target else {}


def chosen_overrides(view: StudyView, number: int) -> dict[str, Any]:
    """The dotted keys trial ``number`` set (knobs + derived), minus the trial-length keys."""
    over = view.record(number).overrides
    if not isinstance(over, dict):
        over = dict(view.trial(number).params)  # contracts.md §3 always records overrides; params are the knobs
    return {k: v for k, v in over.items() if k not in RUN_KEYS}


def best_config(view: StudyView, number: int) -> dict:
    """The study's base config with trial ``number``'s overrides, at the production world with its global
    batch sizes (the study's ``target``, :mod:`tuner.rules.world`; the trials ran them scaled), validated; a full
    nested dict."""
    base = view.attrs.get("base_config")
    if not isinstance(base, dict):
        raise StorageError(f"study {view.name!r} has no base_config user attribute (contracts.md §3)")
    merged = apply_overrides(base, {**chosen_overrides(view, number), **production_of(view)})
    try:
        cfg = config_from_dict(merged, source="best_config.yaml")
    except ConfigError as e:
        raise StorageError(f"the config of trial #{number} does not validate: {e}") from None
    return config_to_dict(cfg)


# --------------------------------------------------------------------------- files
def verl_engine_of(view: StudyView, python: Optional[str] = None):
    """How the study's verl trials ran (``--engine verl``), or None for ppotune's own trainer. ``python``: the
    interpreter the user named (``--engine-python``); the study's own is never taken (None: ``python``)."""
    a = view.attrs
    if a.get("engine") != "verl":
        return None
    from tuner.trials.runners import VerlEngine

    missing = [k for k in ("engine_overrides", "steps", "warmup") if a.get(k) is None]
    if missing:
        raise StorageError(f"study {view.name!r} ran --engine verl but has no usable {missing[0]} attribute")
    return VerlEngine(
        python=python or "python",
        base_overrides=tuple(a["engine_overrides"]),
        steps=a["steps"],
        warmup=a["warmup"],
        memory_limit_gb=a.get("memory_limit_gb"),
    )


def _interpreter_note(view: StudyView, python: Optional[str]) -> Optional[str]:
    """What to say when the trials ran verl with an interpreter the user did not name here."""
    ran = view.attrs.get("engine_python")
    if view.attrs.get("engine") != "verl" or python is not None:
        return None
    where = f" (the study says its trials ran {comment_safe(ran)})" if ran else ""
    return f"verl_command.sh runs `python` from the PATH{where}: pass --engine-python PY to name the interpreter"


def _verl_command(
    view: StudyView, choice: Choice, lines: list[str], python: str = "python", note: Optional[str] = None
) -> str:
    base = {**flatten(view.attrs.get("base_config") or {}), **production_of(view)}
    assumed = [
        f"{k}={hydra_value(base[k])}"
        for k in (
            "data.train_batch_size",
            "data.max_prompt_length",
            "data.max_response_length",
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "actor_rollout_ref.rollout.n",
        )
        if k in base
    ]
    nproc = view.attrs.get("nproc")
    target = view.attrs.get("target")
    if target and target["world"] != target["trial_world"]:
        measured = (
            f" {target['trial_world']} GPUs at the per-GPU batch of a {target['nnodes']} x "
            f"{target['n_gpus_per_node']}-GPU job with"
        )
    else:
        measured = f" {nproc} GPUs per node and" if nproc else ""
    out = [
        "#!/usr/bin/env bash",
        f"# ppotune export: study {comment_safe(view.name)}, trial #{choice.chosen} "
        f"({choice.pick}, headroom {pct(choice.headroom)}).",
    ]
    if view.algorithm_warning:
        out.append(f"# {comment_safe(view.algorithm_warning)}.")
    out += [
        "# The knobs below are per-GPU; they were measured with" + comment_safe(measured) + ":",
        "#   " + comment_safe(" ".join(assumed)),
        "# Append your run's own settings (model path, data files, batch sizes) as arguments: "
        "./verl_command.sh data.train_files=...",
    ]
    if note:
        out.append(f"# {comment_safe(note)}")
    out += [
        "set -euo pipefail",
        f"exec {shlex.quote(python)} -m verl.trainer.main_ppo \\",
    ]
    out += [f"    {shlex.quote(line)} \\" for line in lines]
    out.append('    "$@"')
    return "\n".join(out) + "\n"


def _study_args(view: StudyView) -> str:
    """``--storage URL --study NAME`` for a command line that reads this study again (password masked), for a
    comment line: quoted, then escaped."""
    return comment_safe(f"--storage {shlex.quote(view.storage.display)} --study {shlex.quote(view.name)}")


@dataclasses.dataclass
class ExportResult:
    choice: Choice
    files: dict[str, Path]
    overrides: list[str]
    note: Optional[str] = None  # what the user should know about the interpreter verl_command.sh runs


def write_export(
    view: StudyView,
    out_dir: str | Path,
    *,
    pick: str = "max-throughput",
    headroom: float = DEFAULT_HEADROOM,
    validate_verl: bool = False,
    engine_python: Optional[str] = None,
) -> ExportResult:
    """Choose, validate, then write the four files. Raises :class:`NoFit`/:class:`StorageError`
    (and verl_validate's errors with ``validate_verl``) before writing anything. ``engine_python``: the
    interpreter of the user's verl environment (``--engine-python``), the only one written where it runs."""
    if isinstance(view.attrs.get("fit"), dict):  # its probes are worst cases, not trials to pick from
        raise StorageError(f"study {view.name!r} is a ppotune fit's: its config is the fit.yaml ppotune fit wrote")
    choice = choose(view, pick=pick, headroom=headroom)
    overrides = chosen_overrides(view, choice.chosen)
    verl = verl_engine_of(view, engine_python)
    note = _interpreter_note(view, engine_python)
    if verl is None:
        config = best_config(view, choice.chosen)
        lines = verl_overrides(overrides)
        run_hint = f"ppotune train best_config.yaml --nproc {view.attrs.get('nproc') or 'N'}"
    else:  # exactly what the trial ran, less what a trial adds for itself (trainer.verl_engine.adapter.run_overrides)
        config = verl.run_file(overrides)
        if engine_python is None:
            del config["ppotune"]["python"]  # ppotune train --engine verl then runs the --engine-python it is given
        lines = config["overrides"]
        run_hint = f"ppotune train --engine verl best_config.yaml --engine-python {shlex.quote(engine_python or 'PY')}"
    if validate_verl:
        from tuner.results.verl_validate import validate_overrides

        validate_overrides(lines, python=engine_python)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "best_config": out / "best_config.yaml",
        "verl_overrides": out / "verl_overrides.txt",
        "verl_command": out / "verl_command.sh",
        "why": out / "why.md",
    }
    r = trial_row(view, choice.chosen)
    header = (
        f"# ppotune export: study {comment_safe(view.name)}, trial #{choice.chosen} ({choice.pick}, "
        f"headroom {pct(headroom)}):\n"
        + (f"# {comment_safe(view.algorithm_warning)}.\n" if view.algorithm_warning else "")
        + f"# {r['throughput']:.1f} tokens/s/GPU, peak {gb(r['peak_memory_gb'])} GB. See why.md.\n"
        + (
            f"# Confirmed: {describe(choice.confirmed)}.\n"
            if choice.confirmed is not None and choice.unconfirmed is None
            else "# Unconfirmed: the figure of one short trial (see why.md).\n"
        )
        + f"# Check it on your data: ppotune validate best_config.yaml --steps 20 {_study_args(view)}\n"
        f"# Run it: {comment_safe(run_hint)}\n"
    )
    files["best_config"].write_text(header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    files["verl_overrides"].write_text("".join(line + "\n" for line in lines))
    files["verl_command"].write_text(_verl_command(view, choice, lines, python=engine_python or "python", note=note))
    os.chmod(files["verl_command"], 0o755)
    files["why"].write_text(why_md(view, choice, overrides, lines))
    return ExportResult(choice=choice, files=files, overrides=lines, note=note)


# --------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    add_study_arguments(parser)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where to write the four files (default: the study's search output dir, else the current dir)",
    )
    parser.add_argument("--to", metavar="DIR", help=argparse.SUPPRESS)  # deprecated: --out
    parser.add_argument(
        "--pick",
        choices=PICKS,
        default=None,
        help="which Pareto config: the fastest, the smallest, or the knee (default: the search's --pick, what it "
        "confirmed and probed; else max-throughput)",
    )
    parser.add_argument(
        "--memory-headroom",
        type=float,
        default=None,
        metavar="F",
        help="keep this fraction of device memory free: peak <= (1-F) x device memory (default: the search's "
        f"--memory-headroom, else {DEFAULT_HEADROOM:.2f})",
    )
    parser.add_argument(
        "--engine-python",
        default=None,
        metavar="PY",
        help="a study of --engine verl trials: the interpreter of your verl environment, written into "
        "verl_command.sh and the run file (never the one the study names; default: python on the PATH)",
    )
    parser.add_argument(
        "--validate-verl",
        action="store_true",
        help="compose verl's own ppo_trainer config with the overrides; fail on an unknown or mistyped key",
    )


def _fail(message: str) -> int:
    return command_error("export", message)


def _verl_missing(python: Optional[str] = None) -> Optional[str]:
    """Why --validate-verl cannot run here, or None (``python``: ``--engine-python``, where verl's configs are
    looked for after ``$PPOTUNE_VERL_ROOT``)."""
    import importlib.util

    from tuner.results.verl_validate import VERL_ROOT_ENV, verl_root

    root = verl_root(python)
    if root is None or not (root / "trainer" / "config" / "ppo_trainer.yaml").is_file():
        where = f"the verl of {python}" if python else "a verl importable here"
        return (
            f"--validate-verl: verl's config files not found (looked in ${VERL_ROOT_ENV}, then {where}): set "
            f"{VERL_ROOT_ENV} to verl's package directory, or pass --engine-python PY, your verl environment's "
            "interpreter"
        )
    if importlib.util.find_spec("hydra") is None:
        return "--validate-verl needs hydra-core installed (pip install hydra-core)"
    return None


def _selection(args, view: StudyView) -> Selection:
    """``--pick``/``--memory-headroom``, each defaulting to what the search recorded (ValueError: out of range)."""
    recorded = selection_of(view.attrs)
    return Selection(
        pick=args.pick or recorded.pick,
        headroom=recorded.headroom if args.memory_headroom is None else args.memory_headroom,
    )


def off_selection_note(view: StudyView, choice: Choice, asked: Selection) -> Optional[str]:
    """What to say when ``asked`` is not what the search confirmed and probed for and its pick was not confirmed
    or not probed: which, and the command that would (the search resumed on this study: no new trial, only the
    confirmation and the probe for this pick). None when there is nothing to say."""
    recorded = selection_of(view.attrs)
    if asked.same(recorded):
        return None
    baseline = bool(trial_row(view, choice.chosen)["baseline"])  # the base config: confirmed as the yardstick
    missing = [
        what
        for what, done in (
            ("confirmed", choice.confirmed is not None or baseline),
            ("probed", choice.worst_case is not None),
        )
        if not done
    ]
    if not missing:
        return None
    ran = f"it ran for {recorded.flags()}" if recorded.recorded else "it recorded no --pick/--memory-headroom"
    verbs = " and ".join({"confirmed": "confirm", "probed": "probe"}[m] for m in missing)
    return (
        f"trial #{choice.chosen} ({asked.flags()}) was not {' or '.join(missing)} by the search ({ran}); to {verbs} "
        f"it: {confirm_command(view, asked)}"
    )


def confirm_command(view: StudyView, asked: Selection) -> str:
    """``ppotune search BASE --space SPACE --storage S --study N --trials T ...``: the study's search resumed
    with no new trial (``--trials`` = the trials it holds), so only its confirmation and worst-case probe run, for
    ``asked``. Every value from the study is quoted, then escaped for one line."""
    from tuner.rules.budget import count_progress

    a = view.attrs
    done = count_progress(view.study.get_trials(deepcopy=False))
    words = ["ppotune", "search", a.get("base_config_path") or "BASE_CONFIG", "--space", a.get("space_path") or "SPACE"]
    words += ["--storage", view.storage.display, "--study", view.name, "--trials", str(max(1, done))]
    for flag, key in (("--steps", "steps"), ("--warmup", "warmup"), ("--nproc", "nproc")):
        if a.get(key) is not None:
            words += [flag, str(a[key])]
    if a.get("memory_limit_gb") is not None:
        words += ["--memory-limit-gb", f"{a['memory_limit_gb']:g}"]
    if a.get("engine") == "verl":
        words += ["--engine", "verl"]
    words += ["--pick", asked.pick, "--memory-headroom", f"{asked.headroom:g}"]
    return comment_safe(" ".join(shlex.quote(w) for w in words))


def run(args) -> int:
    missing = _verl_missing(args.engine_python) if args.validate_verl else None
    if missing:
        return _fail(missing)
    from tuner.results.verl_validate import VerlNotInstalled, VerlOverrideError

    if args.to:
        deprecated("export", "--to DIR", "--out DIR")
    try:
        view = view_from_args(args)
        asked = _selection(args, view)
        home = search_dir_of(view.storage)
        to = args.to or args.out or (str(home) if home is not None else ".")
        for line in notes_summary(view.notes):
            print(f"ppotune export: note: {line}", file=sys.stderr)
        if view.algorithm_warning:
            print(f"ppotune export: warning: {view.algorithm_warning}", file=sys.stderr)
        result = write_export(
            view,
            to,
            pick=asked.pick,
            headroom=asked.headroom,
            validate_verl=args.validate_verl,
            engine_python=args.engine_python,
        )
    except (StorageError, VerlNotInstalled, ValueError) as e:
        return _fail(f"verl rejects an override: {e}" if isinstance(e, VerlOverrideError) else str(e))
    _say(view, result, asked, validated=args.validate_verl)
    return ExitCode.OK


def _say(view: StudyView, result: ExportResult, asked: Selection, *, validated: bool) -> None:
    """The console: notes and warnings on stderr, the pick and the files on stdout."""
    c = result.choice
    for line in (result.note, off_selection_note(view, c, asked)):
        if line:
            print(f"ppotune export: note: {line}", file=sys.stderr)
    if c.warning:
        print(f"ppotune export: warning: {c.warning}", file=sys.stderr)
    r = trial_row(view, c.chosen)
    print(f"trial #{c.chosen} ({c.pick}): {r['throughput']:.1f} tokens/s/GPU, peak {gb(r['peak_memory_gb'])} GB")
    if c.confirmed is not None and c.unconfirmed is None:
        print(f"  confirmed: {describe(c.confirmed)}")
    else:
        print(f"  unconfirmed: {c.unconfirmed}")
    if validated:
        print(f"verl accepts the {len(result.overrides)} overrides")
    for f in result.files.values():
        print(f"  {f}")
