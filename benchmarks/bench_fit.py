"""How many runs, and how long, does ``ppotune fit`` take to find the largest per-GPU sizes that fit the worst case,
against an exhaustive worst-case sweep of the same ladders and against a default search reaching the same answer?

For each job (the recorded grids' jobs, and a token-budget shape of the first grid's job):

* **fit**: ``ppotune fit BASE --memory-limit-gb CAP`` for real (warm jobs as shipped; vLLM runs cold), timed; its
  answer and its probe runs from ``fit.json``;
* **sweep**: every rung of every knob's ladder probed for real (``tuner.trials.probe.probe``, the same runner, the
  same cap at the headroom's limit), knob by knob in fit's order, the knobs already swept at the sweep's answers and
  the later ones at their smallest (the sizes held together, as the exported config holds them; see
  :func:`run_sweep`), an OOM just above a fit run once more as fit runs it; a knob's answer is its largest rung
  whose passes stay within the limit. Its answer must equal fit's (the table says where it does not);
* **search**: ``ppotune search``'s own loop as shipped (TPE with local steps), replayed over the job's recorded grid
  (``benchmarks/bench_search.py``'s recording: no trial re-run, each launch one of the config's recorded repeats),
  run until its study holds what fit answers for the knob the grid varies, the actor's micro-batch at the base
  config's other settings: the fitted value measured ok and the next value up run out of memory (measured or
  inferred). Trials and recorded trial-seconds to get there, median over ``--seeds`` seeds. A search's trials are
  typical-length, not worst-case: on these padded jobs the memory of a micro-batch is the same. A job with no
  recording has no search column.

    python benchmarks/bench_fit.py --jobs tiny,tiny_tight [--out bench_out/fit] [--seeds 20]

Run one or two jobs per command under the shared lock (``flock /tmp/ppotune-heavy.lock``): a sweep is tens of real
probes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import optuna  # noqa: E402

from trainer.config import apply_overrides  # noqa: E402
from trainer.contracts import PHASES, Status, TrialRecord  # noqa: E402
from tuner.fit.inputs import fit_inputs  # noqa: E402
from tuner.fit.propose import knob_values  # noqa: E402
from tuner.trials.probe import probe  # noqa: E402
from tuner.trials.runners import SubprocessRunner  # noqa: E402
from tuner.trials.warm import WarmRunner  # noqa: E402

DATA = REPO / "benchmarks" / "data"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


@dataclass(frozen=True)
class Job:
    base: Path
    cap_gb: float
    overrides: dict = field(default_factory=dict)
    grid: Optional[Path] = None  # its recording (benchmarks/record_grid.py), for the search column


BUDGETS = {
    "actor_rollout_ref.actor.use_dynamic_bsz": True,
    "actor_rollout_ref.model.use_remove_padding": True,
    "critic.model.use_remove_padding": True,
}
JOBS = {
    "tiny": Job(DATA / "grid_base.yaml", 0.15, grid=DATA / "grid_tiny_cpu.jsonl"),
    "tiny_tight": Job(DATA / "grid_base.yaml", 0.11, grid=DATA / "grid_tiny_tight.jsonl"),
    "tiny_budget": Job(DATA / "grid_base.yaml", 0.11, overrides=BUDGETS),
    "grpo_vllm": Job(DATA / "grid2_base.yaml", 0.9, grid=DATA / "grid_grpo_vllm.jsonl"),
}


# --------------------------------------------------------------------------- fit, as shipped
def run_fit(job: Job, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tuner.cli", "fit", str(job.base), "--memory-limit-gb", str(job.cap_gb)]
    cmd += [a for k, v in job.overrides.items() for a in ("-o", f"{k}={json.dumps(v)}")]
    cmd += ["--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True)
    wall = time.monotonic() - t0
    data = json.loads((out / "fit.json").read_text())
    seconds = sum(
        float(TrialRecord.from_user_attrs(t.user_attrs).duration_s or 0.0)
        for t in optuna.load_study(study_name=data["study"], storage=f"sqlite:///{out / 'study.db'}").get_trials()
    )
    return {"values": data["values"], "runs": data["probes"], "wall_s": wall, "trial_s": seconds}


# --------------------------------------------------------------------------- the exhaustive sweep
def _verdict(got, knob, limit_gb: float) -> tuple[bool, Optional[float]]:
    """(whether ``knob``'s passes fitted in probe ``got``, their peak) read as fit reads a probe: within the limit on
    the objective's basis, or an OOM in a later pass (the passes before it ran under the cap)."""
    by_phase = got.peak_memory_by_phase_gb
    offset = max(0.0, (got.peak_memory_gb or 0.0) - max(by_phase.values(), default=0.0))
    mine = [by_phase[p] for p in knob.phases if p in by_phase]
    own = max(mine) + offset if mine else None
    if got.status is Status.OK:
        return own is not None and own <= limit_gb + 1e-12, own
    later = got.status is Status.OOM and got.oom_phase in PHASES and knob.phases
    return bool(later and all(PHASES.index(p) < PHASES.index(got.oom_phase) for p in knob.phases)), own


def run_sweep(job: Job, out: Path) -> dict:
    """Every rung of every ladder, knob by knob in fit's order (the order the passes run), the knobs already swept
    held at the sweep's answers and the rest at their smallest: a knob's passes run after the earlier knobs' passes
    at the sizes the exported config will hold, and before the later knobs' passes, which cannot move them. An OOM
    one rung above a fitting rung is run once more, as fit repeats it; every run is counted. A knob's answer is its
    largest fitting rung; the last knob's run at its answer is the whole answer's run."""
    inputs = fit_inputs(str(job.base), overrides=dict(job.overrides), memory_limit_gb=job.cap_gb)
    knobs = list(inputs.knobs)
    cold = SubprocessRunner(device_kind=inputs.device["kind"], nproc=inputs.trial_base["trainer"]["n_gpus_per_node"])
    runner = WarmRunner(cold=cold, jobs_dir=out / "jobs")
    held, trace, whole = {g.key: 0 for g in knobs}, [], None

    def one(k, r: int, again: bool):
        over = knob_values(knobs, held | {k.key: r})
        got = probe(apply_overrides(inputs.trial_base, over), runner=runner, trial_dir=out / str(len(trace)))
        fits, own = _verdict(got, k, inputs.limit_gb)
        st, phase = got.status.value, got.oom_phase
        trace.append(
            dict(knob=k.key, value=k.ladder[r], status=st, fits=fits, own_gb=own, oom_phase=phase, repeat=again)
        )
        print(f"sweep {k.role} {k.ladder[r]}{' again' if again else ''}: {st} {phase or ''} {own or 0.0:.3f} GB {fits}")
        return got, fits, got.duration_s

    seconds, t0 = 0.0, time.monotonic()
    try:
        for k in knobs:
            best = -1
            for r in range(len(k.ladder)):
                got, fits, spent = one(k, r, False)
                if not fits and got.status is Status.OOM and best == r - 1 >= 0:
                    seconds += spent
                    got, fits, spent = one(k, r, True)  # an OOM one rung above a fit: a noisy boundary, once more
                seconds += spent
                best = r if fits else best
                if fits and k is knobs[-1]:  # every knob at its answer: the whole answer's run
                    whole = got.status is Status.OK and (got.peak_memory_gb or 0.0) <= inputs.limit_gb + 1e-12
            held[k.key] = max(best, 0)  # none fits: the later knobs' runs hold it at its smallest
    finally:
        runner.close()
    values = {k.key: k.ladder[held[k.key]] for k in knobs if any(t["knob"] == k.key and t["fits"] for t in trace)}
    return {
        "values": values,
        "runs": len(trace),
        "repeats": sum(t["repeat"] for t in trace),
        "wall_s": time.monotonic() - t0,
        "trial_s": seconds,
        "answer_ran_within": whole,
        "trace": trace,
    }


# --------------------------------------------------------------------------- a default search, replayed
def run_search(job: Job, fitted: int, seeds: int) -> Optional[dict]:
    """``bench_search.py``'s replay of the search as shipped (TPE, local steps), one per seed over the whole grid; when
    its study first knew the fitted micro-batch ran (at the base config's other settings) and the next one up did not
    (out of memory, measured or inferred): trials launched by then and trial-seconds spent."""
    import bench_search

    rec = bench_search.from_jsonl(job.grid)
    base = rec.space.baseline_values(rec.flat)

    def ident(micro: int) -> tuple:
        return rec.space.identity(rec.space.complete({**base, MICRO: micro}, rec.flat).effective)

    fits, fails = ident(fitted), ident(2 * fitted)
    per_seed = []
    for seed in range(seeds):
        run = bench_search.run_search("ours", seed, rec, hint=40, cap_s=math.inf)
        ok = bad = False
        reached, launched, before = (math.inf, math.inf), 0, 0.0
        for spent, got, throughput in run.events:
            launched += spent > before  # a trial that cost seconds ran; a free one (inferred, duplicate) did not
            before = spent
            ok |= got == fits and throughput is not None
            bad |= got == fails and throughput is None
            if ok and bad:
                reached = (launched, spent)
                break
        per_seed.append(reached)
    got = [(t, s) for t, s in per_seed if t < math.inf]
    return {
        "reached": len(got),
        "seeds": seeds,
        "trials_median_reached": statistics.median(t for t, _ in got) if got else None,
        "trial_s_median_reached": statistics.median(s for _, s in got) if got else None,
        "grid_s": rec.grid_s(),
        "per_seed": [[t if t < math.inf else None, s if s < math.inf else None] for t, s in per_seed],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="tiny", help=f"comma-separated, of {', '.join(JOBS)}")
    ap.add_argument("--out", default="bench_out/fit")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="fit and search only")
    ap.add_argument("--search-only", action="store_true", help="the search column, from an earlier run's fit in --out")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = {}
    for name in args.jobs.split(","):
        job, out = JOBS[name], Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        done = out / "fit" / "fit.json"
        if args.search_only and done.is_file():  # the search column again, from an earlier run's fit
            row = {"fit": {"values": json.loads(done.read_text())["values"]}}
        else:
            row = {"fit": run_fit(job, out / "fit")}
        if not args.no_sweep and not args.search_only:
            row["sweep"] = run_sweep(job, out / "sweep")
            row["equal"] = row["sweep"]["values"] == row["fit"]["values"]
        fitted = row["fit"]["values"].get(MICRO)
        if job.grid is not None and fitted is not None:
            row["search"] = run_search(job, fitted, args.seeds)
        rows[name] = row
        print(json.dumps({name: row}, indent=2), flush=True)
    (Path(args.out) / f"bench_fit_{'_'.join(rows)}.json").write_text(json.dumps(rows, indent=2) + "\n")
    for name, row in rows.items():
        f, s, q = row["fit"], row.get("sweep"), row.get("search")
        line = (
            f"{name}: fit {f['runs']} runs {f['wall_s']:.0f} s wall ({f['trial_s']:.0f} trial-s)"
            if "runs" in f
            else name
        )
        if s:
            line += (
                f" | sweep {s['runs']} runs ({s['repeats']} repeats) {s['wall_s']:.0f} s ({s['trial_s']:.0f} trial-s)"
            )
            line += f", equal {row['equal']}"
        if q and q["reached"]:
            reached = f"{q['reached']}/{q['seeds']} seeds reached it"
            line += (
                f" | search {q['trials_median_reached']} trials {q['trial_s_median_reached']:.0f} trial-s ({reached})"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
