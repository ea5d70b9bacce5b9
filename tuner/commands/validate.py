"""``ppotune validate CONFIG --steps N``: does the exported config hold up here, on this data, for longer?

Runs CONFIG (what ``ppotune export`` wrote: ``best_config.yaml``) and the study's baseline config
(its base config as written) interleaved for ``--rounds R`` rounds of N PPO steps each -- round 1:
config, base; round 2: base, config; ... -- with the runner the search uses
(:class:`tuner.trials.runners.SubprocessRunner`: ``ppotune train`` in its own process group, the same
memory sampler and the same classification), then prints the measured figures against the study's:

- throughput ratio to the baseline: the median of the paired ratios (config / the same round's
  baseline) with its 90% interval (:func:`tuner.rules.finalists.log_interval`), against the study's
  confirmed ratio (the ``confirmation`` study attribute) or, for an unconfirmed study, the ratio of
  the two single trials;
- peak memory: the largest peak over the config's runs, against the study's (confirmed re-runs'
  largest, else the trial's);
- the token lengths the runs saw against the ones the study's trials saw (a warning when a p50 or
  p90 is off by more than 20%: a config tuned on short, skewed prompts can lose to the base config
  on long, uniform ones).

PASS/FAIL (:func:`tuner.results.validation.verdict`): the ratio passes when the measured median is within ±5% of
the study's, or when the measured and the study's 90% intervals overlap; memory passes when the measured peak is at
most the study's + 5% (at least the report's memory noise floor,
:data:`tuner.results.analysis.MEMORY_ABS_TOL_GB`). Why the overlap: a FAIL should mean evidence that
the study's figure does not hold; with a few rounds of a noisy machine (docs/decisions.md#validate-pass-rule)
a ±5% band alone fails a sound config on ordinary noise, and the interval says when the
difference is within it. Wide intervals make a weak PASS: the output prints them, and more
``--rounds`` narrow them. A run of CONFIG that fails (OOM, crash, hang) is a FAIL.

A study of ``--engine verl`` trials: CONFIG is the verl run file export wrote (its ``best_config.yaml``:
``overrides:`` + ``ppotune:``); each run is verl's own ``main_ppo`` with the interpreter ``--engine-python`` names
(or CONFIG's ``ppotune.python``; never the study's), the baseline the study's base overrides; a study that tuned
for a larger world (``--target-nodes``) runs at its trials' world and scaled global sizes (:mod:`tuner.rules.world`).

CONFIG defaults to ``best_config.yaml`` where a bare ``ppotune export`` writes it (the study's search output dir,
else the current dir). Runs go to ``<out>/validate/<k>/`` (``--out DIR``, else the directory holding CONFIG); the
study (``--storage``/``--study``, default ``./ppotune_out``) is only read. ``-o KEY=VALUE`` overrides both CONFIG
and the baseline (your data files, say). Exit codes: 0 PASS, 1 FAIL, 2 bad input (one line naming the file or the
key), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainer.config import (
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    flatten,
    parse_override,
    read_yaml_mapping,
    resolve_follows,
)
from trainer.config.io import blame_command_line, check_override_keys
from trainer.contracts import ExitCode, Status, StorageError
from tuner.commands.flags import add_override_flag, command_error, overrides_of
from tuner.results.validation import StudyFigures, length_warnings, measured_verdict, study_figures
from tuner.rules.finalists import Rerun, schedule
from tuner.study.schema import notes_summary
from tuner.trials.launch import add_hang_flags, next_numbered_dir, stop_on_signals
from tuner.trials.memory import nvml_available
from tuner.trials.runners import SubprocessRunner, TrialRequest

__all__ = ["add_arguments", "run"]

_HEADER_TRIAL = re.compile(r"^# ppotune export: study .*, trial #(\d+)")


# --------------------------------------------------------------------------- reading the inputs
class BadInput(ValueError):
    """One line for the user: exit 2."""


def _run_keys(steps: int, warmup: int, memory_limit_gb: Optional[float]) -> dict:
    # the run's length, nothing else: the knobs and the algorithm are CONFIG's
    return {
        "trainer.total_training_steps": steps,
        "ppotune.warmup_steps": warmup,
        "ppotune.memory_limit_gb": memory_limit_gb,
    }


def _comparable(flat: dict) -> dict:
    from tuner.results.export import RUN_KEYS

    # a null follow-key equals the key it follows: compare what the runs would use
    return {k: v for k, v in resolve_follows(flat).items() if k not in RUN_KEYS and not k.startswith("ppotune.front")}


def _match_trial(view, config_flat: dict, header_trial: Optional[int]) -> Optional[int]:
    """The study's search trial whose exported config equals CONFIG (trial-length keys aside)."""
    from tuner.results.export import best_config

    df = view.trials
    ok = df.loc[(df["status"] == Status.OK) & df["confirm_of"].isna() & df["duplicate_of"].isna(), "number"]
    numbers = [int(n) for n in ok]
    if header_trial in numbers:
        numbers = [header_trial] + [n for n in numbers if n != header_trial]
    want = _comparable(config_flat)
    for n in numbers:
        try:
            if _comparable(flatten(best_config(view, n))) == want:
                return n
        except StorageError:
            continue
    return None


# --------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    from tuner.results.view import add_study_arguments

    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="the exported config (default: best_config.yaml in the study's search output dir, where a bare "
        "ppotune export writes it, else ./best_config.yaml)",
    )
    p.add_argument("--steps", type=int, required=True, help="PPO steps per run, warm-up included")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of config + baseline (default 3)")
    p.add_argument(
        "--warmup", type=int, default=None, help="leading steps left out of each run's figures (default: the study's)"
    )
    p.add_argument(
        "--engine-python",
        metavar="PY",
        default=None,
        help="a study of --engine verl trials: the interpreter of your verl environment (default: CONFIG's "
        "ppotune.python; the study's is never run)",
    )
    add_override_flag(p, what="the config and the baseline alike")
    p.add_argument(
        "--out", metavar="DIR", help="the runs go to DIR/validate/<k>/ (default: the directory holding CONFIG)"
    )
    add_study_arguments(p)
    add_hang_flags(p, subject="a run")


def _fail(msg: str) -> int:
    return command_error("validate", msg)


def _default_config(view) -> str:
    """Where a bare ``ppotune export`` of this study wrote best_config.yaml."""
    from trainer.contracts import search_dir_of

    home = search_dir_of(view.storage)
    path = (home if home is not None else Path(".")) / "best_config.yaml"
    if not path.is_file():
        raise BadInput(f"{path}: not found; run ppotune export first, or name the config: ppotune validate CONFIG")
    return str(path)


def _inputs(args) -> tuple:
    """(view, the nested CONFIG, its trial, the study figures, warmup); BadInput/StorageError/ConfigError."""
    from tuner.results.view import view_from_args

    if args.rounds < 1:
        raise BadInput(f"--rounds must be >= 1, got {args.rounds}")
    view = view_from_args(args)
    if args.config is None:
        args.config = _default_config(view)
    raw = read_yaml_mapping(args.config, what="the config to validate")
    verl = view.attrs.get("engine") == "verl"
    cfg = verl_run_file(raw, args.config) if verl else config_to_dict(config_from_dict(raw, source=args.config))
    if not isinstance(view.attrs.get("base_config"), dict):
        raise BadInput(f"study {view.name!r} has no base_config user attribute (docs/contracts.md section 3)")
    warmup = args.warmup if args.warmup is not None else int(view.attrs.get("warmup") or 0)
    if not 0 <= warmup < args.steps:
        raise BadInput(f"--steps {args.steps} must be more than the warm-up steps ({warmup}): nothing measured")
    m = _HEADER_TRIAL.match(Path(args.config).read_text().splitlines()[0] if Path(args.config).stat().st_size else "")
    header = int(m.group(1)) if m else None
    trial = _match_verl_trial(view, cfg, header) if verl else _match_trial(view, flatten(cfg), header)
    if trial is None:
        raise BadInput(
            f"{args.config}: its knobs match no measured trial of study {view.name!r} (validate what "
            "`ppotune export` wrote for this study)"
        )
    return view, cfg, trial, study_figures(view, trial), warmup


def _session_dir(args) -> Path:
    return next_numbered_dir((Path(args.out) if args.out else Path(args.config).resolve().parent) / "validate")


@dataclass
class _Job:
    """What the rounds run: per label (config, baseline) its runner and its request's config."""

    runners: dict
    configs: dict
    device: str
    nproc: int
    note: Optional[str] = None  # said before the rounds (a verl study run at its trials' world)


def run(args) -> int:
    try:
        view, cfg, trial, study, warmup = _inputs(args)
    except (BadInput, StorageError, ConfigError, OSError) as e:
        return _fail(str(e))
    for note in notes_summary(view.notes):
        print(f"ppotune validate: note: {note}", file=sys.stderr)
    try:
        job = (
            _verl_job(args, view, cfg, warmup) if view.attrs.get("engine") == "verl" else _job(args, view, cfg, warmup)
        )
    except (BadInput, ConfigError) as e:
        return _fail(str(e))
    out = _session_dir(args)
    plan = schedule(["config"], "baseline", args.rounds)
    print(
        f"ppotune validate: {args.config} = trial #{trial} of study {view.name!r}; {args.rounds} interleaved "
        f"round(s) of {args.steps} steps ({warmup} warm-up) against the baseline #{study.baseline}, "
        f"{job.device} x{job.nproc}; runs in {out}",
        flush=True,
    )
    if job.note:
        print(f"ppotune validate: {job.note}", flush=True)
    runs, records, got = _run_rounds(job.runners, job.configs, plan, out)
    if got:
        print(f"ppotune validate: stopped by {signal.Signals(got[0]).name}; nothing decided", flush=True)
        return ExitCode.INTERRUPTED if got[0] == signal.SIGINT else 128 + got[0]
    passed = _conclude(args, view, trial, study, warmup, runs, records, out)
    return ExitCode.OK if passed else ExitCode.ERROR


def _job(args, view, cfg: dict, warmup: int) -> _Job:
    """ppotune's trainer: CONFIG and the study's base config, each with this run's length, on one runner."""
    configs = _run_configs(args, view, cfg, warmup)
    runner, device, nproc = _runner(args, configs["config"])
    return _Job({"config": runner, "baseline": runner}, configs, device, nproc)


def _run_configs(args, view, cfg: dict, warmup: int) -> dict[str, dict]:
    """CONFIG and the study's base config, each with this run's length (ConfigError)."""
    limit = view.attrs.get("memory_limit_gb")
    over = dict(parse_override(o) for o in overrides_of(args))
    check_override_keys(over, over=args.config)
    run_keys = {**over, **_run_keys(args.steps, warmup, limit)}
    try:
        return {
            "config": config_to_dict(config_from_dict(apply_overrides(cfg, run_keys), source=args.config)),
            "baseline": config_to_dict(
                config_from_dict(apply_overrides(view.attrs["base_config"], run_keys), source="the study's base_config")
            ),
        }
    except ConfigError as e:
        raise blame_command_line(e, over, over=e.source) from None


def _runner(args, config: dict) -> tuple[SubprocessRunner, str, int]:
    """The search's cold runner for CONFIG's layout: (runner, device kind, processes)."""
    flat = flatten(config)
    nproc = int(flat["trainer.n_gpus_per_node"])
    device = "cuda" if flat.get("ppotune.device", "auto") != "cpu" and nvml_available() else "cpu"
    runner = SubprocessRunner(
        device_kind=device,
        nproc=nproc,
        grace_s=args.kill_grace,
        startup_timeout_s=args.startup_timeout,
        step_timeout_s=args.step_timeout,
    )
    return runner, device, nproc


# --------------------------------------------------------------------------- a study of verl trials
def verl_run_file(raw: dict, source: str) -> dict:
    """CONFIG of a verl study: a verl run file (``overrides: [key=value, ...]``, ``ppotune: {...}``); BadInput."""
    over = raw.get("overrides")
    if not isinstance(over, list) or not all(isinstance(o, str) and "=" in o for o in over):
        raise BadInput(
            f"{source}: not a verl run file (overrides: [key=value, ...]): validate what `ppotune export` wrote "
            "for this --engine verl study"
        )
    if not isinstance(raw.get("ppotune") or {}, dict):
        raise BadInput(f"{source}: ppotune: must be a mapping")
    return {"overrides": list(over), "ppotune": dict(raw.get("ppotune") or {})}


def _match_verl_trial(view, run_file: dict, header_trial: Optional[int]) -> Optional[int]:
    """The study's search trial whose exported run file has CONFIG's overrides."""
    from tuner.results.export import chosen_overrides, verl_engine_of

    engine = verl_engine_of(view)
    df = view.trials
    ok = df.loc[(df["status"] == Status.OK) & df["confirm_of"].isna() & df["duplicate_of"].isna(), "number"]
    numbers = [int(n) for n in ok]
    if header_trial in numbers:
        numbers = [header_trial] + [n for n in numbers if n != header_trial]
    for n in numbers:
        if engine.run_file(chosen_overrides(view, n))["overrides"] == run_file["overrides"]:
            return n
    return None


def _verl_job(args, view, run_file: dict, warmup: int) -> _Job:
    """verl's main_ppo for CONFIG's overrides and the study's base overrides, at the study's trial world."""
    from tuner.results.export import verl_engine_of
    from tuner.rules.world import WorldPlan, trial_overrides
    from tuner.trials.runners import VerlEngine
    from tuner.trials.verl import world_overrides

    python = args.engine_python or run_file["ppotune"].get("python")
    if not python:
        raise BadInput(
            "--engine-python PY: the interpreter of your verl environment (CONFIG names none; the study's is never run)"
        )
    target = view.attrs.get("target")
    plan = WorldPlan.from_dict(target) if isinstance(target, dict) else None
    world = tuple(world_overrides(trial_overrides(plan))) if plan is not None and plan.scaled else ()
    device = "cuda" if nvml_available() else "cpu"
    study = verl_engine_of(view, python)
    limit = view.attrs.get("memory_limit_gb")

    def runner(base: tuple) -> SubprocessRunner:
        engine = VerlEngine(python, base, steps=args.steps, warmup=warmup, memory_limit_gb=limit, world=world)
        return SubprocessRunner(
            device_kind=device,
            nproc=plan.trial_world if plan is not None else int(view.attrs.get("nproc") or 1),
            grace_s=args.kill_grace,
            verl=engine,
            startup_timeout_s=args.startup_timeout,
            step_timeout_s=args.step_timeout,
        )

    extra = tuple(overrides_of(args))  # -o KEY=VALUE: Hydra overrides of both runs, after their own
    runners = {"config": runner((*run_file["overrides"], *extra)), "baseline": runner((*study.base_overrides, *extra))}
    note = f"at the trials' world: {plan.describe()}" if world else None
    return _Job(runners, {"config": None, "baseline": None}, device, runners["config"].nproc, note)


def _run_rounds(runners: dict, configs: dict, plan: list, out: Path) -> tuple[dict, dict, list]:
    """Every run of ``plan`` in order (each label with its runner), one line each: ({label: [Rerun]}, {label:
    [TrialRecord]}, the signals that stopped it). A stop or an interrupted run ends the round."""
    total = sum(len(r) for r in plan)
    stop = threading.Event()
    runs: dict[str, list] = {"config": [], "baseline": []}
    records: dict[str, list] = {"config": [], "baseline": []}
    k = 0
    with stop_on_signals(stop) as got:
        for r, order in enumerate(plan):
            for label in order:
                if stop.is_set():
                    break
                k += 1
                outcome = runners[label].run(
                    TrialRequest(
                        number=k,
                        config=configs[label],
                        identity=(label,),
                        trial_dir=out / f"{k:02d}-round{r + 1}-{label}",
                    ),
                    stop,
                )
                rec = outcome.record
                if outcome.status == Status.INTERRUPTED:
                    break
                runs[label].append(Rerun(k, outcome.status.value, rec.throughput, rec.peak_memory_gb))
                records[label].append(rec)
                thr = (
                    f"{rec.throughput:.1f} tokens/s/GPU"
                    if rec.throughput
                    else ((rec.error or "?").splitlines() or ["?"])[0]
                )
                print(
                    f"run {k}/{total} round {r + 1} {label:8s} {outcome.status.value:6s} {thr}, peak "
                    f"{rec.peak_memory_gb if rec.peak_memory_gb is not None else float('nan'):.3f} GB, "
                    f"{float(rec.duration_s or 0):.1f} s",
                    flush=True,
                )
    return runs, records, got


def _conclude(args, view, trial: int, study: StudyFigures, warmup: int, runs: dict, records: dict, out: Path) -> bool:
    """Print the checks and the length warnings, write validate.json, print PASS/FAIL; True on PASS."""
    from tuner.results.analysis import lengths_seen, merge_lengths

    v, measured = measured_verdict(runs, records, study)
    study_lengths, n_study = lengths_seen(view)
    here = merge_lengths([x.lengths for x in records["config"] + records["baseline"] if x.lengths])
    warnings = length_warnings(study_lengths, here)
    for line in v.lines:
        print(f"  {line}", flush=True)
    if not study_lengths or not here:
        print("  n/a   lengths: not recorded on one side (study or these runs): not compared", flush=True)
    for w in warnings:
        print(f"  warning: {w}: the data differs from what the study tuned on", flush=True)
    summary = {
        "config": str(Path(args.config).resolve()),
        "study": view.name,
        "storage": view.storage.display,
        "trial": trial,
        "baseline": study.baseline,
        "steps": args.steps,
        "warmup": warmup,
        "rounds": args.rounds,
        "measured": {**measured, "lengths": here},
        "study_figures": {**study.__dict__, "lengths": study_lengths, "lengths_trials": n_study},
        "checks": v.lines,
        "length_warnings": warnings,
        "passed": v.passed,
    }
    (out / "validate.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"ppotune validate: {'PASS' if v.passed else 'FAIL'} ({out / 'validate.json'})", flush=True)
    return v.passed
