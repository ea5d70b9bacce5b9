"""A family of simulated grids: what the search's defaults are chosen on, before they are scored on recorded grids.

Each simulated grid is a :class:`replay.Recording` over a real space and base config (one of the recorded grids':
the search judges, validates and infers over them exactly as over a recording), whose every config has:

* a **throughput surface**: per knob, an effect along its order (a step's size drawn, its sign the knob's ``speed``
  hint with probability ``hint_truth``, else the other way; it may saturate after a few steps: a plateau; each step
  uneven around it), random effects for unordered choices, and per-config ruggedness; then optionally a
  **needle** (one config, near the memory boundary, lifted above the rest) or a **plateau** (the top configs
  squeezed within a few percent);
* a **memory surface**: per knob, monotone in the direction of its ``memory`` hint (a ``none`` knob: a small
  effect), with jitter; the **cap** set so that a share ``fit_share`` of the configs fit;
* **repeats** (2 or 3 per config): an OOM with a probability that rises across the cap over a log-width
  ``boundary`` (noisy OOMs at the boundary), else a run whose throughput is the truth times the run-to-run noise
  (log-sd ``cv``), with its own 90% interval over 3 simulated steps (step noise ``step_cv``), its peak, and its
  seconds (a start-up plus the measured steps' time; an OOM costs about a start-up).

The family's ranges (:class:`Family`) are fitted to recorded grids (:func:`fit_family`: each statistic's range over
the grids, widened) and varied beyond them; ``score_defaults.py --fit-on`` leaves out the grid being scored.

    python benchmarks/grid_sim.py [--grids 4] [--seed 0]   # describe a few simulated grids
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from replay import Recording, from_jsonl, grid_setup  # noqa: E402

from trainer.contracts import Status  # noqa: E402
from trainer.summary import interval  # noqa: E402
from tuner.trials.runners import Recorded  # noqa: E402

DATA = REPO / "benchmarks" / "data"
#: the spaces a simulated grid is drawn over: (space, base, nproc) of recorded grids 1 and 2
SPACES = (
    (DATA / "grid_space.yaml", DATA / "grid_base.yaml", 1),
    (DATA / "grid2_space.yaml", DATA / "grid2_base.yaml", 1),
)
STEPS = 3  # measured steps per simulated run (as the recorded grids measured)


@dataclass(frozen=True)
class Family:
    """Ranges a simulated grid's parameters are drawn from (uniform in each)."""

    cv: tuple = (0.015, 0.12)  # run-to-run noise of a config's throughput (log-sd)
    step_cv: tuple = (0.01, 0.12)  # step-to-step noise within a run: each run's own interval
    fit_share: tuple = (0.5, 0.97)  # share of configs under the cap
    boundary: tuple = (0.0, 0.15)  # log-width of the zone where the same config OOMs in one run and fits in the next
    startup_share: tuple = (0.3, 0.9)  # share of a median run's seconds that is start-up
    hint_truth: tuple = (0.9, 1.0)  # probability that a knob's speed hint has the right sign
    unevenness: tuple = (0.0, 0.05)  # log-sd of each step's effect around the knob's own: not every step helps
    needle: float = 0.3  # probability of a needle: one config lifted above the rest
    plateau: float = 0.3  # probability of a plateau: the top squeezed within a few percent


def fit_family(recordings: list) -> Family:
    """The family's ranges from recorded grids: each statistic's range over them, halved below and doubled above
    (and never narrower than the shipped ranges' core), so the family holds every grid it was fitted on and more."""
    stats = [_grid_stats(r) for r in recordings]

    def span(key: str, lo_floor: float, hi_cap: float) -> tuple:
        xs = [s[key] for s in stats]
        return (max(lo_floor, min(xs) * 0.5), min(hi_cap, max(max(xs) * 2.0, min(xs) * 0.5 + 0.01)))

    return Family(
        cv=span("cv", 0.005, 0.2),
        step_cv=span("step_cv", 0.005, 0.2),
        fit_share=(max(0.3, min(s["fit_share"] for s in stats) - 0.25), min(0.98, max(s["fit_share"] for s in stats))),
        boundary=(0.0, min(0.3, max(0.05, 2.0 * max(s["boundary"] for s in stats)))),
    )


def _grid_stats(rec: Recording) -> dict:
    """A recorded grid's noise, boundary and feasibility, as the family's parameters."""
    sds, halves, noisy, fit = [], [], 0, 0
    for rs in rec.table.values():
        ok = [r for r in rs if r.status == Status.OK and r.throughput]
        if len(ok) >= 2:
            sds.append(statistics.pstdev([math.log(r.throughput) for r in ok]) * math.sqrt(len(ok) / (len(ok) - 1)))
        halves += [math.log(r.throughput_ci[1] / r.throughput_ci[0]) / 2 for r in ok if r.throughput_ci]
        ooms = sum(r.status == Status.OOM for r in rs)
        noisy += 0 < ooms < len(rs)
        fit += 2 * len(ok) >= len(rs)
    n = len(rec.table)
    t2 = 2.92  # t(0.95, 2): the recorded runs' intervals are over 3 measured steps
    return {
        "cv": statistics.median(sds) if sds else 0.05,
        "step_cv": statistics.median(halves) * math.sqrt(STEPS) / t2 if halves else 0.05,
        "fit_share": fit / n,
        "boundary": 0.05 * noisy / max(1, n - fit) * 10,  # a noisy share of the infeasible side, as a log-width
    }


# --------------------------------------------------------------------------- one simulated grid
def simulate(index: int, family: Family = Family()) -> Recording:
    """Simulated grid number ``index`` of ``family`` (deterministic in ``index``)."""
    rng = random.Random(f"grid-sim-{index}")
    space_path, base_path, nproc = SPACES[index % len(SPACES)]
    space, trial_base, flat = grid_setup(space_path, base_path, nproc=nproc, steps=STEPS + 1, warmup=1, cap_gb=1.0)
    p = {k: rng.uniform(*getattr(family, k)) for k in ("cv", "step_cv", "fit_share", "boundary", "startup_share")}
    configs = list(space.grid(flat))
    speed, memory = _surfaces(
        space, configs, rng, hint_truth=rng.uniform(*family.hint_truth), uneven=rng.uniform(*family.unevenness)
    )
    log_cap = sorted(memory)[max(0, min(len(memory) - 1, int(p["fit_share"] * len(memory)) - 1))] + 1e-9
    shape = rng.random()
    if shape < family.needle:
        _needle(speed, memory, log_cap, rng)
    elif shape < family.needle + family.plateau:
        _plateau(speed, rng)
    scale = math.exp(rng.uniform(math.log(800.0), math.log(8000.0)))  # tokens/s/GPU of the median config
    base_s = rng.uniform(5.0, 25.0)  # seconds of a median run
    startup_s = p["startup_share"] * base_s
    mid = statistics.median(speed)
    table, number = {}, 0
    for cand, ls, lm in zip(configs, speed, memory):
        runs = []
        for _ in range(rng.choice((2, 2, 3))):
            over = (lm - log_cap) / p["boundary"] if p["boundary"] > 0 else (math.inf if lm > log_cap else -math.inf)
            p_oom = 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, over * 4.0))))
            peak = math.exp(lm + rng.gauss(0.0, 0.01))
            if rng.random() < p_oom:
                runs.append(Recorded(Status.OOM, None, None, startup_s * rng.uniform(0.6, 1.2), number, "update_actor"))
            else:
                thr = scale * math.exp(ls - mid + rng.gauss(0.0, p["cv"]))
                steps = [thr * math.exp(rng.gauss(0.0, p["step_cv"])) for _ in range(STEPS)]
                lo, hi = interval(steps)
                seconds = startup_s + (base_s - startup_s) * math.exp(mid - ls)
                runs.append(Recorded(Status.OK, statistics.median(steps), peak, seconds, number, None, (lo, hi)))
            number += 1
        table[space.identity(cand.effective)] = runs
    label = f"simulated grid {index} ({space_path.name}; " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()) + ")"
    return Recording(space, trial_base, flat, math.exp(log_cap), table, label)


def _surfaces(space, configs: list, rng: random.Random, *, hint_truth: float, uneven: float) -> tuple[list, list]:
    """Log-throughput and log-memory of each config: per-knob effects along its order, plus ruggedness."""
    effects = {}
    for knob in space.knobs:
        n = len(knob.domain())
        unordered = knob.type == "categorical" and knob.exponents is None and knob.speed == "none"
        if unordered:
            effects[knob.key] = ([rng.gauss(0.0, 0.05) for _ in range(n)], [rng.gauss(0.0, 0.03) for _ in range(n)])
            continue
        sign = 1.0 if knob.speed in ("increasing", "none") else -1.0
        if knob.speed == "none" or rng.random() > hint_truth:
            sign = -sign if knob.speed != "none" else rng.choice((-1.0, 1.0))
        step, sat = rng.uniform(0.03, 0.25), rng.randint(1, max(1, n - 1))
        mem = {"increasing": 1.0, "decreasing": -1.0}.get(knob.memory, 0.0) * rng.uniform(0.15, 0.6)
        if knob.memory == "none":
            mem = rng.uniform(-0.05, 0.05)
        speed, at = [0.0], 0.0
        for i in range(1, n):  # each step: the knob's own effect (none past saturation) and its unevenness
            at += (sign * step if i <= sat else 0.0) + rng.gauss(0.0, uneven)
            speed.append(at)
        effects[knob.key] = (speed, [mem * i for i in range(n)])
    speeds, memories = [], []
    active_of = space.active_keys
    for cand in configs:
        eff, active = cand.effective, active_of(cand.effective)
        ls, lm = rng.gauss(0.0, 0.015), rng.gauss(0.0, 0.04)
        for knob in space.knobs:
            if knob.key in active:
                i = (
                    int(knob.rank(eff[knob.key]))
                    if knob.type not in ("int", "float")
                    else knob.domain().index(eff[knob.key])
                )
                ls += effects[knob.key][0][i]
                lm += effects[knob.key][1][i]
        speeds.append(ls)
        memories.append(lm)
    return speeds, memories


def _needle(speed: list, memory: list, log_cap: float, rng: random.Random) -> None:
    """Lift one feasible config near the boundary (among the hungriest that fit) above every other."""
    fits = sorted((m, i) for i, m in enumerate(memory) if m <= log_cap)
    if not fits:
        return
    i = rng.choice(fits[-max(1, len(fits) // 5) :])[1]
    speed[i] = max(speed) + rng.uniform(0.05, 0.15)


def _plateau(speed: list, rng: random.Random) -> None:
    """Squeeze the configs within 10% of the best to within 3% of it (many near-best configs)."""
    top = max(speed)
    for i, s in enumerate(speed):
        if s > top - 0.10:
            speed[i] = top - (top - s) * rng.uniform(0.1, 0.3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grids", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the first simulated grid's index")
    ap.add_argument("--fit-on", nargs="*", default=[], help="recorded grids' data files to fit the family to")
    a = ap.parse_args()
    family = fit_family([from_jsonl(Path(d)) for d in a.fit_on]) if a.fit_on else Family()
    print(f"family: {family}")
    for index in range(a.seed, a.seed + a.grids):
        rec = simulate(index, family)
        truth = rec.truth()
        best = max(truth.values())
        near = sum(v >= 0.97 * best for v in truth.values())
        noisy = sum(1 for rs in rec.table.values() if 0 < sum(r.status == Status.OOM for r in rs) < len(rs))
        print(
            f"{rec.label}: {len(rec.table)} configs, {sum(v > 0 for v in truth.values())} feasible, {noisy} noisy "
            f"OOMs, {near} within 3% of the best; one launch of each costs {rec.grid_s():.0f} trial-s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
