"""P3, overhead: how much of a search's wall time is not measured steps, cold trials against warm ones.

1. The same search twice, ``ppotune search`` as a user runs it (``configs/tiny_cpu.yaml``, the shipped
   ``search_spaces/tiny_cpu.yaml``, one seed, ``--confirm 0 --probe 0``): once ``--cold`` (one process group per
   trial), once warm (the default: one job runs every trial of the layout), whole, in ``--rounds``
   rounds of alternating order (cold, warm | warm, cold | ...), so a machine that gets busier or quieter
   weighs on both alike. Printed for each (medians over the rounds): the tuning wall time (the ``ppotune
   search`` process from start to exit), the measured step seconds (the post-warm-up steps of every
   trial, from their result files), the unmeasured share ``1 - measured / wall``, and the ratios
   warm/cold. (An earlier version split each search in halves resumed in turn: that paid a second tuner
   start and, warm, a second job start-up that one search does not pay.)
2. Memory, warm against cold: the same configs through the real runners (``SubprocessRunner`` cold,
   ``WarmRunner`` warm, each warm config as the second trial of a job), twice each: the CPU memory
   objective (resident memory above the post-start level) side by side; then the memory cap
   (``ppotune.memory_limit_gb``, RLIMIT_DATA above the start level): the smallest cap the 4x-wider config
   runs under, bisected cold and warm (an OOM far below it and a run far above it agree by construction
   of the bisection's end points, which are checked).
3. Launch: what a job's start costs with and without torchrun's agent. The time from starting 2 ranks to
   both having imported torch and transformers' Qwen2 and formed a gloo process group, through
   ``python -m torch.distributed.run --standalone`` (what ``ppotune train`` ran before) and through
   :class:`trainer.launch.ranks.RankGroup` (what it runs now), ``--launch-rounds`` times each, interleaved.

    python benchmarks/bench_overhead.py [--trials 12] [--seed 0] [--rounds 2] [--json FILE]
                                       [--only overhead|memory|launch] [--launch-rounds 6]
                                       [--grid-preset]

``--grid-preset`` runs part 1 on the recorded grid's base and space instead of the demo's: the same tiny
architecture at 128 wide with longer sequences, whose steps last longer than the demo's fraction of a second.

Run it alone on the machine (it measures wall time): ``flock /tmp/ppotune-heavy.lock python ...``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from trainer.config import config_to_dict, load_config  # noqa: E402
from trainer.contracts import Status  # noqa: E402
from tuner.trials.runners import SubprocessRunner, TrialRequest  # noqa: E402
from tuner.trials.warm import WarmRunner  # noqa: E402

BASE = REPO / "configs" / "tiny_cpu.yaml"
SPACE = REPO / "search_spaces" / "tiny_cpu.yaml"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
DYN, BUDGET = "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
# the configs whose memory is compared: the base, the micro-batch extremes, dynamic bsz, and a 4x wider model
# (whose knob-dependent memory dwarfs what a process allocates on first use)
MEMORY_CONFIGS = {
    "base (micro-batch 2)": {},
    "micro-batch 1": {MICRO: 1, "critic.ppo_micro_batch_size_per_gpu": 1},
    "micro-batch 4": {MICRO: 4, "critic.ppo_micro_batch_size_per_gpu": 4},
    "dynamic bsz 384": {DYN: True, BUDGET: 384},
    "hidden 256, micro-batch 4": {"ppotune.tiny.hidden_size": 256, "ppotune.tiny.intermediate_size": 688, MICRO: 4},
}  # fmt: skip
CAP_CONFIG = "hidden 256, micro-batch 4"  # the one whose cap is bisected


# --------------------------------------------------------------------------- 1. the search, cold and warm
def _search(out: Path, trials: int, seed: int, cold: bool, extra: tuple = ()) -> float:
    cmd = [sys.executable, "-m", "tuner.cli", "search", str(BASE), "--space", str(SPACE), "--trials", str(trials)]
    # the trials only: no confirmation re-runs, no worst-case probes after the search
    cmd += ["--seed", str(seed), "--confirm", "0", "--probe", "0", "--out", str(out), *(["--cold"] if cold else [])]
    cmd += list(extra)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"search failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return wall


def _measured(out: Path) -> dict:
    """Where a search's seconds went, from its trials' records and result files: the measured steps, the
    warm-up steps, the rest of the trials' own seconds (process start, imports, model build, hand-over)."""
    import optuna

    from trainer.contracts import TrialRecord

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    got = {"measured_s": 0.0, "warmup_s": 0.0, "trial_s": 0.0, "launched": 0, "warm": 0, "jobs": 0}
    for t in study.get_trials(deepcopy=False):
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if rec.status is None or not rec.status.launched:
            continue
        got["launched"] += 1
        got["trial_s"] += float(rec.duration_s or 0.0)
        note = next((n for n in rec.notes if n.startswith("warm:")), "")
        got["warm"] += bool(note)
        got["jobs"] += note.startswith("warm: trial 1 of job")
        if rec.result_path and Path(rec.result_path).is_file():
            for s in json.loads(Path(rec.result_path).read_text()).get("steps", []):
                got["warmup_s" if s["warmup"] else "measured_s"] += s["timing_s/step"]
    return got


def overhead(trials: int, seed: int, root: Path, extra: tuple = (), rounds: int = 2) -> dict:
    """Each round runs the whole search cold and warm, in alternating order (cold first in even rounds), each
    search in a fresh directory; the figures of each kind are the medians over the rounds."""
    per_round: dict[str, list[dict]] = {"cold": [], "warm": []}
    for r in range(rounds):
        for kind in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
            out = root / f"{kind}-{r}"
            w = _search(out, trials, seed, cold=kind == "cold", extra=extra)
            m = _measured(out)
            m["wall_s"] = w
            m["unmeasured_share"] = 1.0 - m["measured_s"] / w
            per_round[kind].append(m)
            print(f"  round {r + 1}: {kind:4s} search of {trials} trials: {w:6.1f} s, unmeasured "
                  f"{m['unmeasured_share']:.1%}", flush=True)  # fmt: skip
    rows = {}
    for kind, ms in per_round.items():
        rows[kind] = {key: statistics.median(m[key] for m in ms) for key in ms[0]}
        rows[kind]["rounds"] = ms
    return rows


# --------------------------------------------------------------------------- 2. memory, warm against cold
def _config(overrides: dict, **extra) -> dict:
    flat = {"trainer.total_training_steps": 4, "ppotune.warmup_steps": 1, **overrides, **extra}
    return config_to_dict(load_config(BASE, [f"{k}={json.dumps(v)}" for k, v in flat.items()]))


class _Trials:
    """Real trials through the real runners, numbered in one directory."""

    def __init__(self, root: Path):
        self.root, self.n = root, 0
        cold = SubprocessRunner(device_kind="cpu", nproc=2, grace_s=3.0, startup_timeout_s=300, step_timeout_s=120)
        self.cold, self.warm = cold, WarmRunner(cold=cold, jobs_dir=root / "jobs")

    def run(self, runner, config: dict):
        self.n += 1
        req = TrialRequest(number=self.n, config=config, identity=(self.n,), trial_dir=self.root / str(self.n))
        return runner.run(req, threading.Event())


def memory(root: Path, repeats: int = 2) -> dict:
    t = _Trials(root)
    warmup = _config({})

    def warm(cfg: dict):
        t.run(t.warm, warmup)  # the job's first trial (a fresh job after a fault): the config runs as a later one
        return t.run(t.warm, cfg)

    rows = {}
    for name, ov in MEMORY_CONFIGS.items():
        cold = [t.run(t.cold, _config(ov)).record.peak_memory_gb for _ in range(repeats)]
        hot = [warm(_config(ov)).record.peak_memory_gb for _ in range(repeats)]
        rows[name] = {"cold_gb": cold, "warm_gb": hot}
        ratio = statistics.median(hot) / statistics.median(cold)
        print(
            f"  {name:26s} cold {' '.join(f'{1024 * g:6.1f}' for g in cold)} MiB   "
            f"warm {' '.join(f'{1024 * g:6.1f}' for g in hot)} MiB   warm/cold (medians) {ratio:.3f}",
            flush=True,
        )
    # the memory cap: the smallest cap (on a grid) the config runs under, cold and warm; far from it both agree
    peak = statistics.median(rows[CAP_CONFIG]["cold_gb"])
    caps: dict = {}

    def ok(kind: str, cap: float) -> bool:
        cfg = _config(MEMORY_CONFIGS[CAP_CONFIG], **{"ppotune.memory_limit_gb": round(cap, 4)})
        status = (t.run(t.cold, cfg) if kind == "cold" else warm(cfg)).status
        caps.setdefault(round(cap, 4), {})[kind] = str(status)
        return status == Status.OK

    bounds = {}
    for kind in ("cold", "warm"):
        lo, hi = 0.3 * peak, 1.5 * peak  # OOM at lo, ok at hi: checked, then bisected
        if ok(kind, lo) or not ok(kind, hi):
            bounds[kind] = None
            continue
        for _ in range(4):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if ok(kind, mid) else (mid, hi)
        bounds[kind] = (lo, hi)
        print(f"  {CAP_CONFIG}: {kind} runs from a cap of {1024 * hi:.1f} MiB, OOMs at {1024 * lo:.1f} MiB", flush=True)
    if bounds.get("cold") and bounds.get("warm"):
        print(f"  the cap it needs, warm/cold: {bounds['warm'][1] / bounds['cold'][1]:.3f}", flush=True)
    t.warm.close()
    return {"peaks": rows, "caps": caps, "bounds": bounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="part 1: whole searches of each kind, alternating")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--only", choices=["overhead", "memory", "launch"], default=None, help="run one part")
    ap.add_argument("--launch-rounds", type=int, default=6, help="part 3: starts of each kind, interleaved")
    ap.add_argument(
        "--grid-preset",
        action="store_true",
        help="part 1 on the recorded grid's base and space (benchmarks/data/grid_*.yaml: a 128-wide model, longer "
        "sequences, 1 process, its 0.15 GB cap), whose steps are longer than the demo's",
    )
    args = ap.parse_args()
    if args.grid_preset:
        global BASE, SPACE
        BASE, SPACE = REPO / "benchmarks" / "data" / "grid_base.yaml", REPO / "benchmarks" / "data" / "grid_space.yaml"
    when = datetime.datetime.now().isoformat(timespec="minutes")
    print(f"bench_overhead: {when} | {platform.node()} | {platform.processor() or platform.machine()} | "
          f"{_cpus()} CPUs | {args.trials} trials, seed {args.seed}", flush=True)  # fmt: skip
    out: dict = {"date": when, "host": platform.node(), "trials": args.trials, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        root = Path(tmp)
        if args.only in (None, "overhead"):
            _print_overhead(out, args, root)
        if args.only in (None, "memory"):
            print("2. memory objective and cap, warm against cold (each warm config is a job's second trial)")
            out["memory"] = memory(root / "memory")
        if args.only in (None, "launch"):
            out["launch"] = _print_launch(args.launch_rounds, root / "launch")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


def _print_overhead(out: dict, args: argparse.Namespace, root: Path) -> None:
    print(f"1. the search, cold and warm ({args.rounds} rounds, alternating order; medians)", flush=True)
    extra = ("--nproc", "1", "--memory-limit-gb", "0.15") if args.grid_preset else ()
    print(f"   base {BASE.relative_to(REPO)}, space {SPACE.relative_to(REPO)}", flush=True)
    rows = out["overhead"] = overhead(args.trials, args.seed, root / "search", extra, rounds=args.rounds)
    print(
        f"\n  {'':5s} {'wall s':>7s} {'measured':>9s} {'warm-up':>8s} {'in trials':>10s} {'outside':>8s}"
        f"  {'unmeasured':>10s}  trials"
    )
    for kind, m in rows.items():
        rest = m["trial_s"] - m["measured_s"] - m["warmup_s"]  # start-up, build, hand-over, teardown
        print(
            f"  {kind:5s} {m['wall_s']:7.1f} {m['measured_s']:9.1f} {m['warmup_s']:8.1f} {rest:10.1f} "
            f"{m['wall_s'] - m['trial_s']:8.1f}  {m['unmeasured_share']:10.1%}  {m['launched']:.0f} "
            f"({m['warm']:.0f} warm, {m['jobs']:.0f} jobs started)"
        )
    print("  (seconds; in trials: the trials' own seconds less their steps; outside: the tuner between them)")
    c, w = rows["cold"], rows["warm"]
    print(
        f"  warm/cold: wall {w['wall_s'] / c['wall_s']:.2f}x, unmeasured share {w['unmeasured_share']:.1%} "
        f"vs {c['unmeasured_share']:.1%} (goal: <= 20% warm)\n",
        flush=True,
    )


# a rank of part 3: what every rank of a trial does before its model: the imports and the process group
_LAUNCH_RANK = """
import os, time
import torch, torch.distributed as dist
from transformers import Qwen2ForCausalLM
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print("ready", time.time() - float(os.environ["BENCH_T0"]), flush=True)
dist.destroy_process_group()
"""


def _start_ranks(kind: str, env: dict) -> float:
    """Seconds from the start to both ranks ready (imports done, process group formed), ``kind`` torchrun|direct."""
    from trainer.launch.ranks import RankGroup

    env = {**env, "BENCH_T0": repr(time.time())}
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "bench_rank"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    else:
        group = RankGroup(["bench_rank"], nproc=2, env=env)
        out = group.stdout.read()
        assert group.wait() == 0, out
    return float(out.split("ready", 1)[1].split()[0])


def _print_launch(rounds: int, root: Path) -> dict:
    import os

    print(f"3. launch: 2 ranks to imports done and gloo group formed, torchrun's agent vs direct ({rounds} rounds)")
    root.mkdir(parents=True)
    (root / "bench_rank.py").write_text(_LAUNCH_RANK)
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    got: dict[str, list[float]] = {"torchrun": [], "direct": []}
    for i in range(rounds):
        for kind in ("torchrun", "direct") if i % 2 == 0 else ("direct", "torchrun"):
            got[kind].append(_start_ranks(kind, env))
    med = {k: statistics.median(v) for k, v in got.items()}
    for k, v in got.items():
        print(f"  {k:8s} median {med[k]:.2f} s  ({', '.join(f'{x:.2f}' for x in v)})")
    saved = med["torchrun"] - med["direct"]
    print(f"  direct/torchrun {med['direct'] / med['torchrun']:.2f}x, {saved:.2f} s saved per start\n")
    return {"seconds": got, "median_s": med}


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
