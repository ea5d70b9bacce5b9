"""``ppotune search --dry-run``: what a search would run and about how long, said before anything runs.

The runs: the trials still to run (``--trials`` less the study's counted ones when resuming), the confirmation's
re-runs (``--confirm R`` rounds of at most ``--finalists F`` finalists and the
baseline: an upper bound) and the worst-case probes (``--probe K``). The time: from the study's own measured
trials when it has some (their median wall time each), else a stated guess, labelled as such: on a GPU reckoned
from the job (the model's shape, the lengths, the batch, the world, the device: :mod:`tuner.search.trial_time`),
its assumptions printed; on a CPU, or where the model's shape is not known, start-up plus the trial's steps at a
per-step guess per device kind. Pure: the command gathers the inputs and prints the lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
from pathlib import Path
from typing import Iterable, Optional

from trainer.contracts import DEFAULT_OUT_DIR, TrialRecord
from tuner.rules.budget import count_progress
from tuner.rules.finalists import DEFAULT_FINALISTS
from tuner.search.trial_time import HangLimits, TrialTime
from tuner.space.grid import GRID_LIMIT

__all__ = [
    "duration",
    "STARTUP_GUESS_S",
    "STEP_GUESS_S",
    "Runs",
    "Estimate",
    "runs_of",
    "estimate",
    "trial_guess",
    "measured_durations",
    "plan_lines",
    "next_steps",
]

#: a guess at one cold trial's start-up (process start, imports, model build) per device kind, in seconds
STARTUP_GUESS_S = {"cpu": 15.0, "cuda": 60.0}
#: ``--engine verl``: verl's own start-up (Ray, its workers, its config) in every trial (see
#: docs/decisions.md#verl-startup-guess); a GPU node's is not measured yet
VERL_STARTUP_GUESS_S = {"cpu": 45.0, "cuda": 90.0}
#: a guess at one PPO step of a short trial per device kind, in seconds
STEP_GUESS_S = {"cpu": 3.0, "cuda": 5.0}


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclasses.dataclass(frozen=True)
class Runs:
    """The runs a search would launch at most."""

    trials: int  # search trials still to run
    done: int  # counted trials the study holds already
    reruns: int  # confirmation re-runs, at most
    probes: int  # worst-case probes, at most

    @property
    def total(self) -> int:
        return self.trials + self.reruns + self.probes


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The wall time of those runs, and how it was reckoned (``measured``: from the study's own trials)."""

    seconds: float
    per_run_s: float
    measured: bool
    basis: str

    def line(self) -> str:
        kind = "from this study's measured trials" if self.measured else "a guess, not measured"
        return f"estimated wall time: about {duration(self.seconds)} ({kind}: {self.basis})"


def runs_of(*, trials: int, done: int, confirm: int, probe: int, finalists: int = DEFAULT_FINALISTS) -> Runs:
    """``--trials`` less the ``done`` ones, ``--confirm`` rounds of up to ``--finalists`` finalists and the
    baseline, ``--probe``."""
    return Runs(
        trials=max(0, trials - done),
        done=done,
        reruns=confirm * (finalists + 1) if confirm else 0,
        probes=max(0, probe),
    )


def measured_durations(trials: Iterable) -> list[float]:
    """The wall times (s) of the study's launched, finished trials (re-runs included; free ones left out)."""
    out = []
    for t in trials:
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if t.state.is_finished() and rec.duration_s and rec.duration_s > 0:
            out.append(float(rec.duration_s))
    return out


def estimate(
    runs: Runs,
    *,
    parallel: int,
    device: str,
    steps: int,
    durations: Optional[list] = None,
    engine: str = "ppotune",
    sweep: int = 1,
    timing: Optional[TrialTime] = None,
) -> Estimate:
    """The wall time of ``runs``: the search's trials ``parallel`` at a time, the re-runs and probes one at a time
    (the confirmation interleaves them; a probe counted as one trial). ``sweep``: the settings one verl run may
    measure (in-run sweeps, :mod:`tuner.trials.sweep`): a swept trial's measured duration is its share of the run,
    the guess says how low a trial may go (verl's start-up shared by ``sweep`` settings). ``timing``: a GPU trial's
    time reckoned from the job, used when the study has measured nothing yet (else the per-device guesses)."""
    if durations:
        per, measured = statistics.median(durations), True
        basis = f"median {per:.0f} s per run over {len(durations)} runs"
    else:
        start, step, said = trial_guess(device, steps, engine, timing)
        per, measured = start + steps * step, False
        if engine != "verl":
            how = "; warm trials start faster"
        elif sweep > 1:
            low = start / sweep + steps * step
            how = (
                f" (verl: a run per trial; in-run sweeps of up to {sweep} settings share a start-up among configs "
                f"that differ only in per-step knobs: as low as ~{low:.0f} s a trial)"
            )
        else:
            how = " (verl: every trial starts verl)"
        basis = (
            f"{said}{how}, {'' if timing else 'real models step slower; '}--dry-run on the study after a few "
            "trials measures it"
        )
    seconds = per * (-(-runs.trials // max(1, parallel)) + runs.reruns + runs.probes)
    return Estimate(seconds=seconds, per_run_s=per, measured=measured, basis=basis)


def trial_guess(device: str, steps: int, engine: str, timing: Optional[TrialTime]) -> tuple[float, float, str]:
    """(start-up s, step s, what they are) of a trial the study has not measured: ``timing``'s (a GPU trial's,
    reckoned from the job) when there is one, else the per-device guesses."""
    if timing is not None:
        return timing.startup_s, timing.step_s, f"{timing.basis(steps)} per run on {device}"
    starts = VERL_STARTUP_GUESS_S if engine == "verl" else STARTUP_GUESS_S
    start, step = starts.get(device, 60.0), STEP_GUESS_S.get(device, 5.0)
    return start, step, f"~{start:g} s start-up + {steps} steps x ~{step:g} s per run on {device}"


def done_of(trials: Iterable) -> int:
    """The counted trials a study holds (what ``--trials`` counts)."""
    return count_progress(trials)


def plan_lines(
    args,
    options,
    space,
    flat: dict,
    device: str,
    trials: list,
    state: str,
    name: str,
    spec,
    *,
    sweep: int = 1,
    timing: Optional[TrialTime] = None,
    limits: Optional[HangLimits] = None,
) -> list[str]:
    """``--dry-run``'s lines: the study, the space, the trials, the runs and the estimate (``sweep``: the settings
    one verl run may measure; ``timing``: a GPU trial's time reckoned from the job, its assumptions said;
    ``limits``: the hang limits the trials would run under)."""
    o = options
    runs = runs_of(trials=o.trials, done=done_of(trials), confirm=o.confirm, probe=o.probe, finalists=o.finalists)
    engine = getattr(args, "engine", "ppotune")
    durations = measured_durations(trials)
    est = estimate(
        runs,
        parallel=o.parallel,
        device=device,
        steps=args.steps,
        durations=durations,
        engine=engine,
        sweep=sweep,
        timing=timing,
    )
    size = space.size(flat)
    fixed = ", ".join(f"{k}={v!r}" for k, v in space.fixed.items()) or "none"
    lines = [
        "dry run: everything checked; nothing launched, nothing written",
        f"study {name!r} in {spec.display} ({state}, {runs.done}/{o.trials} trials done)",
        f"space {args.space}: {f'>{GRID_LIMIT:,}' if size > GRID_LIMIT else f'{size:,}'} configs after conditions "
        f"and constraints, {len(space.knobs)} knobs; fixed: {fixed}",
        f"trials: {device} x{flat['trainer.n_gpus_per_node']}, up to {args.steps} steps "
        f"({args.warmup} warm-up), {o.parallel} at a time; sampler {o.sampler}; "
        f"recommends {o.selection.flags()}",
        f"runs: {runs.trials} trials + {runs.reruns} confirmation re-runs (at most: --confirm {o.confirm} rounds x "
        f"up to {o.finalists} finalists and the baseline; the rounds stop once the leader separates) + "
        f"{runs.probes} worst-case probes "
        f"= {runs.total} runs at most",
    ]
    if sweep > 1:  # a verl run records every setting it measured, the last launch's too
        lines.append(
            f"in-run sweeps: up to {sweep} settings a verl run (ppotune.sweep_settings), each its own trial; the "
            f"last run may record up to {sweep - 1} trials past --trials {o.trials}",
        )
    lines.append(est.line())
    if timing is not None:
        lines.append(timing.assumptions())
    if limits is not None:
        lines.append(limits.line())
    if args.timeout is not None:
        lines.append(f"--timeout {args.timeout:g} s caps it: no new run starts after that")
    return lines


def next_steps(args: argparse.Namespace, spec, out_dir: Path) -> list[str]:
    """The exact commands to run next: the report (unless --report wrote it), export, validate."""
    where = []
    if args.storage is not None or out_dir != Path(DEFAULT_OUT_DIR).resolve():
        where += ["--storage", str(out_dir) if args.storage is None else spec.display]
    if args.study is not None:
        where += ["--study", args.study]
    flags = " ".join(shlex.quote(w) for w in where)
    flags = f" {flags}" if flags else ""
    report = out_dir / "report" / "report.html"
    steps = [] if args.report and report.is_file() else [f"report: ppotune report{flags}"]  # --report said where
    steps += [
        f"next: ppotune export{flags}   (best_config.yaml, verl_overrides.txt, verl_command.sh, why.md)",
        f"then: ppotune validate --steps 20{flags}   (the pick against the baseline, interleaved, longer)",
    ]
    return steps
