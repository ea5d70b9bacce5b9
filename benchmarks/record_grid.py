"""Record a real grid for the sampler benchmark (bench_search.py replays it).

Runs every config of ``benchmarks/data/grid_space.yaml`` on ``benchmarks/data/grid_base.yaml``
(per-GPU knobs only; 1 process; a real CPU memory cap under which the large micro-batches and
token budgets run out of memory) ``--repeats`` times, each repeat a ``ppotune search --sampler
grid`` study of its own (real ``ppotune train`` trials, every step measured: ``--precision 0``),
then writes one JSON line per trial to the data file that is committed with the repository:

    {"repeat", "number", "status", "overrides", "throughput", "throughput_ci", "measured_steps",
     "peak_memory_gb", "by_phase_gb", "model_shape", "lengths", "duration_s", "inferred_from", "oom_phase"}

(``by_phase_gb``: the per-phase peaks on the objective's basis, what ``tuner.memory_model`` is calibrated
on; ``model_shape``: the model's HF config fields; ``lengths``: the token-length percentiles the trial saw.)

An inferred OOM (never launched) is written with the seconds of the OOM it was inferred from,
which is what launching it would have cost. Re-running the command resumes unfinished repeats.

    python benchmarks/record_grid.py [--out bench_out/grid] [--repeats 3] [--data benchmarks/data/grid_tiny_cpu.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import optuna  # noqa: E402

from trainer.contracts import Status, TrialRecord  # noqa: E402

BASE = REPO / "benchmarks" / "data" / "grid_base.yaml"
SPACE = REPO / "benchmarks" / "data" / "grid_space.yaml"
DATA = REPO / "benchmarks" / "data" / "grid_tiny_cpu.jsonl"
CAP_GB, STEPS, WARMUP, NPROC = 0.15, 4, 1, 1


def grid_size() -> int:
    from trainer.config import flatten
    from tuner.space import base_flat_config, load_space

    return load_space(SPACE).size(flatten(base_flat_config(str(BASE), nproc=NPROC)[0]))


def record(out: Path, repeat: int, trials: int) -> None:
    cmd = [
        sys.executable, "-m", "tuner.cli", "search", str(BASE), "--space", str(SPACE),
        "--trials", str(trials), "--sampler", "grid", "--seed", str(repeat), "--nproc", str(NPROC),
        "--steps", str(STEPS), "--warmup", str(WARMUP), "--precision", "0", "--confirm", "0",
        "--memory-limit-gb", str(CAP_GB), "--storage", f"journal:{out / 'grid.log'}",
        "--study", f"grid-r{repeat}", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")  # one core: the trials are alike
    subprocess.run(cmd, check=True, env=env)


def export(out: Path, repeats: int, data: Path) -> int:
    from trainer.contracts import parse_storage
    from tuner.study.storage import open_storage

    storage = open_storage(parse_storage(f"journal:{out / 'grid.log'}", default_dir=out))
    lines = []
    for r in range(repeats):
        study = optuna.load_study(study_name=f"grid-r{r}", storage=storage)
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        for t in trials.values():
            rec = TrialRecord.from_user_attrs(t.user_attrs)
            if rec.status not in (Status.OK, Status.OOM, Status.HANG, Status.CRASH, Status.INFERRED_OOM):
                continue
            seconds = rec.duration_s
            if rec.status == Status.INFERRED_OOM:
                seconds = TrialRecord.from_user_attrs(trials[rec.inferred_from].user_attrs).duration_s
            lines.append(
                {
                    "repeat": r,
                    "number": t.number,
                    "status": str(rec.status),
                    "overrides": rec.overrides or {},
                    "throughput": rec.throughput,
                    "throughput_ci": rec.throughput_ci,
                    "measured_steps": rec.measured_steps,
                    "peak_memory_gb": rec.peak_memory_gb,
                    "by_phase_gb": (rec.memory or {}).get("by_phase_gb") or None,
                    "model_shape": rec.model_shape,
                    "lengths": rec.lengths or None,
                    "duration_s": seconds,
                    "inferred_from": rec.inferred_from,
                    "oom_phase": rec.oom_phase,
                }
            )
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    return len(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/grid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--export-only", action="store_true", help="write the data file from what is recorded")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    size = grid_size()
    t0 = time.monotonic()
    if not args.export_only:
        for r in range(args.repeats):
            record(out, r, size)
    n = export(out, args.repeats, Path(args.data))
    print(f"record_grid: {size} configs x {args.repeats} repeats -> {n} lines in {args.data} "
          f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
