"""``ppotune fit BASE --nproc N``: the largest per-GPU sizes whose worst-case step keeps the headroom free.

Parsing and orchestration only: the inputs are checked (:mod:`tuner.fit.inputs`: exit 2, one line naming the file and
the key, before anything is written), the study opened or resumed (every probe is a trial: ``--storage`` as for a
search), the probes run (:class:`tuner.search.fit_probes.FitRun`, the decisions in :mod:`tuner.fit.boundary`), then the
files written (:mod:`tuner.results.fit_files`: ``fit.yaml``, ``verl_overrides.txt``, ``fit.json``, ``why.md``) and, with
``--report``, the report. Exit codes: 0 fitted, 3 not even the smallest sizes fit, 1 a probe failed otherwise (crash,
hang), 2 bad input, 130 Ctrl-C (the same command resumes)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Optional

import optuna

from trainer.config import flatten, parse_override
from trainer.config.io import check_override_keys
from trainer.contracts import (
    DEFAULT_HEADROOM,
    STUDY_SCHEMA_VERSION,
    ExitCode,
    StorageError,
    StorageSpec,
    parse_storage,
)
from tuner.commands.flags import add_override_flag, command_error, floor_of, overrides_of
from tuner.fit.boundary import FitBlocked
from tuner.fit.inputs import FitInputs, fit_inputs, ladder_space
from tuner.memory_model.floor import below_floor
from tuner.search.fit_probes import FIT_ATTR, FitRun, fit_attr, state_of
from tuner.search.session import TrialSession
from tuner.space import space_from_dict
from tuner.study import lifecycle as st
from tuner.study.selection import SELECTION_ATTR, Selection
from tuner.study.storage import Leftovers, check_storage_file, close_storage
from tuner.trials.launch import add_hang_flags, stop_on_signals
from tuner.trials.runners import SubprocessRunner
from tuner.trials.warm import WarmRunner

__all__ = ["add_arguments", "run", "DEFAULT_FIT_DIR"]

#: ``--out``'s default: apart from a search's ``ppotune_out`` (report and export read one study per directory)
DEFAULT_FIT_DIR = "ppotune_fit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base_config", help="base config YAML (verl keys), or with --engine verl a verl run file")
    add_override_flag(p, what="the base config")
    p.add_argument("--nproc", type=int, default=None, help="processes (GPUs) per probe (default: the config's)")
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        metavar="F",
        help="the fraction of the memory a worst-case step keeps free; every probe runs under a real cap of "
        f"(1-F) x the memory (default: {DEFAULT_HEADROOM:g})",
    )
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        metavar="G",
        help="the memory a step must fit per process, a real cap as for a search (default: the GPU's memory; on a "
        "CPU the host's shared by the processes)",
    )
    p.add_argument(
        "--engine",
        choices=["ppotune", "verl"],
        default="ppotune",
        help="what runs a probe: ppotune's FSDP trainer (its memory model proposes each boundary), or verl's own "
        "main_ppo (BASE_CONFIG a verl run file) (default: ppotune)",
    )
    p.add_argument(
        "--engine-python",
        default=None,
        metavar="PY",
        help="--engine verl: your verl environment's python (default: the run file's ppotune.python, else this one)",
    )
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL; journal:PATH for a journal file (default: sqlite:///<out>/study.db)",
    )
    p.add_argument("--study", default=None, help="study name (default: <base>--fit)")
    p.add_argument(
        "--out",
        default=DEFAULT_FIT_DIR,
        metavar="DIR",
        help="where the probes' files, the default storage and fit.yaml, verl_overrides.txt, fit.json, why.md go "
        f"(default: {DEFAULT_FIT_DIR})",
    )
    p.add_argument("--cold", action="store_true", help="start every probe's processes afresh (default: warm jobs)")
    p.add_argument("--report", action="store_true", help="write the report (DIR/report/report.html) when done")
    add_hang_flags(p, subject="a probe", step=False)


def _inputs(args: argparse.Namespace, out: Path) -> tuple[FitInputs, StorageSpec]:
    """The fit and its storage, checked (ValueError: one line naming the file and the key)."""
    flat = dict(parse_override(o) for o in overrides_of(args))
    if flat:
        if args.engine == "verl":
            raise ValueError("-o: --engine verl takes its settings from the run file; put them there")
        check_override_keys(flat, over=args.base_config)
    spec = parse_storage(args.storage, default_dir=out)
    check_storage_file(spec)
    flags = dict(nproc=args.nproc, memory_limit_gb=args.memory_limit_gb, headroom=args.memory_headroom)
    inputs = fit_inputs(args.base_config, engine=args.engine, overrides=flat, engine_python=args.engine_python, **flags)
    below = _below_floor(args, inputs)
    if below is not None:
        raise ValueError(below)
    return inputs, spec


def _below_floor(args: argparse.Namespace, inputs: FitInputs) -> Optional[str]:
    """The one line when the cap every probe runs under is below the models' states (:mod:`tuner.memory_model.floor`):
    no size would fit, and how each probe died would differ from run to run. The flag is named alone when it is below
    by itself, else with the headroom that took the probes' cap below."""
    given = args.memory_limit_gb
    cap = (
        f"--memory-limit-gb {given:g}" if given is not None else f"the device's {inputs.memory_gb:.3g} GiB per process"
    )
    floor = floor_of("fit", inputs.trial_base, cap=cap, on_gpu=inputs.on_gpu)
    if floor is None:
        return None
    alone = below_floor(given, floor, cap=cap, source=args.base_config) if given is not None else None
    less = f"{cap} less --memory-headroom {inputs.headroom:g} ({inputs.limit_gb:.3g} GiB)"
    return alone or below_floor(inputs.limit_gb, floor, cap=less, source=args.base_config)


def _study_attrs(args: argparse.Namespace, inputs: FitInputs) -> dict:
    verl = inputs.verl
    return {
        "engine": inputs.engine,
        "engine_python": verl.python if verl else None,
        "engine_overrides": list(verl.base_overrides) if verl else None,
        "base_config": inputs.base_nested,
        "base_config_path": str(Path(args.base_config).resolve()),
        "space": ladder_space(inputs.knobs),
        "nproc": inputs.trial_base["trainer"]["n_gpus_per_node"],
        "target": inputs.plan.to_dict(),
        "steps": 1,
        "warmup": 0,
        "device": inputs.device,
        "memory_limit_gb": args.memory_limit_gb,
        "penalty_memory_gb": inputs.memory_gb,
        SELECTION_ATTR: Selection(headroom=inputs.headroom).to_attr(),
    }


def _runner(args: argparse.Namespace, inputs: FitInputs, out: Path):
    runner = SubprocessRunner(
        device_kind=inputs.device["kind"],
        nproc=inputs.trial_base["trainer"]["n_gpus_per_node"],
        grace_s=args.kill_grace,
        startup_timeout_s=args.startup_timeout,
        verl=inputs.verl,
    )
    return runner if args.cold or inputs.verl is not None else WarmRunner(cold=runner, jobs_dir=out / "jobs")


def run(args: argparse.Namespace) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = Path(args.out).resolve()
    try:
        inputs, spec = _inputs(args, out)
    except ValueError as e:  # ConfigError / StorageError / a bad flag: one line naming file and key
        return command_error("fit", str(e))
    name = args.study or f"{Path(args.base_config).stem}--fit"
    left = Leftovers(out, out / "jobs", out / "trials", spec.path, spec.lock_path)
    space = space_from_dict(ladder_space(inputs.knobs), source="ppotune fit")
    attrs = _study_attrs(args, inputs)

    def setup(study: optuna.Study) -> None:
        for k, v in {**attrs, FIT_ATTR: fit_attr(inputs, state_of(None, inputs)[0], [])}.items():
            study.set_user_attr(k, v)
        study.set_user_attr(st.SCHEMA_ATTR, STUDY_SCHEMA_VERSION)

    lock = st.StudyLock(spec.lock_path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        sampler = optuna.samplers.RandomSampler(seed=0)  # every probe is enqueued: the sampler never chooses
        study, storage, created = st.open_study(spec, name, lock, sampler=sampler, setup=setup)
        state_of(study.user_attrs.get(FIT_ATTR), inputs)  # a study of another fit is refused
    except (ValueError, StorageError) as e:
        left.undo()
        return command_error("fit", f"study {name!r}: {e}")
    return _fit(args, inputs, spec, name, study, storage, lock, space, out, created)


def _fit(args, inputs: FitInputs, spec, name, study, storage, lock, space, out: Path, created: bool) -> int:
    runner = _runner(args, inputs, out)
    session = TrialSession(
        study=study,
        storage=storage,
        lock=lock,
        space=space,
        trial_base=inputs.trial_base,
        trial_flat=flatten(inputs.trial_base),
        runner=runner,
        penalty_gb=inputs.memory_gb,
        trials_dir=out / "trials",
        heartbeat=st.Heartbeat(storage),
    )
    knobs = "; ".join(f"{k.role} {list(k.ladder)}" for k in inputs.knobs)
    print(
        f"ppotune fit: study {name!r} in {spec.display} ({'new' if created else 'resumed'}) | {inputs.engine} on "
        f"{inputs.device['kind']} x{session.trial_flat['trainer.n_gpus_per_node']} | worst case within "
        f"{inputs.limit_gb:.3f} GB ({1 - inputs.headroom:.0%} of {inputs.memory_gb:.3f} GB) | {knobs}",
        flush=True,
    )
    session.heartbeat.start()
    blocked = None
    with stop_on_signals(session.stop_event) as got:
        try:
            fit = FitRun(inputs, session, say=lambda line: print(line, flush=True))
            fit.run()
        except FitBlocked as e:
            blocked = e
        finally:
            if isinstance(runner, WarmRunner):
                runner.close()
            session.heartbeat.stop()
    code = _finish(args, spec, name, out, blocked, got)
    close_storage(storage)
    return code


def _finish(args, spec, name: str, out: Path, blocked, got) -> int:
    """The files and the console's last lines, and the exit code."""
    from tuner.results.fit_files import fit_summary, write_fit_files
    from tuner.results.view import load

    if got:
        print(f"ppotune fit: stopped by {signal.Signals(got[0]).name}; the same command resumes", flush=True)
        return ExitCode.INTERRUPTED if got[0] == signal.SIGINT else 128 + got[0]
    if blocked is not None:
        print(f"ppotune fit: stopped: {blocked}", file=sys.stderr, flush=True)
        return ExitCode.OOM if blocked.no_size else ExitCode.ERROR
    view = load(storage=spec, study_name=name)
    fit = fit_summary(view)
    if fit is None or not fit.complete:
        none = [r.key for r in (fit.rows if fit else []) if r.value is None]
        print(f"ppotune fit: no size fits the worst case: {', '.join(none) or 'incomplete'}", file=sys.stderr)
        return ExitCode.OOM
    files = write_fit_files(view, out, engine_python=args.engine_python)
    for r in fit.rows:
        peak = f"{r.peak_gb:.3f} GB" if r.peak_gb is not None else "ran"
        nxt = f"{r.next_value}: {r.next_why}" if r.next_value is not None else r.next_why
        print(f"  {r.key} = {r.value} (worst case {peak}; next up {nxt})")
    print(f"ppotune fit: {fit.state.probes} probes; {', '.join(str(f) for f in files.values())}", flush=True)
    if args.report:
        from tuner.results.report import write_report

        print(f"ppotune fit: report written to {write_report(spec, name, out)}", flush=True)
    return ExitCode.OK
