"""How well do the samplers do with a quarter of a grid's budget?

1. Runs the FULL grid of a small space once with ``ppotune search --sampler grid`` (real
   trials: ``ppotune train`` on the tiny preset, 2 CPU processes, with a memory cap under
   which the wide model OOMs).
2. Replays ``ppotune search``'s own loop (the same :class:`tuner.loop.Search`: ask/tell,
   constraints, duplicates, inferred OOM, exploration) with TPE, NSGA-II and random search,
   a quarter of the grid's trials each, for several seeds. The baseline trial is left out
   of the replay so that every trial is the sampler's own choice (the baseline config is
   in the grid like any other). Trials are NOT
   re-run: each launch is answered by :class:`tuner.runners.ReplayRunner` (the public runner
   seam) from the grid's real measurements (status, throughput, memory, seconds). A config
   the grid run did not launch because it was inferred OOM is answered as an OOM costing
   the seconds of the OOM it was inferred from.
3. Prints, per sampler: best feasible throughput found / the grid's best, how often the
   grid's best was found, and the trial-seconds the search would have spent.

    python benchmarks/bench_search.py [--out bench_out] [--seeds 10] [--reuse]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import optuna  # noqa: E402

from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten  # noqa: E402
from trainer.contracts import DIRECTIONS, Status, TrialRecord  # noqa: E402
from tuner.decide import count_progress  # noqa: E402
from tuner.loop import Search, SearchOptions, build_sampler  # noqa: E402
from tuner.runners import ReplayRunner  # noqa: E402
from tuner.space import base_flat_config, load_space  # noqa: E402
from tuner.study import StudyLock  # noqa: E402

SPACE = textwrap.dedent("""
    description: benchmark space - 2 x 3 x 2 x 2 = 24 configs; the 1024-wide model OOMs under the cap
    knobs:
      ppotune.tiny.hidden_size: {type: categorical, choices: [64, 1024], memory: increasing}
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: {type: pow2, low: 1, high: 4, memory: increasing}
      actor_rollout_ref.actor.strategy: {type: categorical, choices: [fsdp, fsdp2], memory: none}
      actor_rollout_ref.model.enable_gradient_checkpointing: {type: bool, memory: decreasing}
""")
STEPS, WARMUP, NPROC, CAP_GB = 4, 1, 2, 0.25
BASE = REPO / "configs" / "tiny_cpu.yaml"
STUDY = "bench-grid"


def run_grid(out: Path, space_path: Path, n: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "tuner.cli",
        "search",
        str(BASE),
        "--space",
        str(space_path),
        "--sampler",
        "grid",
        "--trials",
        str(n),
        "--steps",
        str(STEPS),
        "--warmup",
        str(WARMUP),
        "--nproc",
        str(NPROC),
        "--memory-limit-gb",
        str(CAP_GB),
        "--out",
        str(out),
        "--study",
        STUDY,
        "--seed",
        "0",
        "--trial-timeout",
        "300",
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def replay(
    sampler: str, seed: int, budget: int, space, trial_base, flat, grid: optuna.Study
) -> tuple[float, float, int]:
    """``ppotune search``'s own loop (tuner.loop.Search) with every launch answered by the replay runner."""
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(
        storage=storage, directions=list(DIRECTIONS), sampler=build_sampler(sampler, seed=seed, n_trials=budget)
    )
    runner = ReplayRunner.from_study(grid, space, flat, rng=random.Random(seed))
    search = Search(
        options=SearchOptions(trials=budget, sampler=sampler, seed=seed),
        study=study,
        storage=storage,
        lock=StudyLock(None),
        space=space,
        trial_base=trial_base,
        trial_flat=flat,
        runner=runner,
        penalty_gb=64.0,
    )
    search.run()
    ok = [t.values[0] for t in study.get_trials() if TrialRecord.from_user_attrs(t.user_attrs).status == Status.OK]
    return (max(ok) if ok else 0.0), runner.spent_s, runner.launched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--reuse", action="store_true", help="reuse the grid study in --out if it is complete")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    space_path = out / "bench_space.yaml"
    space_path.write_text(SPACE)
    space = load_space(space_path)
    base_nested, _ = base_flat_config(BASE, nproc=NPROC)
    trial_base = config_to_dict(
        config_from_dict(
            apply_overrides(
                base_nested,
                {
                    "trainer.total_training_steps": STEPS,
                    "ppotune.warmup_steps": WARMUP,
                    "ppotune.memory_limit_gb": CAP_GB,
                },
            )
        )
    )
    flat = flatten(trial_base)
    n_grid = space.size(flat)
    storage = f"sqlite:///{out / 'study.db'}"

    t0 = time.monotonic()
    done = 0
    if a.reuse and (out / "study.db").exists():
        done = count_progress(optuna.load_study(study_name=STUDY, storage=storage).get_trials())
    if done < n_grid:
        run_grid(out, space_path, n_grid)
    grid_wall = time.monotonic() - t0
    grid = optuna.load_study(study_name=STUDY, storage=storage)
    table = ReplayRunner.from_study(grid, space, flat).table
    assert len(table) == n_grid, f"the grid run measured {len(table)} of {n_grid} configs"
    ok = [r for rs in table.values() for r in rs if r.status == Status.OK]
    best = max(r.throughput for r in ok)
    grid_s = sum(rs[0].duration_s for rs in table.values())
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in grid.get_trials()]
    grid_launched_s = sum(float(r.duration_s or 0) for r in recs)
    statuses: dict = {}
    for r in recs:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    budget = max(1, round(n_grid / 4))

    print()
    print(
        f"grid: {n_grid} configs (tiny preset, {NPROC} CPU procs, {STEPS} steps incl. {WARMUP} warm-up, "
        f"memory cap {CAP_GB} GiB): {len(ok)} feasible; trials by status {dict(sorted(statuses.items()))}"
    )
    print(
        f"grid: best feasible throughput {best:.1f} tokens/s/GPU; trial-seconds spent {grid_launched_s:.0f} s "
        f"(inferred OOMs cost 0; launching every config would cost {grid_s:.0f} s); wall {grid_wall:.0f} s"
    )
    print(
        f"samplers: budget {budget} trials (a quarter of the grid, every one the sampler's choice), "
        f"seeds 0..{a.seeds - 1}; values looked up from the grid's REAL measurements (no trial re-run)"
    )
    print(
        f"{'sampler':8} {'found/best mean':>15} {'min':>6} {'max':>6} {'hit best':>9} {'trial-s mean':>13} "
        f"{'launched':>9}"
    )
    for sampler in ("tpe", "nsga2", "random"):
        ratios, spent, hits, launched = [], [], 0, []
        for seed in range(a.seeds):
            found, s, n = replay(sampler, seed, budget, space, trial_base, flat, grid)
            ratios.append(found / best)
            spent.append(s)
            launched.append(n)
            hits += found >= best
        print(
            f"{sampler:8} {statistics.mean(ratios):15.3f} {min(ratios):6.3f} {max(ratios):6.3f} "
            f"{hits:>4}/{a.seeds:<4} {statistics.mean(spent):13.0f} {statistics.mean(launched):9.1f}"
        )
    return 0


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sys.exit(main())
