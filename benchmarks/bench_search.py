"""How much of a grid's trial-seconds does each sampler need to find (nearly) its best config?

Replays ``ppotune search``'s own loop over a RECORDED grid: no trial is re-run; each launch is
answered by :class:`tuner.trials.runners.ReplayRunner` (the public runner seam) with one of the config's
recorded repeats at random (status, throughput, memory, seconds: the noise is kept). A config the
recording inferred as OOM is answered as an OOM costing the seconds of the OOM it was inferred from.
The search's samplers start with the baseline trial, as a new study of ``ppotune search`` does
(``replay.run_search``); ``tpe-plain`` leaves it out. Three samplers:

* ``ours``: ``tuner.search.loop.Search`` with TPE as ``ppotune search`` runs it: power-of-two knobs as
  ordered exponents, rejections before launch (invalid, inferred OOM, duplicate) free and resampled,
  a duplicate answered with its twin's values, the graded memory constraint, and after TPE's start-up
  every second launched trial a local step (the fastest measured config's nearest unmeasured neighbour,
  ``--local-every 2``; first those the knobs' ``speed`` hints in the recording's space favour);
* ``tpe-plain``: the same TPE sampler fed the way a plain Optuna loop would: power-of-two knobs as
  categoricals, invalid configs FAIL and count, every proposal launched (duplicates re-run, no OOM
  inference), OOM/hang COMPLETE with a binary constraint;
* ``random``: ``tuner.search.loop.Search`` with Optuna's random sampler (rejections free, no config twice);
* ``ours+confirm``: ``ours`` followed by ``--confirm R --finalists F`` (their defaults, or ``--confirm-rounds``
  and ``--finalists`` here), replayed through the confirmation's own rules (``replay.confirm_after``: the finalists
  of ``tuner.rules.finalists``, the rounds of ``tuner.rules.race`` until the leader separates, at most R), each
  re-run a recorded repeat at random; the re-runs' seconds count in the budget (the search stops earlier to leave
  room).

What the local steps and the speed hints add, on request: ``--samplers ours-nolocal`` (``--local-every 0
--no-corner``: TPE with the search's rejections, no local step, no walk from the hints' corner) and
``--no-speed-hints`` (the space's ``speed`` hints left out).

For each, over ``--seeds`` seeds: the true quality of the config the search would pick (the best measured so far
by the search's own rule, ``tuner.rules.candidates.measured_score``; its true value is the median of its recorded
repeats) relative to the grid's best, once 10%, 15% and 25% of the grid's trial-seconds are spent,
and the trial-seconds spent when the pick first reaches 97% of the grid's best. The shared pieces (a recording,
one replayed search, the replayed confirmation) are in ``benchmarks/replay.py``; ``benchmarks/score_defaults.py``
scores the defaults out of sample over every grid.

The recording: ``--study-db`` (an Optuna storage: a .db/.log file or URL) with ``--study`` (one or
more studies of the same space and base: the repeats); or ``--data`` (the JSON-lines file of
``benchmarks/record_grid.py``, with its space and base config); by default the 24-config grid of
``SPACE`` below, recorded once for real into ``--out`` (about 3 minutes on 2 CPU cores).

    python benchmarks/bench_search.py [--seeds 20] [--out bench_out] [--reuse]
    python benchmarks/bench_search.py --study-db bench_out/study.db --study bench-grid
    python benchmarks/bench_search.py --data benchmarks/data/grid_tiny_cpu.jsonl
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import optuna  # noqa: E402
from record_grid import recording_base  # noqa: E402  (the recorded grid's owner: what its trials ran)
from replay import (  # noqa: E402
    TARGET,
    Event,
    Recording,
    Run,
    confirmed_curve,
    confirmed_found_at,
    confirmed_seconds_to,
    found_at,
    from_jsonl,
    from_studies,
    median,
    median_interval,
    run_search,
    seconds_to,
)

from trainer.config import flatten  # noqa: E402
from trainer.contracts import CONSTRAINT_KEY, DIRECTIONS, Status  # noqa: E402
from tuner.rules import candidates as decide  # noqa: E402
from tuner.rules.finalists import DEFAULT_FINALISTS, DEFAULT_ROUNDS  # noqa: E402
from tuner.search.policy import build_sampler  # noqa: E402
from tuner.space import base_flat_config, load_space  # noqa: E402
from tuner.trials.runners import ReplayRunner, TrialRequest  # noqa: E402

SPACE = textwrap.dedent("""
    description: benchmark space - 2 x 3 x 2 x 2 = 24 configs; the 1024-wide model OOMs under the cap
    knobs:
      ppotune.tiny.hidden_size: {type: categorical, choices: [64, 1024], memory: increasing, algorithm: true}
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu:
        {type: pow2, low: 1, high: 4, memory: increasing, speed: increasing}
      actor_rollout_ref.actor.strategy: {type: categorical, choices: [fsdp, fsdp2], memory: none}
      actor_rollout_ref.model.enable_gradient_checkpointing: {type: bool, memory: decreasing, speed: decreasing}
""")
STEPS, WARMUP, NPROC, CAP_GB = 4, 1, 2, 0.25
BASE = REPO / "configs" / "tiny_cpu.yaml"
STUDY = "bench-grid"
LEVELS = (0.10, 0.15, 0.25)  # shares of the grid's trial-seconds
SAMPLERS = ("ours", "ours+confirm", "tpe-plain", "random")
#: also on request (``--samplers``): ``ours`` without its local steps (``--local-every 0``: what they add)
VARIANTS = ("ours-nolocal",)


# --------------------------------------------------------------------------- the recording
def record_default(out: Path, reuse: bool) -> Recording:
    """The default recording: every config of SPACE once, for real (``ppotune search --sampler grid``)."""
    space_path = out / "bench_space.yaml"
    space_path.write_text(SPACE)
    space = load_space(space_path)
    flat = flatten(recording_base(base_flat_config(BASE, nproc=NPROC)[0], steps=STEPS, warmup=WARMUP, cap_gb=CAP_GB))
    n_grid = space.size(flat)
    storage = f"sqlite:///{out / 'study.db'}"
    done = 0
    if reuse and (out / "study.db").exists():
        study = optuna.load_study(study_name=STUDY, storage=storage)
        done = len(ReplayRunner.from_study(study, space, flat).table)
    if done < n_grid:
        cmd = [
            sys.executable, "-m", "tuner.cli", "search", str(BASE), "--space", str(space_path),
            "--sampler", "grid", "--trials", str(n_grid), "--steps", str(STEPS), "--warmup", str(WARMUP),
            "--nproc", str(NPROC), "--memory-limit-gb", str(CAP_GB), "--out", str(out), "--study", STUDY,
            "--seed", "0", "--trial-timeout", "300", "--confirm", "0",
        ]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    return from_studies(storage, [STUDY])


# --------------------------------------------------------------------------- plain TPE
def run_plain_tpe(seed: int, rec: Recording, *, hint: int, cap_s: float) -> Run:
    """A plain Optuna ask/tell loop with the same TPE sampler: categorical powers of two, every
    proposal launched, invalid configs FAIL (and count), OOM/hang COMPLETE with a binary constraint."""
    study = optuna.create_study(directions=list(DIRECTIONS), sampler=build_sampler("tpe", seed=seed, n_trials=hint))
    runner = ReplayRunner(rec.table, rng=random.Random(seed))
    events, spent = [], 0.0
    never = threading.Event()
    while spent < cap_s and len(events) < 20 * len(rec.table):
        trial = study.ask()
        params, eff = {}, dict(rec.flat)
        for knob in rec.space.knobs:
            if not rec.space.active(knob, eff):
                continue
            if knob.type in ("int", "float"):
                value = knob.suggest(trial)
            else:
                value = trial.suggest_categorical(knob.key, list(knob.choices))
            params[knob.key] = eff[knob.key] = value
        cand = rec.space.complete(params, rec.flat)
        ident = rec.space.identity(cand.effective)
        verdict = decide.judge_candidate(
            cand, number=trial.number, space=rec.space, trial_base=rec.trial_base, trial_flat=rec.flat, known={}
        )
        if not verdict.launch:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            events.append(Event(spent, ident))
            continue
        out = runner.run(TrialRequest(trial.number, verdict.config, ident, Path("trials")), never)
        spent += float(out.record.duration_s or 0.0)
        if out.status == Status.OK:
            trial.set_constraint(CONSTRAINT_KEY, -1.0)
            study.tell(trial, [float(out.record.throughput), float(out.record.peak_memory_gb or 0.0)])
        elif out.status.complete:
            trial.set_constraint(CONSTRAINT_KEY, 1.0)
            study.tell(trial, [0.0, rec.penalty_gb])
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        thr = out.record.throughput if out.status == Status.OK else None
        events.append(Event(spent, ident, thr, thr))  # a plain loop picks the highest measured throughput
    return Run(events, runner.launched)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds FIRST .. FIRST+SEEDS-1 (another seed set)")
    ap.add_argument("--out", default="bench_out", help="where the default grid is recorded")
    ap.add_argument("--reuse", action="store_true", help="reuse the default grid in --out if it is complete")
    ap.add_argument("--study-db", help="a recorded grid: Optuna storage (.db/.log file or URL)")
    ap.add_argument("--study", action="append", default=[], help="its study (repeat the flag for repeats; default all)")
    ap.add_argument("--data", help="a recorded grid: benchmarks/record_grid.py's JSON-lines file")
    ap.add_argument("--cap", type=float, default=1.0, help="stop each replay after this share of the grid's seconds")
    ap.add_argument(
        "--samplers", default=",".join(SAMPLERS), help=f"comma-separated, of {', '.join(SAMPLERS + VARIANTS)}"
    )
    ap.add_argument("--no-speed-hints", action="store_true", help="--data: the space's speed hints left out")
    ap.add_argument("--confirm-rounds", type=int, default=DEFAULT_ROUNDS, help="+confirm: at most this many rounds")
    ap.add_argument("--finalists", type=int, default=DEFAULT_FINALISTS, help="+confirm: at most this many finalists")
    ap.add_argument("--startup", type=int, help="ours: TPE's random start-up trials (default: the search's rule)")
    a = ap.parse_args()
    t0 = time.monotonic()
    if a.study_db:
        rec = from_studies(a.study_db, a.study)
    elif a.data:
        rec = from_jsonl(Path(a.data), hints=not a.no_speed_hints)
    else:
        out = Path(a.out).resolve()
        out.mkdir(parents=True, exist_ok=True)
        rec = record_default(out, a.reuse)
    truth = rec.truth()
    grid = {rec.space.identity(c.effective) for c in rec.space.grid(rec.flat)}
    missing = len(grid - set(rec.table))
    best = max(truth.values())
    grid_s = rec.grid_s()
    repeats = [len(rs) for rs in rec.table.values()]
    n_feasible = sum(1 for v in truth.values() if v > 0)
    # near the cap an OOM is noisy: the configs that ran out of memory in some repeats and fitted in others
    noisy = sum(1 for rs in rec.table.values() if 0 < sum(r.status == Status.OOM for r in rs) < len(rs))
    hint = max(1, round(LEVELS[-1] * len(grid)))  # the --trials a user would give for a quarter of the grid
    gaps = f", {missing} NOT recorded (answered crash)" if missing else ""
    print(
        f"recording: {rec.label}: {len(rec.table)} configs ({min(repeats)}-{max(repeats)} repeats each), "
        f"{n_feasible} feasible, {noisy} out of memory in some repeats and not in others; space size {len(grid)}{gaps}"
    )
    print(
        f"grid: best feasible throughput {best:.1f} tokens/s/GPU (median of its repeats); one launch of every "
        f"config costs {grid_s:.0f} trial-s; budgets " + ", ".join(f"{x:.0%} = {x * grid_s:.0f} s" for x in LEVELS)
    )
    print(
        f"replays: {a.seeds} seeds each ({a.first_seed}-{a.first_seed + a.seeds - 1}); TPE built for --trials {hint}; "
        "each launch answered by one recorded "
        f"repeat at random; found = the TRUE throughput (median of repeats) of the search's pick so far "
        f"(its best measured config) / the grid's best"
    )
    head = " ".join(f"{'@' + format(x, '.0%'):>14}" for x in LEVELS)
    print(
        f"{'sampler':10} {head} {'trial-s to ' + format(TARGET, '.0%'):>18} {'(share of grid)':>15} {'90% int.':>11} "
        f"{'launched':>9}"
    )
    to97: dict = {}
    for sampler in [s for s in a.samplers.split(",") if s]:
        found = {x: [] for x in LEVELS}
        secs, launched = [], []
        for seed in range(a.first_seed, a.first_seed + a.seeds):
            if sampler == "tpe-plain":
                run = run_plain_tpe(seed, rec, hint=hint, cap_s=a.cap * grid_s)
            else:
                run = run_search(sampler.split("+")[0], seed, rec, hint=hint, cap_s=a.cap * grid_s, startup=a.startup)
            if sampler.endswith("+confirm"):
                curve = confirmed_curve(run, rec, seed, rounds=a.confirm_rounds, finalists=a.finalists)
                for x in LEVELS:
                    found[x].append(confirmed_found_at(curve, truth, x * grid_s) / best)
                secs.append(confirmed_seconds_to(curve, truth, TARGET * best))
            else:
                for x in LEVELS:
                    found[x].append(found_at(run, truth, x * grid_s) / best)
                secs.append(seconds_to(run, truth, TARGET * best))
            launched.append(run.launched)
        cells = []
        for x in LEVELS:
            hits = sum(v >= TARGET for v in found[x])
            cells.append(f"{median(found[x]):6.3f} [{hits:2d}/{a.seeds}]")
        med = median(secs)
        to97[sampler] = med
        lo, hi = median_interval(secs)
        share = f"{med / grid_s:.0%}" if math.isfinite(med) else f">{a.cap:.0%}"
        spread = "-".join(f"{v / grid_s:.0%}" if math.isfinite(v) else f">{a.cap:.0%}" for v in (lo, hi))
        print(
            f"{sampler:10} {' '.join(f'{c:>14}' for c in cells)} {med:18.0f} {share:>15} {spread:>11} "
            f"{statistics.mean(launched):9.1f}"
        )
    for ours in ("ours", "ours+confirm"):
        if math.isfinite(to97.get(ours, math.inf)) and math.isfinite(to97.get("random", math.inf)) and to97[ours]:
            print(f"random / {ours}, trial-seconds to {TARGET:.0%}: {to97['random'] / to97[ours]:.2f}x")
    print(
        f"(found: median [seeds at >= {TARGET:.0%}]; trial-s: median over seeds, its 90% interval distribution-free "
        f"(order statistics over the seeds); wall {time.monotonic() - t0:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sys.exit(main())
