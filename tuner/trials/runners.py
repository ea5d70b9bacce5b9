"""Trial runners: the seam between the search (what to try) and a trial engine (how it is measured).

A runner takes a :class:`TrialRequest` (the validated config of one trial) and returns a
:class:`TrialOutcome` (a status and the measurements, as a :class:`TrialRecord`). It never
raises for what the trial does: OOM, hang, crash and invalid are statuses.

* :class:`SubprocessRunner` -- the default: ``ppotune train CONFIG --result FILE`` in its own
  process group under the reaper, with a hard timeout and the NVML/psutil sampler
  (:mod:`tuner.trials.launch`). Another trial engine (e.g. verl's own entry point) is another class
  with the same ``run``.
* :class:`ReplayRunner` -- answers from a recorded study (its real measurements, looked up by
  config identity; one of a config's repeats at random): benchmarks and tests replay the
  search loop over a recorded grid without launching anything.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

import optuna
import yaml

from trainer.contracts import Status, TrialRecord, oom_kind
from tuner.rules.candidates import effective_of
from tuner.space import Space
from tuner.trials.launch import TrialRun, launch_trial, train_command
from tuner.trials.memory import visible_gpus
from tuner.trials.timeline import held_in_windows

__all__ = [
    "TrialRequest",
    "TrialOutcome",
    "TrialRunner",
    "SubprocessRunner",
    "ReplayRunner",
    "trial_record",
    "STEP_LINE",
]


@dataclass(frozen=True)
class TrialRequest:
    """One trial to measure."""

    number: int
    config: dict  # the complete nested config (validated), exactly what the trial runs
    identity: tuple  # the config's identity in its space (see Space.identity)
    trial_dir: Path  # where the trial's files go
    slot: int = 0  # which of the --parallel slots runs it (its GPU slice)
    overrides: dict = field(default_factory=dict)  # what the trial sets on top of the base: knobs + derived keys
    # a verl in-run sweep (tuner.trials.sweep): each setting's per-step knobs, in the order the run measures them
    sweep: tuple = ()


@dataclass
class TrialOutcome:
    """What a runner measured. ``record`` holds the measurement fields of the trial's user attrs."""

    status: Status  # OK | OOM | HANG | CRASH | INVALID | INTERRUPTED
    record: TrialRecord = field(default_factory=TrialRecord)


class TrialRunner(Protocol):
    """Runs one trial; the search calls it from ``--parallel`` worker threads.

    A runner may also offer ``group(session, proposal, request, stop) -> TrialOutcome``: run the launched proposal
    together with configs it picks (a verl in-run sweep, :class:`tuner.trials.sweep.SweepRunner`), record those as
    trials of the session's study, and return the proposal's own outcome; the session then calls it instead of
    ``run``."""

    name: str  # recorded as the trial's ``engine``: what measured it

    def run(self, request: TrialRequest, stop: threading.Event) -> TrialOutcome: ...


# --------------------------------------------------------------------------- the real thing
def trial_record(run: TrialRun, *, config_path: Path, gpus: Optional[list[str]], engine: str) -> TrialRecord:
    """The measurement fields of a launched trial's user attrs, from its run (process, memory sampler,
    result JSON): the same for a cold trial and a trial of a warm job (tuner.trials.warm)."""
    res = run.result or {}
    summary = res.get("summary") or {}
    mem = run.memory
    inner_peak = summary.get("peak_memory_gb")
    # GPU: NVML sees what the allocator does not (CUDA context, NCCL): the larger. CPU: the RSS gained
    # above the post-start level, what the knobs change (the process tree's absolute RSS is kept beside)
    above_start = summary.get("memory_source") == "rss_above_start"
    # a ppotune trial on CPU that never finished a step (an OOM at build) has no figure on that basis:
    # the tree's absolute RSS is not comparable with the others' objective, so it is kept aside only
    absolute_only = engine == "ppotune" and mem.external_source == "psutil" and not above_start
    external = None if above_start or absolute_only else mem.external_peak_gb
    peaks = [p for p in (external, inner_peak) if p is not None]
    notes = list(res.get("notes") or [])
    notes += [n for n in mem.notes if n not in notes]  # how the GPUs were read (an NVML fallback says so)
    stopped = summary.get("stopped_early") or ""
    if stopped:
        notes.append(f"measured {summary.get('num_measured_steps')} steps: {stopped}")
    if run.leftover_pids:
        notes.append(f"processes still alive after cleanup: {run.leftover_pids}")
    if mem.load and mem.load.get("loaded"):
        notes.append(
            f"measured under load: {mem.load['cpu_others']:.2f} CPUs busy outside the trial on average, "
            f"{mem.load['gpu_other_processes']} other process(es) on its GPUs"
        )
    record = TrialRecord(
        throughput=summary.get("throughput"),
        throughput_cv=summary.get("throughput_cv"),
        step_s=summary.get("step_s"),
        throughput_ci=summary.get("throughput_ci"),
        measured_steps=summary.get("num_measured_steps"),
        pruned=stopped if stopped.startswith("pruned") else None,
        lengths=summary.get("lengths") or {},
        peak_memory_gb=max(peaks) if peaks else None,
        memory_source="rss_above_start" if above_start else mem.external_source,
        memory={
            "external_peak_gb": mem.external_peak_gb,
            "external_source": mem.external_source,
            "device_used_peak_gb": mem.device_used_peak_gb,
            "process_peak_gb": mem.process_peak_gb,
            "tree_rss_peak_gb": mem.tree_rss_peak_gb,
            "process_rss_peak_gb": mem.process_rss_peak_gb,
            "allocated_peak_gb": summary.get("peak_memory_allocated_gb"),
            "reserved_peak_gb": summary.get("peak_memory_reserved_gb"),
            "rss_peak_gb": summary.get("peak_rss_gb"),
            "rss_start_gb": summary.get("rss_start_gb"),
            "samples": mem.samples,
            # per phase, on the objective's basis (CPU: above the post-start level): what tuner.memory_model fits
            "by_phase_gb": phase_peaks(summary, above_start=above_start),
            **_held_by_phase(run, engine),
        },
        model_shape=res.get("model") or None,
        timing_s=summary.get("timing_s") or {},
        notes=notes,
        error=run.error,
        log_tail=run.log_tail,
        log_path=run.log_path,
        result_path=run.result_path,
        config_path=str(config_path),
        duration_s=run.duration_s,
        returncode=run.returncode,
        oom_phase=res.get("oom_phase"),
        oom_kind=oom_kind(run.error or res.get("error"), (res.get("environment") or {}).get("device"))
        if run.status == Status.OOM
        else None,
        gpus=gpus,
        engine=engine,
        load=mem.load,
    )
    return record


def _held_by_phase(run: TrialRun, engine: str) -> dict:
    """A verl trial's phases as its processes held them (the memory timeline over the result's ``phase_windows``,
    on the external peak's basis: vLLM's servers counted while awake): ``external_by_phase_gb`` {phase: GB} and
    ``external_by_step_gb`` {step: {phase: GB, "step": GB}} (what an in-run sweep's settings are read from)."""
    windows = (run.result or {}).get("phase_windows") if engine == "verl" else None
    held = held_in_windows(run.memory.timeline, windows or [])
    if not held:
        return {}
    return {"external_by_phase_gb": held["by_phase"], "external_by_step_gb": held["by_step"]}


def phase_peaks(summary: dict, *, above_start: bool) -> dict:
    """``{phase: GB}`` of a result's summary, on the memory objective's basis: on CPU the resident memory
    a rank gained above its post-start level (max over ranks), on a GPU the allocator's peak per phase."""
    if above_start:
        return {p: v for p, v in (summary.get("peak_memory_by_phase_above_start_gb") or {}).items() if v}
    return {p: v for p, v in (summary.get("peak_memory_by_phase_gb") or {}).items() if v}


@dataclass(frozen=True)
class VerlEngine:
    """How a verl trial runs: the user's verl environment and base overrides (trainer.verl_engine.adapter)."""

    python: str  # the verl environment's interpreter
    base_overrides: tuple  # the production job's verl config as Hydra overrides (its world and global sizes)
    steps: int
    warmup: int
    memory_limit_gb: Optional[float] = None
    # what a trial runs instead of production's world: one node of the trial's GPUs and the global batch sizes
    # scaled to production's per-GPU batch (tuner.rules.world.trial_overrides, as key=value); export leaves them out
    world: tuple = ()
    # settings one verl run may measure (an in-run sweep of the per-step knobs: tuner.trials.sweep); 1: none
    sweep_settings: int = 1

    def run_file(self, overrides: dict, config: Optional[dict] = None, sweep: tuple = ()) -> dict:
        """The trial's verl run file: the base, the trial's world, then the trial's knobs (verl keys, Hydra
        spelling). ``config``: the trial's nested config (the tuner's view of it), whose run options go along: its
        length (a probe runs 1 step), the worst case, and when it may stop measuring (``--precision``, the front).
        ``sweep``: an in-run sweep's settings (``ppotune.sweep``: the per-step knobs of each)."""
        from trainer.verl_engine.overrides import hydra_value

        knobs = [f"{k}={hydra_value(v)}" for k, v in overrides.items()]
        opts = {
            "python": self.python,
            "steps": self.steps,
            "warmup": self.warmup,
            "memory_limit_gb": self.memory_limit_gb,
        }
        if config is not None:
            opts.update(run_options(config))
        if sweep:
            opts["sweep"] = [dict(s) for s in sweep]
        return {"overrides": [*self.base_overrides, *self.world, *knobs], "ppotune": opts}


def run_options(config: dict) -> dict:
    """What a verl run file's ``ppotune:`` section takes from a trial's nested config (trainer.verl_engine.adapter's
    RUN_OPTIONS): the run's length, and the measuring options only where they act."""
    ppo = config.get("ppotune") or {}
    out = {"steps": int(config["trainer"]["total_training_steps"]), "warmup": int(ppo.get("warmup_steps") or 0)}
    if ppo.get("precision") or ppo.get("front"):
        out.update(precision=ppo.get("precision"), min_measured_steps=int(ppo.get("min_measured_steps") or 3))
        out["front"] = [list(p) for p in ppo.get("front") or []]
    if ppo.get("worst_case"):
        out["worst_case"] = True
    return out


#: The line a trial's log gains after each PPO step, per engine: ``ppotune train`` prints
#: ``step N | ...`` (trainer.tracking); verl's console logger ``step:N - ...`` (behind Ray's coloured
#: ``(TaskRunner pid=...)`` prefix).
STEP_LINE = {"ppotune": r"^step \d+", "verl": r"(?:^|\s)step:\d+ - "}


@dataclass
class SubprocessRunner:
    """``ppotune train`` in its own process group (tuner.trials.launch): the trial engine ``ppotune`` (our FSDP
    trainer), or ``verl`` (verl's own main_ppo, run by ``ppotune train --engine verl``) when ``verl`` is set."""

    device_kind: str  # cpu | cuda
    nproc: int
    timeout_s: Optional[float] = None  # the whole trial
    grace_s: float = 10.0
    verl: Optional[VerlEngine] = None
    name: str = "ppotune"
    startup_timeout_s: Optional[float] = 900.0  # to the first step
    step_timeout_s: Optional[float] = 300.0  # between steps

    def __post_init__(self) -> None:
        if self.verl is not None:
            self.name = "verl"

    def run(self, request: TrialRequest, stop: threading.Event) -> TrialOutcome:
        d = request.trial_dir
        d.mkdir(parents=True, exist_ok=True)
        config_path, result_path = d / "config.yaml", d / "result.json"
        config = (
            request.config
            if self.verl is None
            else self.verl.run_file(request.overrides, request.config, sweep=request.sweep)
        )
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        gpus = self.gpu_slice(request.slot)
        run = launch_trial(
            train_command(config_path, result_path=result_path, engine=self.name),
            trial_dir=d,
            result_path=result_path,
            timeout_s=self.timeout_s,
            grace_s=self.grace_s,
            extra_env={"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus is not None else None,
            stop_event=stop,
            gpus=gpus,
            use_nvml=self.device_kind == "cuda",
            step_line=STEP_LINE[self.name],
            startup_timeout_s=self.startup_timeout_s,
            step_timeout_s=self.step_timeout_s,
        )
        record = trial_record(run, config_path=config_path, gpus=gpus, engine=self.name)
        return TrialOutcome(Status(run.status), record)

    def gpu_slice(self, slot: int) -> Optional[list[str]]:
        """The GPUs of a --parallel slot (None on CPU)."""
        if self.device_kind != "cuda":
            return None
        return visible_gpus()[slot * self.nproc : (slot + 1) * self.nproc]


# --------------------------------------------------------------------------- replay
@dataclass(frozen=True)
class Recorded:
    """One recorded measurement of a config."""

    status: Status
    throughput: Optional[float]
    peak_memory_gb: Optional[float]
    duration_s: float
    number: int  # the recorded trial
    oom_phase: Optional[str] = None  # an OOM: the phase it ran out of memory in (grades its constraint)
    throughput_ci: Optional[tuple] = None  # its own 90% interval over its measured steps
    load: Optional[dict] = None  # what ran beside it (TrialRecord.load)


@dataclass
class ReplayRunner:
    """Answers each request from recorded measurements of the same config (no process started).

    ``table``: config identity -> its recorded measurements; a config measured several times
    is answered with one of them at random (so replay keeps the run-to-run noise). A config
    the recording inferred as OOM is answered as an OOM costing the seconds of the OOM it was
    inferred from. Requests for configs the recording lacks are answered ``crash``.
    """

    table: dict[tuple, list[Recorded]]
    rng: random.Random = field(default_factory=random.Random)
    name: str = "replay"
    spent_s: float = 0.0  # trial-seconds the answered trials cost when they were recorded
    launched: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_study(
        cls, study: optuna.Study, space: Space, trial_flat: dict, *, rng: Optional[random.Random] = None
    ) -> "ReplayRunner":
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        table: dict[tuple, list[Recorded]] = {}
        for t in trials.values():
            rec = TrialRecord.from_user_attrs(t.user_attrs)
            eff = effective_of(t, trial_flat)
            # a measurement (an inferred OOM too: answered below as its OOM), not a duplicate, an interrupted
            # run or an over-budget ask
            if rec.status is None or not (rec.status.counted or rec.status == Status.INFERRED_OOM) or eff is None:
                continue
            if rec.status == Status.INFERRED_OOM:
                src = TrialRecord.from_user_attrs(trials[rec.inferred_from].user_attrs)
                entry = Recorded(Status.OOM, None, None, float(src.duration_s or 0.0), t.number, src.oom_phase)
            else:
                seconds = float(rec.duration_s or 0.0)
                ci = tuple(rec.throughput_ci) if rec.throughput_ci else None
                entry = Recorded(
                    rec.status, rec.throughput, rec.peak_memory_gb, seconds, t.number, rec.oom_phase, ci, rec.load
                )
            table.setdefault(space.identity(eff), []).append(entry)
        return cls(table=table, rng=rng or random.Random(0))

    def run(self, request: TrialRequest, stop: threading.Event) -> TrialOutcome:
        with self._lock:
            choices = self.table.get(request.identity)
            if not choices:
                return TrialOutcome(
                    Status.CRASH,
                    TrialRecord(error="replay: this config was never recorded", duration_s=0.0, engine=self.name),
                )
            got = self.rng.choice(choices)
            self.spent_s += got.duration_s
            self.launched += 1
        return TrialOutcome(
            got.status,
            TrialRecord(
                throughput=got.throughput,
                throughput_ci=list(got.throughput_ci) if got.throughput_ci else None,
                peak_memory_gb=got.peak_memory_gb,
                duration_s=got.duration_s,
                load=got.load,
                memory_source="replay",
                oom_phase=got.oom_phase,
                engine=self.name,
                notes=[f"replayed from recorded trial {got.number} (not re-run)"],
            ),
        )
