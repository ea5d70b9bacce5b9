"""``ppotune search BASE_CONFIG --space FILE --trials N``: an Optuna study of short, real trials.

The command line around :class:`tuner.search.loop.Search`: it parses the flags into
:class:`tuner.search.loop.SearchOptions`, loads the space and the base config, opens (or creates) the
study, and runs the loop with the real trial runner (:class:`tuner.trials.warm.WarmRunner`: the trials of
one process layout in one long-lived ``ppotune train --serve`` job; ``--cold``:
:class:`tuner.trials.runners.SubprocessRunner`, one ``ppotune train`` process group per trial) and a console
observer (one line per trial, a progress bar, wandb). Objectives: maximize throughput (tokens/s/GPU),
minimize peak memory (GB).

Output: ``<out>/study.db`` (or ``--storage``), ``<out>/trials/<n>/{config.yaml,train.log,result.json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import optuna
import psutil

from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import STUDY_SCHEMA_VERSION, ExitCode, StorageError, TrialRecord, parse_storage
from trainer.summary import MIN_MEASURED_STEPS
from tuner.search.decide import count_progress
from tuner.search.loop import Search, SearchOptions
from tuner.search.policy import SAMPLERS, build_sampler
from tuner.search.progress import ConsoleObserver, Display, seed_display, summary
from tuner.space import Space, base_flat_config, comparable_space, load_space
from tuner.stages.confirm import DEFAULT_ROUNDS, MAX_FINALISTS
from tuner.study import lifecycle as st
from tuner.study.storage import close_storage, network_filesystem
from tuner.trials.launch import add_hang_flags, positive_seconds, stop_on_signals
from tuner.trials.memory import gpu_info, nvml_available, visible_gpus
from tuner.trials.runners import SubprocessRunner, VerlEngine
from tuner.trials.warm import WarmRunner
from tuner.world import WorldPlan, plan_world, trial_overrides

__all__ = ["add_arguments", "run", "options_from_args"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags in (_study_flags, _trial_flags, _search_flags, _output_flags):
        flags(p)


def _study_flags(p: argparse.ArgumentParser) -> None:
    """What the search is over and where its study lives."""
    p.add_argument("base_config", help="base config YAML (verl keys); its values are the baseline trial")
    p.add_argument("--space", required=True, help="search space YAML (see search_spaces/)")
    p.add_argument(
        "--trials",
        type=int,
        required=True,
        help="stop when the study holds N counted trials (all processes together; resumes count)",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="start no new trial after S seconds, confirmation re-runs and worst-case probes included (the search "
        "stops early enough to leave them their estimated time, at most half of S)",
    )
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL; journal:PATH or *.log for a journal file (default sqlite:///<out>/study.db)",
    )
    p.add_argument("--study", default=None, help="study name (default: <base>--<space>)")
    p.add_argument(
        "--heartbeat",
        type=float,
        default=st.HEARTBEAT_S,
        metavar="S",
        help=f"write a running trial's heartbeat every S seconds (default {st.HEARTBEAT_S:g})",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=st.STALE_AFTER_S,
        metavar="S",
        help="a trial of another host with no heartbeat for S seconds is interrupted and re-enqueued "
        f"(default {st.STALE_AFTER_S:g})",
    )
    p.add_argument(
        "--out", default="ppotune_out", help="output dir: trials/, the default storage (default ppotune_out)"
    )


def _trial_flags(p: argparse.ArgumentParser) -> None:
    """How each trial runs: its world, steps, measurement, limits."""
    p.add_argument(
        "--nproc", type=int, default=None, help="processes (GPUs) per trial (default: the base config's per node)"
    )
    p.add_argument(
        "--target-nodes",
        type=int,
        default=None,
        metavar="N",
        help="nodes of the production job the trials stand for (default: the base config's trainer.nnodes); a "
        "trial on fewer GPUs runs the global batch sizes scaled by trial world / target world, so each GPU "
        "runs the production's per-GPU batch",
    )
    p.add_argument(
        "--target-gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help="GPUs per node of the production job (default: the base config's trainer.n_gpus_per_node)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=8,
        help="PPO steps per trial at most, warm-up included (default 8; fewer when the measurement is tight)",
    )
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of the measurement (default 1)")
    p.add_argument(
        "--precision",
        type=float,
        default=0.05,
        metavar="P",
        help="a trial stops measuring once its 90%% throughput interval is within +/-P of the median (after "
        f"{MIN_MEASURED_STEPS} measured steps), or once a measured config beats it at no more memory; 0: run "
        "every --steps step (default 0.05)",
    )
    p.add_argument(
        "--trial-timeout",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="kill a trial after S seconds in all and record it as a hang (default: no cap on the whole trial)",
    )
    add_hang_flags(p, subject="a trial")
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        metavar="G",
        help="a real per-process memory cap for every trial (GPU: allocator fraction; CPU: rlimit)",
    )


def _search_flags(p: argparse.ArgumentParser) -> None:
    """How the search proposes, and what runs after it."""
    p.add_argument("--sampler", choices=list(SAMPLERS), default="tpe")
    p.add_argument(
        "--local-every",
        type=int,
        default=2,
        metavar="N",
        help="tpe: once its random start-up is done, every N-th launched trial is an unmeasured config one ordered "
        "step from the fastest measured one (when there is one left); off where the storage has no cross-process lock "
        "(the gRPC proxy, MySQL); 0: the sampler alone (default 2)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--confirm",
        type=int,
        default=DEFAULT_ROUNDS,
        metavar="R",
        help="after the search, re-run the finalists (Pareto points under the export headroom and trials within "
        f"noise of the best, at most {MAX_FINALISTS}) interleaved with the baseline for R rounds; export ranks them "
        f"by the median of paired throughput ratios to the baseline (default {DEFAULT_ROUNDS}; 0: off)",
    )
    p.add_argument(
        "--probe",
        type=int,
        default=MAX_FINALISTS,
        metavar="K",
        help="then run the worst-case probe (one step, every prompt and response at its maximum length; "
        "ppotune probe) of the K configs export would take first; export refuses a pick whose worst case "
        f"breaks the headroom (default {MAX_FINALISTS}; 0: off; the ppotune engine only)",
    )
    p.add_argument(
        "--no-memory-model",
        action="store_true",
        help="launch every candidate: no predicted_oom from the study's calibrated memory model (on by default "
        "once 3 trials are measured: a candidate predicted over the memory limit by more than the model's "
        "leave-one-out error is recorded, not launched)",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
    """How trials start and run, and what is written."""
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="P",
        help="trials at once on this node, each on its own GPU slice (CPU: plain concurrency)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="start every trial's processes afresh (one process group per trial); default: trials of one process "
        "layout run in a warm job that starts once (faults still end it; vLLM-rollout trials always run cold)",
    )
    p.add_argument(
        "--wandb", action="store_true", help="one wandb run per trial, grouped by study (offline without credentials)"
    )
    p.add_argument("--report", action="store_true", help="write the report (DIR/report/report.html) when done")
    p.add_argument(
        "--engine",
        choices=["ppotune", "verl"],
        default="ppotune",
        help="what runs a trial: ppotune's FSDP trainer, or verl's own main_ppo (BASE_CONFIG is then a verl "
        "run file: overrides: [key=value, ...]); default ppotune",
    )
    p.add_argument(
        "--engine-python",
        default=None,
        metavar="PY",
        help="--engine verl: the interpreter of your verl environment (default: this one)",
    )


# --------------------------------------------------------------------------- helpers
def _process_seed(seed: Optional[int], created: bool) -> Optional[int]:
    """The creating process uses ``--seed`` as is (reproducible); a second worker or a resume
    gets a distinct one, else two workers would propose the same configs in lockstep."""
    if seed is None or created:
        return seed
    h = hashlib.sha256(f"{seed}-{os.getpid()}-{time.time_ns()}".encode()).hexdigest()
    return int(h[:8], 16)


def _device(base_flat: dict) -> dict:
    want = base_flat.get("ppotune.device", "auto")
    if want != "cpu" and nvml_available():
        gpus = visible_gpus()
        name, total = gpu_info(gpus[0]) if gpus else (None, None)
        return {"kind": "cuda", "name": name, "memory_total_gb": total}
    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"kind": "cpu", "name": name, "memory_total_gb": psutil.virtual_memory().total / float(1 << 30)}


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
        # verl has no worst-case mode: the probe runs ppotune's own trainer
        probe=0 if getattr(args, "engine", "ppotune") == "verl" else getattr(args, "probe", 0),
        predict_oom=not getattr(args, "no_memory_model", False),
        local_every=getattr(args, "local_every", 2),
        heartbeat_s=args.heartbeat,
        grace_s=args.grace,
    )


# --------------------------------------------------------------------------- entry
def _fail(msg: str) -> int:
    print(f"ppotune search: {msg}", file=sys.stderr)
    return ExitCode.USAGE


def _base_config(args: argparse.Namespace, space: Space) -> tuple[dict, Optional[VerlEngine], WorldPlan]:
    """The decision base (ppotune's typed config: the base config + the space's ``fixed`` keys, at the
    trial's world with the production's per-GPU batch, :mod:`tuner.world`), for ``--engine verl`` how verl
    trials run, and the world plan.

    verl: the base is verl's own config (composed by Hydra in the user's verl environment, with the
    overrides a trial on this device adds) read into ppotune's typed config for every key both have."""
    if args.engine == "ppotune":
        production = base_flat_config(args.base_config, extra=space.fixed)[1]
        plan = plan_world(
            production,
            trial_world=args.nproc or production["trainer.n_gpus_per_node"],
            target_nodes=args.target_nodes,
            target_gpus_per_node=args.target_gpus_per_node,
            source=args.base_config,
        )
        nested = base_flat_config(args.base_config, extra={**space.fixed, **trial_overrides(plan)})[0]
        return nested, None, plan
    if args.target_nodes is not None or args.target_gpus_per_node is not None:
        raise ValueError("--target-nodes/--target-gpus-per-node: not with --engine verl (its world is its own)")
    if space.fixed:
        raise ValueError(
            f"{args.space}: fixed: --engine verl takes its settings from the verl base config; "
            f"put {', '.join(space.fixed)} there"
        )
    from trainer.verl_engine import adapter as verl_engine

    run_spec = verl_engine.load_run(
        args.base_config,
        python=args.engine_python or sys.executable,
        nproc=args.nproc,
        steps=args.steps,
        warmup=args.warmup,
        memory_limit_gb=args.memory_limit_gb,
    )
    nested = verl_engine.decision_base(run_spec, device="cuda" if nvml_available() else "cpu")
    engine = VerlEngine(
        python=run_spec.python,
        base_overrides=tuple(run_spec.overrides),
        steps=args.steps,
        warmup=args.warmup,
        memory_limit_gb=args.memory_limit_gb,
    )
    world = nested["trainer"]["n_gpus_per_node"] * (nested["trainer"].get("nnodes") or 1)
    return nested, engine, WorldPlan(target_nodes=1, target_gpus_per_node=world, trial_world=world)


def _study_attrs(
    args,
    space: Space,
    base_nested: dict,
    device: dict,
    penalty_gb: float,
    verl: Optional[VerlEngine] = None,
    plan: Optional[WorldPlan] = None,
) -> dict:
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
    }


_COMPAT_KEYS = ("engine", "nproc", "target", "steps", "warmup", "memory_limit_gb", "space", "base_config")


def _incompatible(study: optuna.Study, attrs: dict) -> Optional[str]:
    def canon(k: str, v):  # a space's advisory fields (speed hints, help) change no config: resumable across them
        v = comparable_space(v) if k == "space" and isinstance(v, dict) else v
        return json.dumps(v, sort_keys=True, default=str)

    have = study.user_attrs
    for k in _COMPAT_KEYS:
        if k in have and canon(k, have[k]) != canon(k, attrs[k]):
            what = k if k in ("space", "base_config") else f"{k}={have[k]!r} (now {attrs[k]!r})"
            return f"study {study.study_name!r} was created with a different {what}; pass --study NAME to start another"
    return None


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


def _inputs(args: argparse.Namespace) -> _Inputs:
    """The flags, the space and the base config, validated (``ValueError``: one line naming file and key)."""
    options = options_from_args(args)
    space = load_space(args.space)
    base_nested, verl, plan = _base_config(args, space)
    trial_extra = {
        "trainer.total_training_steps": args.steps,
        "ppotune.warmup_steps": args.warmup,
        "ppotune.memory_limit_gb": args.memory_limit_gb,
        "ppotune.precision": args.precision or None,
    }
    trial_base = config_to_dict(config_from_dict(apply_overrides(base_nested, trial_extra), source=args.base_config))
    trial_flat = flatten(trial_base)
    if trial_flat.get("ppotune.worst_case"):
        raise ValueError(
            f"{args.base_config}: ppotune.worst_case: true would make every trial a worst-case probe; "
            "the search probes its picks itself (--probe), or run ppotune probe CONFIG"
        )
    space.validate(trial_flat)
    return _Inputs(options, space, base_nested, verl, plan, trial_base, trial_flat)


def _warn_if_shared(spec) -> None:
    shared_fs = network_filesystem(spec.path) if spec.path is not None else None
    if shared_fs:
        print(
            f"ppotune search: warning: {spec.path} is on {shared_fs}: a {spec.kind} file shared by several hosts "
            "gets corrupted or locked; workers on several hosts need PostgreSQL (README: Tuning on a cluster)",
            file=sys.stderr,
            flush=True,
        )


def _runner(args: argparse.Namespace, inputs: _Inputs, device: dict, out_dir: Path):
    """The trial runner: a warm job per process layout (ppotune's engine, unless --cold), else one process group
    per trial. A warm job's processes start now, while the study opens and the first trial is asked."""
    runner = SubprocessRunner(
        device_kind=device["kind"],
        nproc=inputs.trial_flat["trainer.n_gpus_per_node"],
        timeout_s=args.trial_timeout,
        grace_s=args.kill_grace,
        verl=inputs.verl,
        startup_timeout_s=args.startup_timeout,
        step_timeout_s=args.step_timeout,
    )
    if args.cold or inputs.verl is not None:
        return runner
    warm = WarmRunner(cold=runner, jobs_dir=out_dir / "jobs")
    warm.prestart(inputs.trial_base)
    return warm


def run(args: argparse.Namespace) -> int:
    """``ppotune search``: validate, open (or create) the study, search, then the summary (and the report)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        inputs = _inputs(args)
    except ValueError as e:  # SpaceError / ConfigError / bad option: one line naming file and key
        return _fail(str(e))
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        spec = parse_storage(args.storage, default_dir=out_dir)
    except StorageError as e:
        return _fail(str(e))
    _warn_if_shared(spec)
    device = _device(inputs.trial_flat)
    nproc, parallel = inputs.trial_flat["trainer.n_gpus_per_node"], inputs.options.parallel
    if device["kind"] == "cuda" and parallel * nproc > len(visible_gpus()):
        return _fail(
            f"--parallel {parallel} x --nproc {nproc} needs {parallel * nproc} GPUs; {len(visible_gpus())} visible"
        )
    runner = _runner(args, inputs, device, out_dir)
    try:
        return _search(args, inputs, device, spec, out_dir, runner)
    finally:
        if isinstance(runner, WarmRunner):
            runner.close()  # waits for the jobs asked to stop; ends one started ahead and never used


def _search(args: argparse.Namespace, inputs: _Inputs, device: dict, spec, out_dir: Path, runner) -> int:
    """Open the study (refusing one created for another search), run the search, say what it found."""
    options, space = inputs.options, inputs.space
    # the memory a trial may use: the cap when there is one (on CPU it counts above the post-start level,
    # as the CPU memory objective does), else the device; the graded constraint is peak / this - 1
    penalty = args.memory_limit_gb or device["memory_total_gb"] or 80.0
    attrs = _study_attrs(args, space, inputs.base_nested, device, penalty, inputs.verl, inputs.plan)
    name = args.study or st.default_study_name(args.base_config, args.space)
    lock = st.StudyLock(spec.lock_path)

    def setup(study: optuna.Study) -> None:
        for k, v in attrs.items():
            study.set_user_attr(k, v)
        baseline = space.baseline_params(inputs.trial_flat)
        study.enqueue_trial(baseline, user_attrs=TrialRecord(baseline=True).to_user_attrs(only={"baseline"}))
        study.set_user_attr(st.SCHEMA_ATTR, STUDY_SCHEMA_VERSION)  # last: marks the study as set up

    try:
        study, storage, created = st.open_study(
            spec,
            name,
            lock,
            sampler=build_sampler(options.sampler, seed=options.seed, n_trials=options.trials),
            setup=setup,
            heartbeat_s=options.heartbeat_s,
            grace_s=options.grace_s,
        )
    except StorageError as e:
        return _fail(str(e))
    except Exception as e:  # noqa: BLE001 - storage errors come in many types
        return _fail(f"--storage {spec.display}: {type(e).__name__}: {e}")
    bad = _incompatible(study, attrs)
    foreign = space.foreign_params(study.get_trials(deepcopy=False))
    if bad or foreign:
        return _fail(bad or f"study {name!r}: {foreign}")
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
    if inputs.plan.scaled:
        print(f"ppotune search: {inputs.plan.describe()}", flush=True)
    display = Display(options.trials, done=min(done, options.trials), parallel=options.parallel)
    seed_display(display, trials)
    tracker = None
    if args.wandb:
        from tuner.search.tracking import TrialTracker

        tracker = TrialTracker(project="ppotune", group=name, out_dir=out_dir)
    search = Search(
        options=options,
        study=study,
        storage=storage,
        lock=lock,
        space=space,
        trial_base=inputs.trial_base,
        trial_flat=inputs.trial_flat,
        runner=runner,
        penalty_gb=penalty,
        trials_dir=out_dir / "trials",
        observer=ConsoleObserver(display, tracker),
        heartbeat=st.Heartbeat(storage, interval_s=options.heartbeat_s),
    )
    return _run_search(search, display, spec, name, out_dir, report=args.report)


def _run_search(search: Search, display: Display, spec, name: str, out_dir: Path, *, report: bool) -> int:
    """Run it (stopped cleanly by SIGINT/SIGTERM: the interrupted trials run again on the next run), then the
    summary, and the report when asked."""
    search.heartbeat.start()
    with stop_on_signals(search.stop_event) as got:
        try:
            search.run()
        finally:
            if isinstance(search.runner, WarmRunner):
                search.runner.close(wait=False)  # the jobs exit while the summary is written; waited for later
            search.heartbeat.stop()
            display.close()
    summary(search.study, search)
    close_storage(search.storage)  # the database connections go back to the server now, not at exit
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


def _write_report(spec, study_name: str, out_dir: Path) -> None:
    from tuner.results.report import write_report

    try:
        where = write_report(spec, study_name, out_dir)
        print(f"ppotune search: report written to {where or out_dir}", flush=True)
    except Exception as e:  # noqa: BLE001 - the study is safe; the report is a view of it
        print(f"ppotune search: --report failed: {type(e).__name__}: {e}", flush=True)
