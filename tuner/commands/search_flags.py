"""``ppotune search``'s flags, in four groups of the same order as its help: what the search is over and where
its study lives, how each trial runs, how the search proposes and stops, how trials start and what is written.
(:mod:`tuner.commands.search` parses them into its options.)"""

from __future__ import annotations

import argparse
import os

from trainer.contracts import DEFAULT_HEADROOM, DEFAULT_OUT_DIR
from trainer.summary import MIN_MEASURED_STEPS
from tuner.commands.flags import add_override_flag
from tuner.rules.budget import MAX_FAILURES_IN_A_ROW
from tuner.rules.finalists import DEFAULT_FINALISTS, DEFAULT_ROUNDS, MAX_FINALISTS
from tuner.search.confirmation import DEFAULT_LOAD_WAIT_S
from tuner.search.policy import SAMPLERS
from tuner.study import lifecycle as st
from tuner.study.selection import DEFAULT_PICK, PICKS
from tuner.trials.launch import add_hang_flags, positive_seconds

__all__ = ["add_search_arguments", "trial_length", "DEFAULT_STEPS", "DEFAULT_WARMUP"]

#: a trial's PPO steps (warm-up included) and warm-up steps when neither ``--steps``/``--warmup`` nor the verl run
#: file's ``ppotune.steps``/``ppotune.warmup`` say
DEFAULT_STEPS, DEFAULT_WARMUP = 8, 1


#: the default of ``--confirm-wait`` where one is set for every search a process starts (a test suite whose two
#: workers are each other's load)
CONFIRM_WAIT_ENV = "PPOTUNE_CONFIRM_WAIT_S"


def _confirm_wait_default() -> float:
    value = os.environ.get(CONFIRM_WAIT_ENV)
    try:
        return float(value) if value else DEFAULT_LOAD_WAIT_S
    except ValueError:
        return DEFAULT_LOAD_WAIT_S

def add_search_arguments(p: argparse.ArgumentParser) -> None:
    for flags in (_study_flags, _trial_flags, _search_flags, _stage_flags, _output_flags):
        flags(p)


def _study_flags(p: argparse.ArgumentParser) -> None:
    """What the search is over and where its study lives."""
    p.add_argument("base_config", help="base config YAML (verl keys); its values are the baseline trial")
    p.add_argument("--space", required=True, help="search space YAML (see search_spaces/)")
    add_override_flag(p, what="the base config (the baseline too)")
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
        "stops early enough to leave them their estimated time, at most half of S; default: none)",
    )
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL; journal:PATH or *.log for a journal file (default: sqlite:///<out>/study.db)",
    )
    p.add_argument("--study", default=None, help="study name (default: <base>--<space>)")
    p.add_argument(
        "--from-fit",
        default=None,
        metavar="DIR",
        help="start from a ppotune fit (its --out DIR): each size knob of the space at most its fitted value (a larger "
        "one's worst case does not fit), and the fitted sizes tried right after the baseline (default: none)",
    )
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
        "--out",
        default=DEFAULT_OUT_DIR,
        metavar="DIR",
        help=f"output dir: trials/, the default storage, report/ (default: {DEFAULT_OUT_DIR}; report, export and "
        "validate read ./ppotune_out when not told)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything a search checks, print the plan (space size, fixed keys, runs: trials + "
        "confirmation re-runs + probes) and an estimate of its wall time; launch nothing, write nothing",
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
        default=None,
        help="PPO steps per trial at most, warm-up included (default: --engine verl: the run file's ppotune.steps, "
        f"each setting's in an in-run sweep; else {DEFAULT_STEPS}; fewer when the measurement is tight)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="leading steps left out of the measurement (default: --engine verl: the run file's ppotune.warmup; else "
        f"{DEFAULT_WARMUP}; at most --steps - 1)",
    )
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
    add_hang_flags(p, subject="a trial", estimated=True)
    p.add_argument(
        "--assume-gpu",
        default=None,
        metavar="NAME",
        help="the GPU a trial's time estimate (and the hang limits drawn from it) assumes where none is visible, "
        "e.g. for a --dry-run on a laptop of a run file with ppotune.device: cuda (H100, H200, A100, ...; default: "
        "the visible GPU, else H100)",
    )
    p.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        metavar="G",
        help="a real per-process memory cap for every trial (GPU: allocator fraction; CPU: rlimit; default: none)",
    )


def _search_flags(p: argparse.ArgumentParser) -> None:
    """How the search proposes, and when it stops."""
    p.add_argument(
        "--sampler",
        choices=list(SAMPLERS),
        default="tpe",
        help="Optuna's sampler: tpe (multi-objective TPE with local steps), nsga2, random, or grid (every config "
        "of a small space, in order) (default: tpe)",
    )
    p.add_argument(
        "--local-every",
        type=int,
        default=2,
        metavar="N",
        help="tpe: once its random start-up is done, every N-th launched trial is an unmeasured config one ordered "
        "step from the fastest measured one (when there is one left); off where the storage has no cross-process lock "
        "(the gRPC proxy, MySQL); 0: the sampler alone (default 2)",
    )
    p.add_argument(
        "--no-corner",
        action="store_true",
        help="tpe: no walk from the speed hints' corner after the baseline (by default the search launches the "
        "config every knob's speed hint calls fastest, then steps down its memory-hungry knobs while it runs out "
        "of memory, at most 6 launches, before TPE's start-up; off for other samplers and where the storage has no "
        "cross-process lock: the gRPC proxy, MySQL)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the sampler's seed, for a reproducible search (a second worker or a resume derives its own; "
        "default: random)",
    )
    p.add_argument(
        "--max-failures-in-a-row",
        type=int,
        default=MAX_FAILURES_IN_A_ROW,
        metavar="N",
        help="stop the search when N launched trials in a row fail (crash, or a config the trainer refuses) with the "
        f"same error: a search that cannot work stops, never ends 'done' (default {MAX_FAILURES_IN_A_ROW}; 0: never). "
        "A failed baseline trial stops it at once",
    )
    p.add_argument(
        "--no-memory-model",
        action="store_true",
        help="launch every candidate: no predicted_oom from the study's calibrated memory model (on by default "
        "once 3 trials are measured: a candidate predicted over the memory limit by more than the model's "
        "leave-one-out error is recorded, not launched)",
    )


def _stage_flags(p: argparse.ArgumentParser) -> None:
    """What runs after the search: the confirmation, the worst-case probe, and what they are for."""
    p.add_argument(
        "--confirm",
        type=int,
        default=DEFAULT_ROUNDS,
        metavar="R",
        help="after the search, re-run the finalists (the --pick's first choice, then Pareto points under "
        "--memory-headroom and trials within noise of the best, at most --finalists) interleaved with the baseline, "
        "round after round until the leader's paired-ratio interval separates from the runner-up's, at most R "
        "rounds measured without load; export ranks them by their paired throughput ratios to the baseline "
        f"(default {DEFAULT_ROUNDS}; 0: off)",
    )
    p.add_argument(
        "--confirm-wait",
        type=float,
        default=_confirm_wait_default(),
        metavar="S",
        help="the longest the confirmation waits, all its waits together, for load beside it to pass before a round "
        f"measured under load runs again (default {DEFAULT_LOAD_WAIT_S:g}, or ${CONFIRM_WAIT_ENV}: a machine that "
        "is always busy, a test suite; 0: never wait, the confirmation then stops and why.md says how to confirm "
        "later)",
    )
    p.add_argument(
        "--finalists",
        type=int,
        default=DEFAULT_FINALISTS,
        metavar="F",
        help=f"at most F finalists confirmed, each a re-run per round it stays in (default {DEFAULT_FINALISTS})",
    )
    p.add_argument(
        "--probe",
        type=int,
        default=MAX_FINALISTS,
        metavar="K",
        help="then run the worst-case probe (one step, every prompt and response at its maximum length; "
        "ppotune probe) of the K configs export would take first (by --pick under --memory-headroom); export "
        "refuses a pick whose worst case "
        f"breaks the headroom (default {MAX_FINALISTS}; 0: off; --engine verl: verl's own step)",
    )
    p.add_argument(
        "--pick",
        choices=PICKS,
        default=DEFAULT_PICK,
        help="which config the search recommends: the fastest, the smallest, or the knee of the Pareto front; what "
        f"it confirms and probes, recorded in the study as export's default (default: {DEFAULT_PICK})",
    )
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        metavar="F",
        help="the fraction of device memory a recommended config keeps free (peak <= (1-F) x device memory): "
        "what is confirmed and probed, recorded in the study as report's and export's default "
        f"(default: {DEFAULT_HEADROOM:g})",
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


def trial_length(args: argparse.Namespace, run_options: dict) -> tuple[int, int]:
    """(steps, warm-up) of a trial: ``--steps``/``--warmup`` when given, else the verl run file's ``ppotune.steps``/
    ``ppotune.warmup`` (``run_options``: that section; empty for ppotune's engine, whose base config's
    ``trainer.total_training_steps`` is the production job's length, not a trial's), else the defaults. A warm-up
    the flags do not give is cut to leave a measured step when ``--steps`` is shorter than it."""
    steps = args.steps if args.steps is not None else run_options.get("steps", DEFAULT_STEPS)
    if args.warmup is not None:
        return steps, args.warmup
    warmup = run_options.get("warmup", DEFAULT_WARMUP)
    if args.steps is not None and isinstance(steps, int) and isinstance(warmup, int):
        warmup = min(warmup, max(0, steps - 1))
    return steps, warmup
