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

``--every-config`` records another grid (``--base``, ``--space``, ``--cap-gb``, ``--data``) with no search at all:
every config is launched in every repeat (no OOM is inferred from another), each repeat in its own shuffled order,
through the runner the search uses, one line appended per trial as it ends (a re-run resumes). That is what
counts how often each config runs out of memory near the cap (issue 25.5: the second grid, GRPO with the vLLM
rollout, on benchmarks/data/grid2_base.yaml and grid2_space.yaml):

    python benchmarks/record_grid.py --every-config --grid grpo_vllm [--data bench_out/grid2/grid_grpo_vllm.jsonl]

and the third, the first grid's job and space under a tight cap (2 repeats, ~24 min):

    python benchmarks/record_grid.py --every-config --grid tiny_tight --repeats 2 [--data FILE]

and the fourth, held out from every choice of the search's defaults (a deeper model on long, near-uniform prompts
under a tight cap), in parts that each start no trial after ``--time-limit-s`` (the same command resumes):

    python benchmarks/record_grid.py --every-config --grid deep_uniform --repeats 2 --time-limit-s 1100

(``GRIDS`` below names each grid's base, space, cap and data file; bench_search.py finds a grid by its data file.)

(The cap is RLIMIT_DATA above the post-start level, which counts vLLM's reservations too, and the trials run one
OpenMP thread, as recorded: more threads hold more memory. Why grid 2's cap is where it is: benchmarks/README.md,
"Figures behind the code's comments".)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import optuna  # noqa: E402

from trainer.contracts import Status, TrialRecord  # noqa: E402

DATA_DIR = REPO / "benchmarks" / "data"
BASE = DATA_DIR / "grid_base.yaml"
SPACE = DATA_DIR / "grid_space.yaml"
DATA = DATA_DIR / "grid_tiny_cpu.jsonl"
CAP_GB, STEPS, WARMUP, NPROC = 0.15, 4, 1, 1


@dataclass(frozen=True)
class Grid:
    """A recorded grid: what its trials ran (base, space, cap, ranks, steps) and its committed data file."""

    base: Path
    space: Path
    data: Path
    cap_gb: float
    nproc: int = NPROC
    steps: int = STEPS
    warmup: int = WARMUP


GRIDS = {
    # the first grid: short, skewed prompts under a loose cap (a search's recording: OOMs inferred)
    "tiny_cpu": Grid(BASE, SPACE, DATA, CAP_GB),
    # the second (issue 25.5): GRPO with a vLLM rollout, long near-uniform prompts, every config every repeat
    "grpo_vllm": Grid(
        DATA_DIR / "grid2_base.yaml", DATA_DIR / "grid2_space.yaml", DATA_DIR / "grid_grpo_vllm.jsonl", 0.9
    ),
    # the third: the first grid's job and space under a tight cap (0.11 GB, from 0.15), where its fastest fitting
    # configs sit at the memory boundary; cold trials, every config every repeat
    "tiny_tight": Grid(BASE, SPACE, DATA_DIR / "grid_tiny_tight.jsonl", 0.11),
    # the fourth, held out from every choice of the search's defaults: a deeper model (6 layers) on long,
    # near-uniform prompts, grid 1's space, under a tight cap; cold trials, every config every repeat
    "deep_uniform": Grid(DATA_DIR / "grid4_base.yaml", SPACE, DATA_DIR / "grid_deep_uniform.jsonl", 0.25),
}


def grid_of(data: str | Path) -> Grid:
    """The grid a data file records (by its file name: a copy elsewhere, e.g. one being recorded, is found too)."""
    name = Path(data).name
    for grid in GRIDS.values():
        if grid.data.name == name:
            return grid
    raise SystemExit(
        f"{data}: not a recorded grid's data file (known: {', '.join(g.data.name for g in GRIDS.values())})"
    )


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
            lines.append(row(r, t.number, rec, seconds))
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in lines))
    return len(lines)


def row(repeat: int, number: int, rec: TrialRecord, seconds: float | None) -> dict:
    """One line of a grid's data file (the module docstring's fields)."""
    return {
        "repeat": repeat,
        "number": number,
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


def recording_base(base_nested: dict, *, steps: int, warmup: int, cap_gb: float | None) -> dict:
    """What every trial of a recording runs before its knobs: the base config with the recording's steps and cap."""
    from trainer.config import apply_overrides, config_from_dict, config_to_dict

    extra = {"trainer.total_training_steps": steps, "ppotune.warmup_steps": warmup, "ppotune.memory_limit_gb": cap_gb}
    return config_to_dict(config_from_dict(apply_overrides(base_nested, extra)))


def record_every_config(args: argparse.Namespace) -> int:
    """Every config of the space, every repeat, through the search's own runner; appends to ``args.data`` (a line
    per trial as it ends, so a part stopped by ``--time-limit-s`` or Ctrl-C resumes); returns the trials written."""
    import random
    import threading

    from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten
    from tuner.space import base_flat_config, load_space
    from tuner.trials.runners import SubprocessRunner, TrialRequest

    grid = GRIDS[args.grid]
    space = load_space(grid.space)
    nested = base_flat_config(str(grid.base), nproc=grid.nproc)[0]
    base = recording_base(nested, steps=grid.steps, warmup=grid.warmup, cap_gb=grid.cap_gb)
    configs = list(space.grid(flatten(base)))
    data = Path(args.data or grid.data)
    done = set()
    if data.is_file():
        done = {(x["repeat"], x["number"]) for x in map(json.loads, data.read_text().splitlines())}
    runner = SubprocessRunner(device_kind="cpu", nproc=grid.nproc, grace_s=3.0, timeout_s=600)
    os.environ["OMP_NUM_THREADS"] = "1"  # one core per rank: the trials are alike (as the search-based recording)
    data.parent.mkdir(parents=True, exist_ok=True)
    t0, written = time.monotonic(), 0
    for r in range(args.repeats):
        order = list(range(len(configs)))
        random.Random(r).shuffle(order)  # a drift of the machine lands on other configs in each repeat
        for number in order:
            if (r, number) in done:
                continue
            if args.time_limit_s and time.monotonic() - t0 > args.time_limit_s:
                print(f"record_grid: --time-limit-s {args.time_limit_s:g} reached; run it again to resume", flush=True)
                return written
            cand = configs[number]
            config = config_to_dict(config_from_dict(apply_overrides(base, cand.overrides)))
            req = TrialRequest(
                number=number,
                config=config,
                identity=space.identity(cand.effective),
                trial_dir=Path(args.out).resolve() / f"r{r}" / str(number),
                overrides=cand.overrides,
            )
            outcome = runner.run(req, threading.Event())
            rec = outcome.record
            rec.status, rec.overrides = outcome.status, dict(cand.overrides)
            with data.open("a") as f:
                f.write(json.dumps(row(r, number, rec, rec.duration_s), sort_keys=True) + "\n")
            written += 1
            print(f"r{r} #{number}: {rec.status} {rec.throughput} tok/s {rec.peak_memory_gb} GB", flush=True)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/grid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default=None, help="the data file (default: the grid's committed one)")
    ap.add_argument("--export-only", action="store_true", help="write the data file from what is recorded")
    ap.add_argument("--every-config", action="store_true", help="launch every config in every repeat (no search)")
    ap.add_argument("--grid", choices=sorted(set(GRIDS) - {"tiny_cpu"}), help="--every-config: the grid recorded")
    ap.add_argument(
        "--time-limit-s",
        type=float,
        help="--every-config: start no trial after this long (record in parts; the same command resumes)",
    )
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.every_config:
        if args.grid is None:
            ap.error("--every-config needs --grid (the first grid is recorded by searches: no --every-config)")
        t0 = time.monotonic()
        n = record_every_config(args)
        print(f"record_grid: {n} trials in {args.data} ({time.monotonic() - t0:.0f} s)")
        return 0
    size = grid_size()
    t0 = time.monotonic()
    if not args.export_only:
        for r in range(args.repeats):
            record(out, r, size)
    n = export(out, args.repeats, Path(args.data or DATA))
    print(f"record_grid: {size} configs x {args.repeats} repeats -> {n} lines in {args.data} "
          f"({time.monotonic() - t0:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
