"""``ppotune export``: the study's pick written out (:mod:`tuner.results.export`), in ``--out`` (default: the
study's search output dir, else the current dir), with what the console says about it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional

from trainer.contracts import DEFAULT_HEADROOM, ExitCode, StorageError, search_dir_of
from tuner.commands.flags import command_error, deprecated
from tuner.results.export import ExportResult, write_export
from tuner.results.pick import PICKS, Choice, trial_row
from tuner.results.view import StudyView, add_study_arguments, view_from_args
from tuner.rules.finalists import describe
from tuner.rules.units import gb
from tuner.study.schema import comment_safe, notes_summary
from tuner.study.selection import Selection, selection_of

__all__ = ["add_arguments", "off_selection_note", "confirm_command", "run"]


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
