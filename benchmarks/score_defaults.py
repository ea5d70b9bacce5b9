"""The search's defaults, chosen on a family of simulated grids and scored on grids and seeds they never saw.

For each grid (``--data``: recorded grids, each in its own block; ``--family N``: N simulated grids of
``benchmarks/grid_sim.py``, summarized together) and each seed set, ``ppotune search`` as shipped (TPE with its
local steps, its own proposals when the sampler stalls, then the adaptive confirmation; ``replay.run_search`` and
``replay.confirm_after``) against Optuna's random sampler in the same loop:

* the median share of the grid's trial-seconds until the pick first reaches 97% of the grid's best (the
  confirmation's re-runs counted for the default), its 90% interval over the seeds, and random's;
* calibration: the share of seeds whose confirmed gain's stated 90% interval holds the truth (the ratio of the
  medians of the recorded repeats of the pick and of the baseline), the confirmation run after the search spent
  ``--claim-at`` of the grid's seconds;
* replays that stopped with budget left while a config was neither measured nor ruled out (checked independently of
  the search's own stop rule: ``replay.unsettled_configs``).

``--rounds``, ``--finalists``, ``--noise``, ``--startup``, ``--local-every`` and ``--no-corner`` score another
setting than the shipped one (what the family chooses between).

    python benchmarks/score_defaults.py --data benchmarks/data/grid_tiny_cpu.jsonl ... --seed-sets 9100 9200
    python benchmarks/score_defaults.py --family 24 --seeds 3 --seed-sets 1000 [--fit-on DATA ...] [--rounds 2]
    python benchmarks/score_defaults.py ... --json A.json; ... --json B.json; --compare A.json B.json  # paired
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import optuna  # noqa: E402
import replay  # noqa: E402
from grid_sim import Family, fit_family, simulate  # noqa: E402

from tuner.rules.finalists import DEFAULT_FINALISTS, DEFAULT_ROUNDS  # noqa: E402
from tuner.rules.race import RUN_NOISE_FLOOR  # noqa: E402


@dataclass
class Scores:
    """One grid (or the family) over one seed set."""

    ours: list = field(default_factory=list)  # shares of the grid's seconds to 97%, confirmation counted
    alone: list = field(default_factory=list)  # the same, the search alone (no confirmation)
    random: list = field(default_factory=list)
    covered: int = 0
    claims: int = 0
    separated: int = 0
    unsettled: int = 0  # replays that stopped with budget left and a config neither measured nor ruled out
    early: int = 0  # replays that stopped on their own before the budget (every config measured or ruled out)
    reruns: list = field(default_factory=list)  # the confirmation's rounds at the claim
    replays: list = field(default_factory=list)  # per replay: {"grid", "seed", "ours", "alone"} (--json)


def score_grid(rec: replay.Recording, seeds: range, a: argparse.Namespace, out: Scores, grid: str = "") -> None:
    """Replay the default and random over ``seeds`` on ``rec``; add to ``out``."""
    truth, grid_s = rec.truth(), rec.grid_s()
    best, n = max(truth.values()), len(rec.table)
    hint = max(1, round(0.25 * n))  # the --trials a user would give for a quarter of the grid
    for seed in seeds:
        kw = dict(hint=hint, cap_s=a.cap * grid_s, startup=a.startup)
        run = replay.run_search("ours", seed, rec, local_every=a.local_every, corner=not a.no_corner, **kw)
        how = dict(rounds=a.rounds, finalists=a.finalists, noise=a.noise, repeats=not a.own_noise_only)
        curve = replay.confirmed_curve(run, rec, seed, **how)
        out.ours.append(replay.confirmed_seconds_to(curve, truth, replay.TARGET * best) / grid_s)
        out.alone.append(replay.seconds_to(run, truth, replay.TARGET * best) / grid_s)
        out.replays.append({"grid": grid, "seed": seed, "ours": _finite(out.ours[-1]), "alone": _finite(out.alone[-1])})
        claim = next((c for total, c in reversed(curve) if total <= a.claim_at * grid_s), None)
        if claim is not None:
            got = replay.covers(claim, truth, rec)
            if got is not None:
                out.claims += 1
                out.covered += got
                out.separated += claim.separated
                out.reruns.append(claim.rounds)
        if run.stopped is not None:
            out.early += 1
            out.unsettled += run.unsettled > 0
        if not a.no_random:
            rnd = replay.run_search("random", seed, rec, **kw)
            out.random.append(replay.seconds_to(rnd, truth, replay.TARGET * best) / grid_s)


def _finite(x: float) -> Optional[float]:
    """A share for JSON: None where the replay never got there."""
    return x if math.isfinite(x) else None


def paired(a: list, b: list, key: str = "ours") -> dict:
    """Two settings' replays of the same (grid, seed), compared pair by pair: how often each reached 97% with fewer
    of the grid's seconds, the median of the differences (b - a; a replay that never got there counts as the
    worst), and a two-sided sign test's p-value. Medians over different seeds do not separate settings whose
    replays scatter as these do; pairs share the grid and the seed."""
    by = {(r["grid"], r["seed"]): r[key] for r in a}
    pairs = [(by[(r["grid"], r["seed"])], r[key]) for r in b if (r["grid"], r["seed"]) in by]
    worst = 1.0 + max([x for p in pairs for x in p if x is not None] or [0.0])
    diffs = [(y if y is not None else worst) - (x if x is not None else worst) for x, y in pairs]
    a_better, b_better = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    n, k = a_better + b_better, min(a_better, b_better)
    p = min(1.0, 2.0 * replay.fair_binomial_cdf(n, k)) if n else 1.0
    return {"pairs": len(pairs), "a_better": a_better, "b_better": b_better, "ties": len(diffs) - n,
            "median_diff": statistics.median(diffs) if diffs else math.nan, "p": p}  # fmt: skip


def _share(x: float, cap: float) -> str:
    return f"{x:.0%}" if math.isfinite(x) else f">{cap:.0%}"


def line(label: str, s: Scores, cap: float) -> str:
    ours, rnd = replay.median(s.ours), replay.median(s.random) if s.random else math.nan
    lo, hi = replay.median_interval(s.ours)
    ratio = rnd / ours if s.random and ours and math.isfinite(ours) else math.nan
    ratio_txt = f"{ratio:.2f}x" if math.isfinite(ratio) else (">" if s.random and not math.isfinite(ours) else "n/a")
    if s.random and math.isfinite(ours) and not math.isfinite(rnd):
        ratio_txt = f"> {cap / ours:.1f}x"
    calib = f"{s.covered}/{s.claims} = {s.covered / s.claims:.0%}" if s.claims else "n/a"
    return (
        f"| {label} | {_share(ours, cap)} ({_share(lo, cap)}-{_share(hi, cap)}) | "
        f"{_share(replay.median(s.alone), cap)} | "
        f"{_share(rnd, cap) if s.random else 'n/a'} | {ratio_txt} | "
        f"{sum(x <= 0.15 for x in s.ours)}/{len(s.ours)} | {calib} | {s.separated}/{s.claims} | "
        f"{s.unsettled} of {s.early} |"
    )


HEAD = (
    "| grid, seeds | default: share to 97% (90% int.) | search alone | random | random / default "
    "| seeds <= 15% | calibration | separated | stopped early, unsettled |\n|---|---|---|---|---|---|---|---|---|"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="*", default=[], help="recorded grids (benchmarks/record_grid.py's data files)")
    ap.add_argument("--family", type=int, default=0, help="this many simulated grids (benchmarks/grid_sim.py)")
    ap.add_argument("--family-first", type=int, default=0, help="the first simulated grid's index")
    ap.add_argument("--fit-on", nargs="*", default=[], help="fit the family to these recorded grids (default: none)")
    ap.add_argument("--seeds", type=int, default=20, help="seeds per grid and seed set")
    ap.add_argument("--seed-sets", type=int, nargs="+", default=[9100, 9200], help="each set's first seed")
    ap.add_argument("--cap", type=float, default=0.5, help="stop each replay after this share of the grid's seconds")
    ap.add_argument("--claim-at", type=float, default=0.25, help="calibration: the claim after this share")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="the confirmation's cap (--confirm R)")
    ap.add_argument("--finalists", type=int, default=DEFAULT_FINALISTS)
    ap.add_argument("--noise", type=float, default=RUN_NOISE_FLOOR, help="a run's noise with no interval of its own")
    ap.add_argument(
        "--own-noise-only",
        action="store_true",
        help="the intervals without the run-to-run noise the confirmation measures (each run's own and the floor)",
    )
    ap.add_argument("--startup", type=int, help="TPE's random start-up trials (default: the search's rule)")
    ap.add_argument("--local-every", type=int, default=2)
    ap.add_argument("--no-corner", action="store_true", help="no walk from the hints' corner (tuner.search.corner)")
    ap.add_argument("--no-random", action="store_true", help="leave random search out (the family's choices)")
    ap.add_argument("--json", type=Path, help="write every replay's shares here (for --compare)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="pair two --json files' replays and stop")
    a = ap.parse_args()
    if a.compare:
        first, second = (json.loads(f.read_text()) for f in a.compare)
        for key in ("ours", "alone"):
            c = paired(first, second, key)
            print(
                f"{key}: {c['pairs']} pairs; {a.compare[0].name} fewer seconds in {c['a_better']}, "
                f"{a.compare[1].name} in {c['b_better']}, ties {c['ties']}; median difference (B - A) "
                f"{c['median_diff']:+.1%} of the grid; sign test p = {c['p']:.3f}"
            )
        return 0
    t0 = time.monotonic()
    replays: list = []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(HEAD)
    for first in a.seed_sets:
        seeds = range(first, first + a.seeds)
        for data in a.data:
            s = Scores()
            score_grid(replay.from_jsonl(Path(data)), seeds, a, s, grid=Path(data).stem)
            replays += s.replays
            print(line(f"{Path(data).stem}, {first}-{first + a.seeds - 1}", s, a.cap), flush=True)
        if a.family:
            family = fit_family([replay.from_jsonl(Path(d)) for d in a.fit_on]) if a.fit_on else Family()
            s = Scores()
            for index in range(a.family_first, a.family_first + a.family):
                score_grid(simulate(index, family), seeds, a, s, grid=f"family-{index}")
            replays += s.replays
            label = f"family of {a.family} simulated grids, seeds {first}-{first + a.seeds - 1} each"
            print(line(label, s, a.cap), flush=True)
            if s.reruns:
                print(f"  rounds at the claim: mean {statistics.mean(s.reruns):.2f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(replays))
    settings = f"--rounds {a.rounds} --finalists {a.finalists} --noise {a.noise} --local-every {a.local_every}"
    settings += " --own-noise-only" if a.own_noise_only else ""
    settings += " --no-corner" if a.no_corner else ""
    print(f"({settings} --startup {a.startup} --cap {a.cap} --claim-at {a.claim_at}; {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
