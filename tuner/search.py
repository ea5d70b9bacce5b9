"""``ppotune search BASE_CONFIG --space FILE --trials N``: an Optuna study of short, real trials.

Each trial is ``ppotune train`` in its own process group (:mod:`tuner.launch`); the tuner
keeps control with ``ask()``/``tell()``. Objectives: maximize throughput (tokens/s/GPU),
minimize peak memory (GB). OOM and hang trials are COMPLETE but infeasible
(``trial.set_constraint``) with penalized values, so TPE/NSGA-II learn the memory boundary;
crash and invalid are FAIL. Before launching a candidate the tuner checks, at zero cost:
the space's constraints and the trainer's config validation (``invalid``), a config
already in the study (``duplicate``: FAIL with ``duplicate_of``, not run, not counted toward
``--trials``; after a few in a row the tuner enqueues an unmeasured config itself), and a
config at least as memory-hungry as a known OOM on every monotone knob (``inferred_oom``).

Output: ``<out>/study.db`` (or ``--storage``), ``<out>/trials/<n>/{config.yaml,train.log,result.json}``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import optuna
import psutil
import yaml
from optuna.trial import FrozenTrial, TrialState

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict, flatten
from tuner import study as st
from tuner.launch import launch_trial, train_command
from tuner.memory import gpu_info, nvml_available, visible_gpus
from tuner.progress import Display, trial_line
from tuner.space import Candidate, Space, base_flat_config, load_space

__all__ = ["add_arguments", "run", "build_sampler"]

EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130
MAX_CONSECUTIVE_FREE = 100  # duplicate proposals in a row before this process gives up
EXPLORE_AFTER_DUPLICATES = 3  # then the next trial is an unmeasured config picked at random
SWEEP_EVERY_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base_config", help="base config YAML (verl keys); its values are the baseline trial")
    p.add_argument("--space", required=True, help="search space YAML (see search_spaces/)")
    p.add_argument("--trials", type=int, required=True,
                   help="stop when the study holds N counted trials (all processes together; resumes count)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="start no new trial after S seconds")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL; journal:PATH or *.log for a journal file (default sqlite:///<out>/study.db)")
    p.add_argument("--study", default=None, help="study name (default: <base>--<space>)")
    p.add_argument("--out", default="ppotune_out", help="output dir: trials/, the default storage (default ppotune_out)")
    p.add_argument("--nproc", type=int, default=None, help="processes (GPUs) per trial (default: the base config's)")
    p.add_argument("--steps", type=int, default=3, help="PPO steps per trial, warm-up included (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="leading steps left out of the measurement (default 1)")
    p.add_argument("--trial-timeout", type=float, default=600.0, metavar="S",
                   help="kill a trial after S seconds and record it as a hang (default 600)")
    p.add_argument("--memory-limit-gb", type=float, default=None, metavar="G",
                   help="a real per-process memory cap for every trial (GPU: allocator fraction; CPU: rlimit)")
    p.add_argument("--sampler", choices=["tpe", "nsga2", "random", "grid"], default="tpe")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--confirm", type=int, default=0, metavar="K",
                   help="after the search, re-run the top K Pareto configs (new trials with confirm_of)")
    p.add_argument("--parallel", type=int, default=1, metavar="P",
                   help="trials at once on this node, each on its own GPU slice (CPU: plain concurrency)")
    p.add_argument("--wandb", action="store_true", help="one wandb run per trial, grouped by study (offline without credentials)")
    p.add_argument("--report", action="store_true", help="write the report (tuner.report) when done")
    p.add_argument("--kill-grace", type=float, default=10.0, metavar="S", help=argparse.SUPPRESS)


# --------------------------------------------------------------------------- samplers
def build_sampler(name: str, *, seed: Optional[int], n_trials: int) -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            # The default 10 random start-up trials would be the whole budget of a short search.
            return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(3, min(10, n_trials // 3)),
                                              multivariate=True, group=True, constant_liar=True)
        if name == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(50, n_trials // 3)))
        # grid: the tuner enqueues grid points itself (GridSampler cannot do conditional knobs)
        return optuna.samplers.RandomSampler(seed=seed)


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


# --------------------------------------------------------------------------- one search
@dataclass
class Prepared:
    """A trial asked from Optuna and decided on, before (maybe) launching it."""

    trial: optuna.trial.Trial
    cand: Candidate
    baseline: bool = False
    confirm_of: Optional[int] = None
    decision: str = "launch"  # launch | invalid | duplicate | inferred_oom
    error: Optional[str] = None
    source: Optional[FrozenTrial] = None  # duplicate / inferred-from trial


@dataclass
class Search:
    args: argparse.Namespace
    study: optuna.Study
    storage: Any
    lock: st.StudyLock
    space: Space
    trial_base: dict  # nested base for trials: base + nproc + steps + warmup + memory cap
    trial_flat: dict
    out_dir: Path
    device: dict
    penalty_gb: float
    display: Optional[Display] = None
    tracker: Any = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    heartbeat: Optional[st.Heartbeat] = None
    _last_sweep: float = 0.0
    _free_in_a_row: int = 0
    _stopped_reason: Optional[str] = None
    _started: float = field(default_factory=time.monotonic)
    _grid: Optional[list] = None
    _size: Optional[int] = None
    _dup_in_a_row: int = 0
    _rng: random.Random = field(default_factory=random.Random)

    # ---- identity of trials already in the study
    def _eff(self, t: FrozenTrial) -> Optional[dict]:
        ov = t.user_attrs.get("overrides")
        if not isinstance(ov, dict):
            return None
        return {**self.trial_flat, **ov}

    def _known(self, trials: list[FrozenTrial]) -> dict:
        """identity -> the trial that measured it (finished first, else running)."""
        known: dict = {}
        for t in trials:
            if t.state not in (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING):
                continue
            ua = t.user_attrs
            if ua.get("status") in ("interrupted", "duplicate") or ua.get("confirm_of") is not None:
                continue
            eff = self._eff(t)
            if eff is None:
                continue
            ident = self.space.identity(eff)
            prev = known.get(ident)
            if prev is None or (prev.state == TrialState.RUNNING and t.state != TrialState.RUNNING):
                known[ident] = t
        return known

    # ---- stop conditions
    def _should_stop(self, trials: list[FrozenTrial]) -> Optional[str]:
        if self.stop_event.is_set():
            return "interrupted"
        if st.count_progress(trials) >= self.args.trials:
            return f"the study holds {self.args.trials} counted trials"
        if self.args.timeout is not None and time.monotonic() - self._started > self.args.timeout:
            return f"--timeout {self.args.timeout:g} s reached"
        if self._free_in_a_row >= MAX_CONSECUTIVE_FREE:
            return f"the sampler proposed {MAX_CONSECUTIVE_FREE} already-measured configs in a row"
        return None

    def _next_grid_point(self, known: dict) -> Optional[Candidate]:
        if self._grid is None:
            self._grid = list(self.space.grid(self.trial_flat))
            random.Random(self.args.seed).shuffle(self._grid)
        for cand in self._grid:
            if self.space.identity(cand.effective) not in known:
                return cand
        return None

    def _unmeasured(self, known: dict) -> Optional[Candidate]:
        """A random config not yet in the study (the grid when it is small, else sampling)."""
        if self._space_size() <= 100_000:
            return self._next_grid_point(known)
        for _ in range(200):
            cand = self.space.sample(self.trial_flat, self._rng)
            if cand is not None and self.space.identity(cand.effective) not in known:
                return cand
        return None

    def _space_size(self) -> int:
        if self._size is None:
            self._size = self.space.size(self.trial_flat, limit=100_000)
        return self._size

    # ---- ask (under the lock): decide what to do with the next trial
    def ask(self) -> Optional[Prepared]:
        with self.lock():
            now = time.monotonic()
            if now - self._last_sweep > SWEEP_EVERY_S:
                self._sweep()
            trials = self.study.get_trials(deepcopy=False)
            reason = self._should_stop(trials)
            if reason:
                self._stopped_reason = self._stopped_reason or reason
                return None
            known = self._known(trials)
            waiting = any(t.state == TrialState.WAITING for t in trials)
            if not waiting:
                size = self._space_size()
                if sum(1 for t in known.values() if t.user_attrs.get("status") != "invalid") >= size:
                    self._stopped_reason = f"every one of the {size} configs of the space is in the study"
                    return None
                if self.args.sampler == "grid" or self._dup_in_a_row >= EXPLORE_AFTER_DUPLICATES:
                    # grid: our own enumeration (GridSampler cannot do conditional knobs);
                    # otherwise the sampler keeps proposing measured configs: explore instead.
                    point = self._unmeasured(known)
                    if point is None:
                        self._stopped_reason = "no unmeasured config left"
                        return None
                    self.study.enqueue_trial(point.params, skip_if_exists=False)
                    self._dup_in_a_row = 0
            trial = self.study.ask()
            try:
                return self._prepare(trial, known)
            except Exception as e:  # noqa: BLE001 - e.g. enqueued params outside the space
                prep = Prepared(trial=trial, cand=Candidate(params=dict(trial.params), overrides={}, effective={}),
                                decision="invalid", error=f"tuner: could not prepare the trial: {type(e).__name__}: {e}")
                return prep

    def _prepare(self, trial: optuna.trial.Trial, known: dict) -> Prepared:
        ua = trial.user_attrs
        trial.set_user_attr("owner", st.owner_info())
        trial.set_user_attr("heartbeat", time.time())
        if self.heartbeat is not None:
            self.heartbeat.add(trial._trial_id)
        confirm_of = ua.get("confirm_of")
        baseline = bool(ua.get("baseline", False))
        if confirm_of is not None:
            orig = self.study.get_trials(deepcopy=False)[int(confirm_of)]
            restrict = set(orig.params)
            self.space.suggest(trial, self.trial_flat, restrict=restrict)
            overrides = dict(orig.user_attrs.get("overrides") or {})
            cand = Candidate(params=dict(trial.params), overrides=overrides, effective={**self.trial_flat, **overrides})
            baseline = False
        elif baseline:
            restrict = set(self.space.baseline_params(self.trial_flat))
            self.space.suggest(trial, self.trial_flat, restrict=restrict)
            cand = Candidate(params=dict(trial.params), overrides={}, effective=dict(self.trial_flat))
        else:
            cand = self.space.suggest(trial, self.trial_flat)
        trial.set_user_attr("baseline", baseline)
        trial.set_user_attr("overrides", cand.overrides)
        prep = Prepared(trial=trial, cand=cand, baseline=baseline, confirm_of=confirm_of)
        if cand.error:
            prep.decision, prep.error = "invalid", f"space: {cand.error}"
            return prep
        if cand.violated:
            prep.decision, prep.error = "invalid", f"space: constraint not satisfied: {cand.violated}"
            return prep
        try:
            config_from_dict(apply_overrides(self.trial_base, cand.overrides))
        except ConfigError as e:
            prep.decision, prep.error = "invalid", f"config: {e}"
            return prep
        if confirm_of is not None:
            return prep
        ident = self.space.identity(cand.effective)
        prev = known.get(ident)
        if prev is not None and prev.number != trial.number:
            prep.source, prep.decision = prev, "duplicate"
            return prep
        for t in known.values():
            if t.user_attrs.get("status") == "oom" and t.state == TrialState.COMPLETE:
                eff = self._eff(t)
                if eff is not None and self.space.at_least_as_hungry(cand.effective, eff):
                    prep.decision, prep.source = "inferred_oom", t
                    return prep
        return prep

    def _sweep(self) -> None:
        self._last_sweep = time.monotonic()
        swept = st.sweep_stale(self.study, self.storage)
        if swept and self.display:
            self.display.message(f"ppotune search: trial(s) {swept} were left RUNNING by a dead tuner: "
                                 "marked interrupted, params enqueued again")

    # ---- run / record
    def _common_attrs(self, prep: Prepared) -> dict:
        # overrides, baseline, owner and heartbeat were set when the trial was asked
        attrs = {"throughput": None,
                 "throughput_cv": None, "step_s": None, "peak_memory_gb": None, "memory_source": None,
                 "memory": None, "timing_s": {}, "notes": [], "error": None, "log_tail": None,
                 "log_path": None, "result_path": None, "config_path": None, "duration_s": 0.0}
        if prep.confirm_of is not None:
            attrs["confirm_of"] = int(prep.confirm_of)
        return attrs

    def process(self, prep: Prepared, slot: int) -> None:
        trial = prep.trial
        attrs = self._common_attrs(prep) if prep.decision != "duplicate" else {"duration_s": 0.0}
        values = None
        if self.stop_event.is_set() and prep.decision == "launch":
            self._interrupt_own(trial, "interrupted before launch: the tuner was stopped")
            return
        if prep.decision == "invalid":
            status, attrs["error"] = "invalid", prep.error
        elif prep.decision == "duplicate":
            # Not run again and not a second data point: the original holds the measurement.
            src = prep.source
            status = "duplicate"
            attrs["duplicate_of"] = src.number
            attrs["error"] = (f"duplicate: the sampler proposed the config of trial {src.number} "
                              f"({src.user_attrs.get('status') or src.state.name.lower()}); not run")
        elif prep.decision == "inferred_oom":
            status = "inferred_oom"
            attrs["inferred_from"] = prep.source.number
            attrs["error"] = (f"inferred OOM: at least as memory-hungry as trial {prep.source.number} "
                              "(an OOM) on every monotone knob; not launched")
            values = (0.0, self.penalty_gb)
        else:
            status, values = self._launch(prep, slot, attrs)
            if status == "interrupted":
                self._interrupt_own(trial, attrs.get("error") or "interrupted", attrs)
                return
        frozen = st.finish(self.study, trial, status, attrs, values=values)
        if self.heartbeat is not None:
            self.heartbeat.remove(trial._trial_id)
        free = prep.decision == "duplicate"
        self._free_in_a_row = self._free_in_a_row + 1 if free else 0
        self._dup_in_a_row = self._dup_in_a_row + 1 if free else 0
        self._report(frozen, status, attrs, prep)

    def _interrupt_own(self, trial: optuna.trial.Trial, reason: str, attrs: Optional[dict] = None) -> None:
        frozen = self.storage.get_trial(trial._trial_id)
        extra = {k: v for k, v in (attrs or {}).items() if k not in ("status", "error")}
        st.interrupt(self.study, self.storage, frozen, reason, extra_attrs=extra)
        if self.heartbeat is not None:
            self.heartbeat.remove(trial._trial_id)
        if self.display:
            self.display.message(f"trial {trial.number:4d} interrupted (params enqueued again)")

    def _launch(self, prep: Prepared, slot: int, attrs: dict) -> tuple[str, Optional[tuple]]:
        a = self.args
        trial_dir = self.out_dir / "trials" / str(prep.trial.number)
        trial_dir.mkdir(parents=True, exist_ok=True)
        config_path = trial_dir / "config.yaml"
        result_path = trial_dir / "result.json"
        nested = config_to_dict(config_from_dict(apply_overrides(self.trial_base, prep.cand.overrides)))
        config_path.write_text(yaml.safe_dump(nested, sort_keys=False))
        cmd = train_command(config_path, nproc=self.trial_flat["trainer.n_gpus_per_node"], steps=a.steps,
                            warmup=a.warmup, result_path=result_path, memory_limit_gb=a.memory_limit_gb)
        gpus = self._gpu_slice(slot)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus is not None else None
        run = launch_trial(cmd, trial_dir=trial_dir, result_path=result_path, timeout_s=a.trial_timeout,
                           grace_s=a.kill_grace, extra_env=env, stop_event=self.stop_event, gpus=gpus,
                           use_nvml=self.device["kind"] == "cuda")
        res = run.result or {}
        summary = res.get("summary") or {}
        mem = run.memory
        inner_peak = summary.get("peak_memory_gb")
        peaks = [p for p in (mem.external_peak_gb, inner_peak) if p is not None]
        attrs.update({
            "throughput": summary.get("throughput"), "throughput_cv": summary.get("throughput_cv"),
            "step_s": summary.get("step_s"), "peak_memory_gb": max(peaks) if peaks else None,
            "memory_source": mem.external_source,
            "memory": {"external_peak_gb": mem.external_peak_gb, "external_source": mem.external_source,
                       "device_used_peak_gb": mem.device_used_peak_gb,
                       "process_peak_gb": mem.process_peak_gb, "tree_rss_peak_gb": mem.tree_rss_peak_gb,
                       "process_rss_peak_gb": mem.process_rss_peak_gb,
                       "allocated_peak_gb": summary.get("peak_memory_allocated_gb"),
                       "reserved_peak_gb": summary.get("peak_memory_reserved_gb"),
                       "rss_peak_gb": summary.get("peak_rss_gb"), "samples": mem.samples},
            "timing_s": summary.get("timing_s") or {}, "notes": list(res.get("notes") or []),
            "error": run.error, "log_tail": run.log_tail, "log_path": run.log_path,
            "result_path": run.result_path, "config_path": str(config_path), "duration_s": run.duration_s,
            "returncode": run.returncode, "oom_phase": res.get("oom_phase"),
        })
        if gpus is not None:
            attrs["gpus"] = gpus
        if run.leftover_pids:
            attrs["notes"].append(f"processes still alive after cleanup: {run.leftover_pids}")
        if run.status == "ok":
            return "ok", (float(attrs["throughput"]), float(attrs["peak_memory_gb"] or 0.0))
        if run.status in ("oom", "hang"):
            return run.status, (0.0, self.penalty_gb)
        return run.status, None

    def _gpu_slice(self, slot: int) -> Optional[list[str]]:
        if self.device["kind"] != "cuda":
            return None
        n = self.trial_flat["trainer.n_gpus_per_node"]
        gpus = visible_gpus()
        return gpus[slot * n:(slot + 1) * n]

    def _report(self, frozen: FrozenTrial, status: str, attrs: dict, prep: Prepared) -> None:
        note = ""
        if status == "duplicate":
            note = f"same config as trial {attrs['duplicate_of']} (not run, not counted)"
        elif status == "inferred_oom":
            note = f"inferred from OOM trial {attrs['inferred_from']} (not launched)"
        elif prep.baseline:
            note = "baseline"
        elif prep.confirm_of is not None:
            note = f"confirms trial {prep.confirm_of}"
        if attrs.get("error") and status not in ("inferred_oom", "duplicate"):
            note = (note + " | " if note else "") + str(attrs["error"]).splitlines()[0][:160]
        params = dict(frozen.params)
        line = trial_line(frozen.number, status, throughput=attrs.get("throughput") if status == "ok" else None,
                          memory_gb=attrs.get("peak_memory_gb"), seconds=float(attrs.get("duration_s") or 0.0),
                          params=params, note=note)
        if self.display:
            self.display.trial_done(line, counted=st.counted(frozen), status=status,
                                    throughput=attrs.get("throughput"), memory_gb=attrs.get("peak_memory_gb"),
                                    number=frozen.number, duration_s=float(attrs.get("duration_s") or 0.0))
        if self.tracker is not None and status != "duplicate":
            self.tracker.log_trial(frozen.number, status=status, params=params, overrides=prep.cand.overrides,
                                   attrs=attrs, values=tuple(frozen.values) if frozen.values else None)

    # ---- workers
    def worker(self, slot: int) -> None:
        while not self.stop_event.is_set():
            prep = self.ask()
            if prep is None:
                return
            try:
                self.process(prep, slot)
            except Exception as e:  # a bug here must not leave the trial RUNNING forever
                self._fail_unexpected(prep.trial, e)
                raise

    def _fail_unexpected(self, trial: optuna.trial.Trial, e: Exception) -> None:
        try:
            frozen = self.storage.get_trial(trial._trial_id)
            if not frozen.state.is_finished():
                st.interrupt(self.study, self.storage, frozen, f"interrupted: tuner error {type(e).__name__}: {e}")
        except Exception:
            pass

    def confirm(self, k: int) -> None:
        """Re-run the top ``k`` Pareto configs (by throughput) once each, as new trials."""
        with self.lock():
            trials = self.study.get_trials(deepcopy=False)
            already = {t.user_attrs.get("confirm_of") for t in trials
                       if "confirm_of" in t.user_attrs and t.user_attrs.get("status") != "interrupted"}
            front = [t for t in self.study.best_trials
                     if t.user_attrs.get("status") == "ok" and t.user_attrs.get("confirm_of") is None]
            front.sort(key=lambda t: -t.values[0])
            todo = [t for t in front[:k] if t.number not in already]
        for orig in todo:
            if self.stop_event.is_set():
                return
            with self.lock():
                self.study.enqueue_trial(dict(orig.params), user_attrs={"confirm_of": orig.number},
                                         skip_if_exists=False)
                trial = self.study.ask()
                prep = self._prepare(trial, {})
            self.process(prep, 0)


# --------------------------------------------------------------------------- entry
def _fail(msg: str) -> int:
    print(f"ppotune search: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _study_attrs(args, space: Space, base_nested: dict, device: dict, penalty_gb: float) -> dict:
    return {
        "base_config": base_nested,
        "base_config_path": str(Path(args.base_config).resolve()),
        "space_path": str(Path(args.space).resolve()),
        "space": space.to_dict(),
        "nproc": base_nested["trainer"]["n_gpus_per_node"],
        "steps": args.steps,
        "warmup": args.warmup,
        "device": device,
        "memory_limit_gb": args.memory_limit_gb,
        "penalty_memory_gb": penalty_gb,
        "sampler": args.sampler,
        "seed": args.seed,
    }


_COMPAT_KEYS = ("nproc", "steps", "warmup", "memory_limit_gb", "space", "base_config")


def _incompatible(study: optuna.Study, attrs: dict) -> Optional[str]:
    have = study.user_attrs
    for k in _COMPAT_KEYS:
        if k in have and json.dumps(have[k], sort_keys=True, default=str) != json.dumps(attrs[k], sort_keys=True, default=str):
            what = k if k in ("space", "base_config") else f"{k}={have[k]!r} (now {attrs[k]!r})"
            return f"study {study.study_name!r} was created with a different {what}; pass --study NAME to start another"
    return None


def run(args: argparse.Namespace) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.trials < 1:
        return _fail("--trials must be >= 1")
    if args.parallel < 1:
        return _fail("--parallel must be >= 1")
    try:
        space = load_space(args.space)
        base_nested, base_flat = base_flat_config(args.base_config, nproc=args.nproc)
        trial_extra = {"trainer.total_training_steps": args.steps, "ppotune.warmup_steps": args.warmup,
                       "ppotune.memory_limit_gb": args.memory_limit_gb}
        trial_base = config_to_dict(config_from_dict(apply_overrides(base_nested, trial_extra),
                                                     source=args.base_config))
        trial_flat = flatten(trial_base)
        space.validate(trial_flat)
    except ValueError as e:  # SpaceError / ConfigError: one line naming file and key
        return _fail(str(e))
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        spec = st.resolve_storage(args.storage, out_dir)
    except ValueError as e:
        return _fail(str(e))
    device = _device(trial_flat)
    nproc = trial_flat["trainer.n_gpus_per_node"]
    if device["kind"] == "cuda" and args.parallel * nproc > len(visible_gpus()):
        return _fail(f"--parallel {args.parallel} x --nproc {nproc} needs {args.parallel * nproc} GPUs; "
                     f"{len(visible_gpus())} visible")
    if device["kind"] == "cuda":
        penalty = args.memory_limit_gb or device["memory_total_gb"] or 80.0
    else:
        penalty = device["memory_total_gb"]
    attrs = _study_attrs(args, space, base_nested, device, penalty)
    name = args.study or st.default_study_name(args.base_config, args.space)
    lock = st.StudyLock(spec.lock_path)

    def setup(study: optuna.Study) -> None:
        for k, v in attrs.items():
            study.set_user_attr(k, v)
        study.enqueue_trial(space.baseline_params(trial_flat), user_attrs={"baseline": True})
        study.set_user_attr("ppotune_schema", st.SCHEMA)  # last: marks the study as set up

    sampler = build_sampler(args.sampler, seed=args.seed, n_trials=args.trials)
    try:
        study, storage, created = st.open_study(spec, name, lock, sampler=sampler, setup=setup)
    except Exception as e:  # noqa: BLE001 - storage URL errors come in many types
        return _fail(f"--storage {spec.url}: {type(e).__name__}: {e}")
    bad = _incompatible(study, attrs)
    if bad:
        return _fail(bad)
    study.sampler = build_sampler(args.sampler, seed=_process_seed(args.seed, created), n_trials=args.trials)

    trials = study.get_trials(deepcopy=False)
    done = st.count_progress(trials)
    print(f"ppotune search: study {name!r} in {spec.url} ({'new' if created else 'resumed'}, "
          f"{done}/{args.trials} trials done) | space {args.space} ({space.size(trial_flat):,} configs) | "
          f"{device['kind']} x{nproc} per trial | sampler {args.sampler} | out {out_dir}", flush=True)
    display = Display(args.trials, done=min(done, args.trials), parallel=args.parallel)
    ok = [t for t in trials if t.user_attrs.get("status") == "ok" and t.values]
    if ok:
        b = max(ok, key=lambda t: t.values[0])
        display.seed(best=(b.values[0], b.values[1], b.number),
                     ooms=sum(t.user_attrs.get("status") in ("oom", "inferred_oom") for t in trials))
    tracker = None
    if args.wandb:
        from tuner.tracking import TrialTracker

        tracker = TrialTracker(project="ppotune", group=name, out_dir=out_dir)
    search = Search(args=args, study=study, storage=storage, lock=lock, space=space, trial_base=trial_base,
                    trial_flat=trial_flat, out_dir=out_dir, device=device, penalty_gb=penalty, display=display,
                    tracker=tracker)
    search._rng = random.Random(_process_seed(args.seed, created))
    search.heartbeat = st.Heartbeat(storage)
    search.heartbeat.start()

    got: list[int] = []

    def on_signal(signum, _frame):
        got.append(signum)
        search.stop_event.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    errors: list[BaseException] = []

    def guarded(slot: int) -> None:
        try:
            search.worker(slot)
        except BaseException as e:  # noqa: BLE001 - reported below, the other workers stop
            errors.append(e)
            search.stop_event.set()

    try:
        search._sweep()
        workers = [threading.Thread(target=guarded, args=(i,), name=f"trial-slot-{i}", daemon=True)
                   for i in range(args.parallel)]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            for w in workers:
                w.join(timeout=0.2)
        if args.confirm and not search.stop_event.is_set() and not errors:
            search.confirm(args.confirm)
    finally:
        search.heartbeat.stop()
        display.close()
        for s, h in old.items():
            signal.signal(s, h)
    if errors:
        raise errors[0]
    _summary(study, search)
    if got:
        print(f"ppotune search: stopped by {signal.Signals(got[0]).name}; the interrupted trial(s) will run "
              "again when the same command is re-run", flush=True)
        return EXIT_INTERRUPTED if got[0] == signal.SIGINT else 128 + got[0]
    if args.report:
        _write_report(spec.url, name, out_dir)
    return EXIT_OK


def _summary(study: optuna.Study, search: Search) -> None:
    trials = study.get_trials(deepcopy=False)
    by_status: dict[str, int] = {}
    for t in trials:
        s = t.user_attrs.get("status") or t.state.name.lower()
        by_status[s] = by_status.get(s, 0) + 1
    counts = ", ".join(f"{k} {v}" for k, v in sorted(by_status.items()))
    print(f"ppotune search: done ({search._stopped_reason or 'stopped'}) | {len(trials)} trials: {counts}", flush=True)
    front = sorted((t for t in study.best_trials if t.user_attrs.get("status") == "ok"), key=lambda t: -t.values[0])
    base = next((t for t in trials if t.user_attrs.get("baseline") and t.user_attrs.get("status") == "ok"), None)
    for t in front[:5]:
        rel = f" ({t.values[0] / base.values[0]:.2f}x baseline)" if base is not None and base.values[0] else ""
        print(f"  pareto: trial {t.number}: {t.values[0]:.1f} tok/s/GPU{rel}, {t.values[1]:.2f} GB", flush=True)


def _write_report(storage_url: str, study_name: str, out_dir: Path) -> None:
    try:
        from tuner import report
    except ImportError:
        print("ppotune search: --report: tuner.report is not available", flush=True)
        return
    fn = getattr(report, "write_report", None)
    if fn is None:
        print("ppotune search: --report: tuner.report has no write_report()", flush=True)
        return
    try:
        where = fn(storage_url, study_name, out_dir)
        print(f"ppotune search: report written to {where or out_dir}", flush=True)
    except Exception as e:  # noqa: BLE001 - the study is safe; the report is a view of it
        print(f"ppotune search: --report failed: {type(e).__name__}: {e}", flush=True)
