"""Warm-trial drift: does a config measure the same as a warm job's first trial and as a later one?

The search compares configs measured in different places of a warm job (``tuner.trials.warm``): the job's first
trial starts it, the later ones reuse its ranks. If a later trial reads faster or slower than the first one with
the same config, the search ranks where a config ran, not the config. This runs ``--jobs`` warm jobs through the
real runner, each the sequence below (the tiny preset, 2 CPU ranks, gloo), and prints for each job the later
trials' median step time over the first trial's:

    first:  C     (the job's first trial: starts the job, one warm-up step)
    other:  fsdp2, micro-batch 4 (another config in between)
    later:  C     (the same config as the first, later in the job)
    last:   C

``C`` is the config where drift was built in: ``use_torch_compile`` with chunked entropy and token-budget
micro-batches (the compiled entropy is kept across a job's trials, trainer.engine.parallelize.compiled_entropy; before,
each trial recompiled it inside measured steps). The test (tests/e2e/test_warm_drift.py) checks the mechanism
(no measured step compiles); the step times are a timing claim, measured here, where a noisy machine shows as
spread across jobs instead of failing one run.

    python benchmarks/bench_warm_drift.py [--jobs 3] [--steps 6] [--json FILE]

Run it alone on the machine (it measures wall time): ``flock /tmp/ppotune-heavy.lock python ...``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.config import config_to_dict, load_config  # noqa: E402
from trainer.contracts import Status  # noqa: E402
from tuner.trials.runners import SubprocessRunner, TrialRequest  # noqa: E402
from tuner.trials.warm import WarmRunner  # noqa: E402

BASE = REPO / "configs" / "tiny_cpu.yaml"
ACTOR = "actor_rollout_ref.actor"
COMPILED = {
    f"{ACTOR}.use_torch_compile": True,
    f"{ACTOR}.entropy_from_logits_with_chunking": True,
    f"{ACTOR}.entropy_from_logits_chunk_size": 16,
    f"{ACTOR}.use_dynamic_bsz": True,
    f"{ACTOR}.ppo_max_token_len_per_gpu": 160,
}
OTHER = {f"{ACTOR}.strategy": "fsdp2", f"{ACTOR}.ppo_micro_batch_size_per_gpu": 4}
SEQUENCE = (("first", COMPILED), ("other", OTHER), ("later", COMPILED), ("last", COMPILED))


def run_job(jobs_dir: Path, steps: int) -> dict:
    """One warm job through :data:`SEQUENCE`: {name: TrialOutcome}, each trial from its own thread (as a search's
    slot runs it)."""
    cold = SubprocessRunner(device_kind="cpu", nproc=2, grace_s=3.0, startup_timeout_s=300, step_timeout_s=120)
    warm = WarmRunner(cold=cold, jobs_dir=jobs_dir / "jobs")
    got = {}
    try:
        for number, (name, knobs) in enumerate(SEQUENCE):
            flat = {"trainer.total_training_steps": steps, "ppotune.warmup_steps": 1, **knobs}
            flat["ppotune.min_measured_steps"] = steps - 1
            cfg = config_to_dict(load_config(BASE, [f"{k}={json.dumps(v)}" for k, v in flat.items()]))
            trial_dir = jobs_dir / "trials" / str(number)
            req = TrialRequest(number=number, config=cfg, identity=(number,), trial_dir=trial_dir)
            worker = threading.Thread(target=lambda r=req, n=name: got.__setitem__(n, warm.run(r, threading.Event())))
            worker.start()
            worker.join()
    finally:
        warm.close()
    return got


def measured_step_s(outcome) -> list[float]:
    """A trial's measured step times (its result file's steps less the warm-up ones)."""
    result = json.loads(Path(outcome.record.result_path).read_text())
    return [s["timing_s/step"] for s in result["steps"] if not s["warmup"]]


def compiles(outcome) -> list[str]:
    """The trial's notes of a torch.compile inside a measured step (trainer.rank.trial)."""
    return [n for n in outcome.record.notes if n.startswith("torch.compile:")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=3, help="warm jobs, one after the other")
    ap.add_argument("--steps", type=int, default=6, help="steps per trial (the first trial's first is its warm-up)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_warm_drift_") as tmp:
        for j in range(args.jobs):
            got = run_job(Path(tmp) / str(j), args.steps)
            bad = {n: o.status.value for n, o in got.items() if o.status != Status.OK}
            if bad:
                raise SystemExit(f"bench_warm_drift: job {j}: trials not ok: {bad}")
            first = statistics.median(measured_step_s(got["first"]))
            row = {"job": j, "first_s": first, "compiles": sum(len(compiles(o)) for o in got.values())}
            for name in ("other", "later", "last"):
                row[f"{name}_s"] = statistics.median(measured_step_s(got[name]))
            row["later/first"], row["last/first"] = row["later_s"] / first, row["last_s"] / first
            rows.append(row)
            print(
                f"job {j}: median step first {first:.3f} s, later {row['later_s']:.3f} s ({row['later/first']:.2f}x), "
                f"last {row['last_s']:.3f} s ({row['last/first']:.2f}x); compiles in measured steps: {row['compiles']}",
                flush=True,
            )
    ratios = [r[k] for r in rows for k in ("later/first", "last/first")]
    print(
        f"later or last / first over {len(rows)} jobs: median {statistics.median(ratios):.2f}x, "
        f"range {min(ratios):.2f}-{max(ratios):.2f}x"
    )
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "python": sys.version.split()[0]}
        args.json.write_text(json.dumps({"meta": meta, "jobs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
