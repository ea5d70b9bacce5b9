"""``ppotune search BASE_CONFIG --space FILE --trials N``: an Optuna study of short, real trials.

The command line around :class:`tuner.search.loop.Search`: it parses the flags into
:class:`tuner.search.loop.SearchOptions`, loads the space and the base config, opens (or creates) the
study, and runs the loop with the real trial runner (:class:`tuner.trials.warm.WarmRunner`: the trials of
one process layout in one long-lived ``ppotune train --serve`` job; ``--cold``:
:class:`tuner.trials.runners.SubprocessRunner`, one ``ppotune train`` process group per trial) and a console
observer (one line per trial, a progress bar, wandb). Objectives: maximize throughput (tokens/s/GPU),
minimize peak memory (GB).

Output: ``<out>/study.db`` (or ``--storage``), ``<out>/trials/<n>/{config.yaml,train.log,result.json}``.

Fail fast: the flags, the space, the base config and its inputs (data files and their columns, the model and its
tokenizer: :mod:`trainer.launch.preflight`) and the storage file are checked before anything is created or
launched (exit 2, one line naming the file and the key); a storage that cannot be opened leaves nothing behind; a
search that cannot work (:class:`tuner.rules.budget.FailureRule`: the baseline failed, or the same error
``--max-failures-in-a-row`` times) stops with the reason, exit 2 when the trainer refused the input, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import optuna
import psutil

from trainer.config import (
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    flatten,
    parse_override,
    read_yaml_mapping,
)
from trainer.config.io import COMMAND_LINE, blame_command_line, check_override_keys
from trainer.contracts import ExitCode, StorageError, parse_storage
from trainer.launch.preflight import preflight
from trainer.verl_engine.result import actor_shape
from tuner.commands.flags import cap_below_floor, cap_text, command_error, overrides_of
from tuner.commands.search_flags import add_search_arguments as add_arguments
from tuner.commands.search_flags import trial_length
from tuner.fit.bounds import bounded_space, fitted_params, read_fit
from tuner.memory_model.shape import ModelShape, param_counts
from tuner.rules.budget import MAX_FAILURES_IN_A_ROW, count_progress
from tuner.rules.finalists import DEFAULT_FINALISTS
from tuner.rules.world import WorldPlan, plan_world, trial_overrides
from tuner.search import plan
from tuner.search.confirmation import DEFAULT_LOAD_WAIT_S
from tuner.search.loop import Search, SearchOptions
from tuner.search.policy import build_sampler
from tuner.search.progress import ConsoleObserver, Display, seed_display, summary
from tuner.search.session import TrialSession
from tuner.search.trial_time import HangLimits, TrialTime, gpu_named, hang_limits, job_of, trial_time
from tuner.space import Space, base_flat_config, from_params, load_space
from tuner.study import lifecycle as st
from tuner.study.opening import OpenedStudy, existing_trials, open_for_search, study_attrs
from tuner.study.selection import Selection
from tuner.study.storage import Leftovers, check_storage_file, close_storage, network_filesystem
from tuner.trials.launch import stop_on_signals
from tuner.trials.memory import gpu_info, nvml_available, visible_gpus
from tuner.trials.runners import SubprocessRunner, VerlEngine
from tuner.trials.warm import WarmRunner

__all__ = ["add_arguments", "run", "options_from_args"]


# --------------------------------------------------------------------------- helpers
def _process_seed(seed: Optional[int], created: bool) -> Optional[int]:
    """The creating process uses ``--seed`` as is (reproducible); a second worker or a resume
    gets a distinct one, else two workers would propose the same configs in lockstep."""
    if seed is None or created:
        return seed
    h = hashlib.sha256(f"{seed}-{os.getpid()}-{time.time_ns()}".encode()).hexdigest()
    return int(h[:8], 16)


def _device(want: str, *, assume_gpu: Optional[str] = None) -> dict:
    """The device a trial runs on (``want``: the config's ``ppotune.device``, or a verl run file's). A GPU job read
    where NVML sees none (a ``--dry-run`` on a laptop) is still a GPU job: its GPU is ``--assume-gpu``'s."""
    if want != "cpu" and nvml_available():
        gpus = visible_gpus()
        name, total = gpu_info(gpus[0]) if gpus else (None, None)
        return {"kind": "cuda", "name": name, "memory_total_gb": total}
    if want == "cuda":
        return {"kind": "cuda", "name": assume_gpu, "memory_total_gb": None}
    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"kind": "cpu", "name": name, "memory_total_gb": psutil.virtual_memory().total / float(1 << 30)}


def _run_options(args: argparse.Namespace) -> dict:
    """``--engine verl``: the run file's ``ppotune:`` section as written (its trial length and device), read ahead of
    :func:`tuner.trials.verl.verl_search`, which checks it; empty for ppotune's engine."""
    if args.engine != "verl":
        return {}
    said = read_yaml_mapping(args.base_config, what="a run file (overrides: [...], ppotune: {...})").get("ppotune")
    return said if isinstance(said, dict) else {}


def _with_trial_length(args: argparse.Namespace, run_options: dict) -> argparse.Namespace:
    """``args`` with ``--steps``/``--warmup`` resolved (:func:`tuner.commands.search_flags.trial_length`): what the
    trials, the study's attributes and the plan all read."""
    steps, warmup = trial_length(args, run_options)
    return argparse.Namespace(**{**vars(args), "steps": steps, "warmup": warmup})


def _trial_time(args: argparse.Namespace, inputs: "_Inputs", device: dict) -> Optional[TrialTime]:
    """A GPU trial's time reckoned from the job (:mod:`tuner.search.trial_time`): the model's shape from its
    ``config.json``, the lengths, the batch and the world from the trial's config; None on a CPU, or where the
    model's shape cannot be read here (the plan's per-device guesses then)."""
    if device["kind"] != "cuda":
        return None
    cfg = config_from_dict(inputs.trial_base)
    actor = actor_shape(cfg.actor_rollout_ref.model.path)
    critic = actor_shape(cfg.critic.model.path) if cfg.critic.model.path else actor
    try:
        counts = param_counts(ModelShape.from_dict(actor)) if actor else None
        critic_counts = param_counts(ModelShape.from_dict(critic)) if critic else None
    except ValueError:  # a config.json without the fields of a decoder-only LM
        return None
    if counts is None:
        return None
    job = job_of(cfg, actor_params=counts.actor, critic_params=critic_counts.critic if critic_counts else None)
    gpu = gpu_named(
        device["name"] or args.assume_gpu, dtype=cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype
    )
    fixed = (plan.VERL_STARTUP_GUESS_S if args.engine == "verl" else plan.STARTUP_GUESS_S)["cuda"]
    return trial_time(job, gpu, fixed_startup_s=fixed)


def _hang_limits(args: argparse.Namespace, device: dict, timing: Optional[TrialTime]) -> HangLimits:
    """The trials' hang limits: from the estimated start-up and step (:func:`tuner.search.trial_time.hang_limits`),
    unless ``--startup-timeout``/``--step-timeout`` say."""
    start, step, _ = plan.trial_guess(device["kind"], args.steps, args.engine, timing)
    return hang_limits(start, step, startup_flag=args.startup_timeout, step_flag=args.step_timeout)


def options_from_args(args: argparse.Namespace, *, seed: Optional[int] = None) -> SearchOptions:
    """The loop's typed options from the parsed flags (``seed``: this process's, see _process_seed)."""
    if getattr(args, "precision", None) is not None and not 0 <= args.precision < 1:
        raise ValueError(f"--precision must be in [0, 1) (0: measure every step), got {args.precision:g}")
    return SearchOptions(
        trials=args.trials,
        sampler=args.sampler,
        seed=args.seed if seed is None else seed,
        timeout_s=args.timeout,
        parallel=args.parallel,
        confirm=args.confirm,
        confirm_wait_s=getattr(args, "confirm_wait", DEFAULT_LOAD_WAIT_S),
        finalists=getattr(args, "finalists", DEFAULT_FINALISTS),
        # the command that confirms later repeats this one (a test's parsed flags have no command line of their own)
        command=tuple(sys.argv[1:]) if sys.argv[1:2] == ["search"] else (),
        probe=getattr(args, "probe", 0),
        predict_oom=not getattr(args, "no_memory_model", False),
        local_every=getattr(args, "local_every", 2),
        corner=not getattr(args, "no_corner", False),
        heartbeat_s=args.heartbeat,
        grace_s=args.grace,
        max_failures_in_a_row=getattr(args, "max_failures_in_a_row", MAX_FAILURES_IN_A_ROW),
        selection=selection_from_args(args),
    )


def selection_from_args(args: argparse.Namespace) -> Selection:
    """``--pick``/``--memory-headroom`` (ValueError: out of range)."""
    return Selection(
        pick=getattr(args, "pick", None) or Selection.pick,
        headroom=Selection.headroom if getattr(args, "memory_headroom", None) is None else args.memory_headroom,
    )


def cli_overrides(args: argparse.Namespace, space: Space) -> dict:
    """``-o KEY=VALUE`` on the base config, checked: a config key (ConfigError naming the command line), and not
    one the space fixes (the space's value would win unseen)."""
    flat = dict(parse_override(o) for o in overrides_of(args))
    check_override_keys(flat, over=args.base_config)
    clash = sorted(set(flat) & set(space.fixed))
    if clash:
        raise ConfigError(clash[0], f"fixed by the space {args.space}: set it there", source=COMMAND_LINE)
    return flat


# --------------------------------------------------------------------------- entry
def _fail(msg: str) -> int:
    return command_error("search", msg)


def _base_config(args: argparse.Namespace, space: Space) -> tuple[dict, Optional[VerlEngine], WorldPlan]:
    """The decision base (ppotune's typed config: the base config + the space's ``fixed`` keys, at the
    trial's world with the production's per-GPU batch, :mod:`tuner.rules.world`), for ``--engine verl`` how verl
    trials run, and the world plan.

    verl: the base is verl's own config (composed by Hydra in the user's verl environment, with the
    overrides a trial on this device adds) read into ppotune's typed config for every key both have."""
    if args.engine == "ppotune":
        over = cli_overrides(args, space)
        try:
            production = base_flat_config(args.base_config, extra={**over, **space.fixed})[1]
        except ConfigError as e:
            raise blame_command_line(e, over, over=args.base_config) from None
        plan = plan_world(
            production,
            trial_world=args.nproc or production["trainer.n_gpus_per_node"],
            target_nodes=args.target_nodes,
            target_gpus_per_node=args.target_gpus_per_node,
            source=args.base_config,
        )
        nested = base_flat_config(args.base_config, extra={**over, **space.fixed, **trial_overrides(plan)})[0]
        return nested, None, plan
    from tuner.trials.verl import check_verl_space, verl_search

    check_verl_space(space)

    return verl_search(
        args.base_config,
        python=args.engine_python,
        nproc=args.nproc,
        steps=args.steps,
        warmup=args.warmup,
        memory_limit_gb=args.memory_limit_gb,
        target_nodes=args.target_nodes,
        target_gpus_per_node=args.target_gpus_per_node,
    )


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a search is about, validated before anything is launched or written."""

    options: SearchOptions
    space: Space
    base_nested: dict  # the decision base: the base config at the trial's world
    verl: Optional[VerlEngine]  # how verl trials run (--engine verl), else None
    plan: WorldPlan
    trial_base: dict  # one complete trial config: the trial command carries only its path and --result
    trial_flat: dict
    fitted: dict = dataclasses.field(default_factory=dict)  # --from-fit: the fit's sizes as params, tried second


def _inputs(args: argparse.Namespace) -> _Inputs:
    """The flags, the space and the base config, validated (``ValueError``: one line naming file and key)."""
    options = options_from_args(args)
    fitted = read_fit(args.from_fit) if getattr(args, "from_fit", None) else {}
    space = bounded_space(load_space(args.space), fitted)[0]  # --from-fit: the fitted sizes are upper bounds
    base_nested, verl, plan = _base_config(args, space)
    trial_extra = {
        "trainer.total_training_steps": args.steps,
        "ppotune.warmup_steps": args.warmup,
        "ppotune.memory_limit_gb": args.memory_limit_gb,
        "ppotune.precision": args.precision or None,
    }
    trial_cfg = config_from_dict(apply_overrides(base_nested, trial_extra), source=args.base_config)
    if verl is None:
        preflight(trial_cfg, source=args.base_config)  # the data files, model and tokenizer every trial reads
    trial_base = config_to_dict(trial_cfg)
    trial_flat = flatten(trial_base)
    if trial_flat.get("ppotune.worst_case"):
        raise ValueError(
            f"{args.base_config}: ppotune.worst_case: true would make every trial a worst-case probe; "
            "the search probes its picks itself (--probe), or run ppotune probe CONFIG"
        )
    space.validate(trial_flat)
    near = fitted_params(space, fitted, trial_flat)
    options = dataclasses.replace(options, fitted=from_params(near))  # the confirmation re-runs the fit's config
    return _Inputs(options, space, base_nested, verl, plan, trial_base, trial_flat, near)


def _below_floor(args: argparse.Namespace, inputs: _Inputs, device: dict) -> Optional[str]:
    """The one line when the trials' cap is below the models' states of the base config (the baseline trial:
    :mod:`tuner.memory_model.floor`): the baseline would die in its set-up, differently every run, and stop the
    search. A config of the space with more states than the baseline is refused by its own trial (``ppotune train``
    checks the same floor)."""
    limit = inputs.verl.memory_limit_gb if inputs.verl is not None else inputs.trial_flat["ppotune.memory_limit_gb"]
    cap = cap_text("--memory-limit-gb", args.memory_limit_gb, "ppotune.memory_limit_gb", limit)
    on_gpu = device["kind"] == "cuda"
    return cap_below_floor("search", inputs.trial_flat, limit_gb=limit, cap=cap, source=args.base_config, on_gpu=on_gpu)


def _warn_if_shared(spec) -> None:
    shared_fs = network_filesystem(spec.path) if spec.path is not None else None
    if shared_fs:
        print(
            f"ppotune search: warning: {spec.path} is on {shared_fs}: a {spec.kind} file shared by several hosts "
            "gets corrupted or locked; workers on several hosts need PostgreSQL (docs/cluster.md)",
            file=sys.stderr,
            flush=True,
        )


def _runner(args: argparse.Namespace, inputs: _Inputs, device: dict, out_dir: Path, limits: HangLimits):
    """The trial runner: a warm job per process layout (ppotune's engine, unless --cold), else one process group
    per trial. A warm job's processes start now, while the study opens and the first trial is asked."""
    runner = SubprocessRunner(
        device_kind=device["kind"],
        nproc=inputs.trial_flat["trainer.n_gpus_per_node"],
        timeout_s=args.trial_timeout,
        grace_s=args.kill_grace,
        verl=inputs.verl,
        startup_timeout_s=limits.startup_s,
        step_timeout_s=limits.step_s,
    )
    if inputs.verl is not None and inputs.verl.sweep_settings > 1:
        from tuner.trials.sweep import SweepRunner  # configs differing only in per-step knobs share a verl run

        return SweepRunner(inner=runner, settings=inputs.verl.sweep_settings)
    if args.cold or inputs.verl is not None:
        return runner
    warm = WarmRunner(cold=runner, jobs_dir=out_dir / "jobs")
    warm.prestart(inputs.trial_base)
    return warm


def run(args: argparse.Namespace) -> int:
    """``ppotune search``: validate, open (or create) the study, search, then the summary (and the report).
    Nothing is created before the inputs and the storage file are checked; a study that cannot be opened
    leaves nothing behind (:class:`tuner.study.storage.Leftovers`)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out_dir = Path(args.out).resolve()
    try:
        run_options = _run_options(args)
        args = _with_trial_length(args, run_options)
        inputs = _inputs(args)
        spec = parse_storage(args.storage, default_dir=out_dir)
        check_storage_file(spec)
    except ValueError as e:  # SpaceError / ConfigError / StorageError / bad option: one line naming file and key
        return _fail(str(e))
    _warn_if_shared(spec)
    want = run_options.get("device", "auto") if inputs.verl is not None else inputs.trial_flat["ppotune.device"]
    device = _device(want, assume_gpu=args.assume_gpu)
    below = _below_floor(args, inputs, device)
    if below is not None:
        return _fail(below)
    timing = _trial_time(args, inputs, device)
    limits = _hang_limits(args, device, timing)
    nproc, parallel = inputs.trial_flat["trainer.n_gpus_per_node"], inputs.options.parallel
    short = device["kind"] == "cuda" and parallel * nproc > len(visible_gpus())
    if short and not args.dry_run:
        return _fail(
            f"--parallel {parallel} x --nproc {nproc} needs {parallel * nproc} GPUs; {len(visible_gpus())} visible"
        )
    if args.dry_run:
        return _dry_run(args, inputs, device, spec, timing, limits)
    left = Leftovers(out_dir, out_dir / "jobs", out_dir / "trials", spec.path, spec.lock_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = _runner(args, inputs, device, out_dir, limits)
    opened: "OpenedStudy | str" = "not opened"
    try:
        opened = _open(args, inputs, device, spec)
        if isinstance(opened, str):
            return _fail(opened)
        return _search(args, inputs, device, spec, out_dir, runner, opened, limits)
    finally:
        if isinstance(runner, WarmRunner):
            runner.close()  # waits for the jobs asked to stop; ends one started ahead and never used
        if isinstance(opened, str):
            left.undo()  # the study could not be opened: nothing of this run stays behind


def _attrs(args: argparse.Namespace, inputs: _Inputs, device: dict) -> dict:
    """The study's attributes; the memory a trial may use (the graded constraint is peak / this - 1) is the cap
    when there is one (on CPU it counts above the post-start level, as the CPU memory objective does), else the
    device's."""
    penalty = args.memory_limit_gb or device["memory_total_gb"] or 80.0
    return study_attrs(
        args, inputs.space, inputs.base_nested, device, penalty, selection_from_args(args), inputs.verl, inputs.plan
    )


def _open(args: argparse.Namespace, inputs: _Inputs, device: dict, spec) -> "OpenedStudy | str":
    """Open (or create) the study (:func:`tuner.study.opening.open_for_search`)."""
    options = inputs.options
    return open_for_search(
        spec,
        args.study or st.default_study_name(args.base_config, args.space),
        _attrs(args, inputs, device),
        space=inputs.space,
        trial_flat=inputs.trial_flat,
        fitted=inputs.fitted,
        sampler=build_sampler(options.sampler, seed=options.seed, n_trials=options.trials),
        heartbeat_s=options.heartbeat_s,
        grace_s=options.grace_s,
        selection=selection_from_args(args),
    )


def _dry_run(
    args: argparse.Namespace, inputs: _Inputs, device: dict, spec, timing: Optional[TrialTime], limits: HangLimits
) -> int:
    """``--dry-run``: everything checked as a search checks it, then the plan and its cost; nothing launched,
    nothing written (the study, if there is one, is only read)."""
    try:
        name = args.study or st.default_study_name(args.base_config, args.space)
        trials, state = existing_trials(spec, name, _attrs(args, inputs, device))
    except (ValueError, StorageError) as e:
        return _fail(str(e))
    sweep = inputs.verl.sweep_settings if inputs.verl is not None else 1
    lines = plan.plan_lines(
        args,
        inputs.options,
        inputs.space,
        inputs.trial_flat,
        device["kind"],
        trials,
        state,
        name,
        spec,
        sweep=sweep,
        timing=timing,
        limits=limits,
    )
    need = inputs.options.parallel * inputs.trial_flat["trainer.n_gpus_per_node"]
    if device["kind"] == "cuda" and need > len(visible_gpus()):  # the plan of a GPU job, read on a smaller machine
        lines.append(f"this machine shows {len(visible_gpus())} GPUs: the search itself needs {need}")
    for line in lines:
        print(f"ppotune search: {line}", flush=True)
    return ExitCode.OK


def _search(
    args: argparse.Namespace,
    inputs: _Inputs,
    device: dict,
    spec,
    out_dir: Path,
    runner,
    opened: OpenedStudy,
    limits: HangLimits,
) -> int:
    """Run the search on the opened study, then say what it found."""
    options, space = inputs.options, inputs.space
    study, storage, created, lock, name = opened.study, opened.storage, opened.created, opened.lock, opened.name
    options = dataclasses.replace(options, seed=_process_seed(args.seed, created))
    study.sampler = build_sampler(options.sampler, seed=options.seed, n_trials=options.trials)
    trials = study.get_trials(deepcopy=False)
    done = count_progress(trials)
    print(
        f"ppotune search: study {name!r} in {spec.display} ({'new' if created else 'resumed'}, "
        f"{done}/{options.trials} trials done) | space {args.space} ({space.size(inputs.trial_flat):,} configs) | "
        f"{device['kind']} x{inputs.trial_flat['trainer.n_gpus_per_node']} per trial | sampler {options.sampler} | "
        f"lock {lock.kind} | out {out_dir}",
        flush=True,
    )
    print(f"ppotune search: {limits.line()}", flush=True)
    if inputs.plan.scaled:
        print(f"ppotune search: {inputs.plan.describe()}", flush=True)
    display = Display(options.trials, done=min(done, options.trials), parallel=options.parallel)
    seed_display(display, trials)
    tracker = None
    if args.wandb:
        from tuner.search.wandb_runs import TrialTracker

        tracker = TrialTracker(project="ppotune", group=name, out_dir=out_dir)
    search = Search(
        options=options,
        session=TrialSession(
            study=study,
            storage=storage,
            lock=lock,
            space=space,
            trial_base=inputs.trial_base,
            trial_flat=inputs.trial_flat,
            runner=runner,
            penalty_gb=opened.penalty_gb,
            trials_dir=out_dir / "trials",
            observer=ConsoleObserver(display, tracker),
            heartbeat=st.Heartbeat(storage, interval_s=options.heartbeat_s),
        ),
    )
    code = _run_search(search, display, spec, name, out_dir, report=args.report)
    if code == ExitCode.OK:
        for line in plan.next_steps(args, spec, out_dir):
            print(f"ppotune search: {line}", flush=True)
    return code


def _run_search(search: Search, display: Display, spec, name: str, out_dir: Path, *, report: bool) -> int:
    """Run it (stopped cleanly by SIGINT/SIGTERM: the interrupted trials run again on the next run), then the
    summary, and the report when asked."""
    search.session.heartbeat.start()
    with stop_on_signals(search.session.stop_event) as got:
        try:
            search.run()
        finally:
            if isinstance(search.session.runner, WarmRunner):
                search.session.runner.close(wait=False)  # the jobs exit while the summary is written; waited for later
            search.session.heartbeat.stop()
            display.close()
    if search.halt is not None:  # it cannot work: the reason, never "done"
        print(
            f"ppotune search: stopped: {search.halt.reason} | {_counts(search.session.study)}",
            file=sys.stderr,
            flush=True,
        )
        close_storage(search.session.storage)
        return search.halt.exit_code
    summary(search.session.study, search)
    close_storage(search.session.storage)  # the database connections go back to the server now, not at exit
    if got:
        print(
            f"ppotune search: stopped by {signal.Signals(got[0]).name}; the interrupted trial(s) will run "
            "again when the same command is re-run",
            flush=True,
        )
        return ExitCode.INTERRUPTED if got[0] == signal.SIGINT else 128 + got[0]
    if report:
        _write_report(spec, name, out_dir)
    return ExitCode.OK


def _counts(study: optuna.Study) -> str:
    """``3 trials: crash 2, ok 1``: the study's trials by status."""
    from tuner.study.frame import trials_frame

    df = trials_frame(study)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(df["status"].value_counts().items())) if not df.empty else ""
    return f"{len(df)} trials: {counts}" if counts else "no trials"


def _write_report(spec, study_name: str, out_dir: Path) -> None:
    from tuner.results.report import write_report

    try:
        where = write_report(spec, study_name, out_dir)
        print(f"ppotune search: report written to {where or out_dir}", flush=True)
    except Exception as e:  # noqa: BLE001 - the study is safe; the report is a view of it
        print(f"ppotune search: --report failed: {type(e).__name__}: {e}", flush=True)
