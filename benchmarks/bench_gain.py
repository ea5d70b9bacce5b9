"""P2, the gain: is the config ppotune picks really faster than the base config, and than the
configuration verl's performance guide recommends?

1. Runs ``ppotune search`` on the embedded demo (``configs/tiny_cpu.yaml``, ``search_spaces/tiny_cpu.yaml``,
   finalists confirmed against the baseline as by default) and ``ppotune export``.
2. Runs three configs side by side, interleaved (best, base, verl guide; the order rotates every
   round), ``--rounds`` times each for ``--steps`` PPO steps (every step measured after one warm-up;
   real ``ppotune train`` runs on 2 CPU processes):
   * best: the exported ``best_config.yaml``;
   * base: ``configs/tiny_cpu.yaml`` as written;
   * verl guide: the base with verl's performance-guide starting point: dynamic batch size with
     ``actor.ppo_max_token_len_per_gpu`` = 3 x (max_prompt_length + max_response_length), twice that for
     the forward-only passes and the critic, remove-padding, gradient checkpointing.
3. Prints the median of the paired ratios (each round's best / that round's base, and best / verl
   guide) with its 90% interval, and each config's median throughput and peak memory.

    python benchmarks/bench_gain.py [--out bench_out/gain] [--trials 12] [--rounds 5] [--steps 21]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from trainer.summary import interval  # noqa: E402
from tuner.rules.finalists import log_interval  # noqa: E402

BASE = REPO / "configs" / "tiny_cpu.yaml"
SPACE = REPO / "search_spaces" / "tiny_cpu.yaml"
NPROC = 2


def verl_guide_overrides(base: dict) -> list[str]:
    """verl's performance guide (docs/perf/perf_tuning.rst): dynamic bsz with the actor's token budget at
    2-3x (prompt + response), forward-only passes and the critic at twice the actor's, remove-padding on;
    gradient checkpointing on."""
    seq = base["data"]["max_prompt_length"] + base["data"]["max_response_length"]
    actor = 3 * seq
    return [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={actor}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={2 * actor}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={2 * actor}",
        f"critic.ppo_max_token_len_per_gpu={2 * actor}",
        f"critic.forward_max_token_len_per_gpu={2 * actor}",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "critic.model.enable_gradient_checkpointing=true",
    ]


def cli(*args: str, out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "tuner.cli", *args], cwd=REPO, check=True, stdout=out.open("a"), stderr=subprocess.STDOUT
    )


def train(config: Path, overrides: list[str], *, steps: int, result: Path, log: Path) -> dict:
    cli("train", str(config), *overrides, "--nproc", str(NPROC), "--steps", str(steps), "--warmup", "1",
        "--result", str(result), out=log)  # fmt: skip
    return json.loads(result.read_text())["summary"]


def fmt_ratio(xs: list[float]) -> str:
    """The median of paired ratios and its 90% interval, as the search's confirmation computes them."""
    mid, ci = log_interval(xs)
    return f"{mid:.2f}x (90% interval {ci[0]:.2f}-{ci[1]:.2f}, {len(xs)} rounds)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/gain")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=21, help="PPO steps per run, the first one warm-up")
    ap.add_argument("--reuse", action="store_true", help="keep the search already in --out")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "bench.log"
    t0 = time.monotonic()
    if not (args.reuse and (out / "best_config.yaml").exists()):
        cli("search", str(BASE), "--space", str(SPACE), "--trials", str(args.trials), "--seed", "0",
            "--nproc", str(NPROC), "--out", str(out), out=log)  # fmt: skip
        cli("export", "--out", str(out), out=log)
    search_s = time.monotonic() - t0
    base = yaml.safe_load(BASE.read_text())
    configs = {
        "best": (out / "best_config.yaml", []),
        "base": (BASE, []),
        "verl guide": (BASE, verl_guide_overrides(base)),
    }
    names = list(configs)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no config always runs first
        for name in order:
            config, overrides = configs[name]
            runs[name].append(
                train(config, overrides, steps=args.steps, result=out / f"r{r}-{name.replace(' ', '_')}.json", log=log)
            )
            print(f"round {r + 1}/{args.rounds} {name:10s} {runs[name][-1]['throughput']:8.1f} tok/s/GPU", flush=True)
    thr = {n: [s["throughput"] for s in runs[n]] for n in names}
    print(f"\nP2 gain on the CPU demo ({NPROC} processes, {args.steps - 1} measured steps per run, "
          f"{args.rounds} interleaved rounds; search + export {search_s:.0f} s)")  # fmt: skip
    print(f"{'config':12s} {'median tok/s/GPU':>17s} {'90% interval':>20s} {'peak GB':>8s}")
    for n in names:
        ci = interval(thr[n])
        peak = max(s["peak_memory_gb"] for s in runs[n])
        print(f"{n:12s} {statistics.median(thr[n]):17.1f} {ci[0]:9.1f}-{ci[1]:<10.1f} {peak:8.3f}")
    print("best / base:       " + fmt_ratio([b / a for b, a in zip(thr["best"], thr["base"])]))
    print("best / verl guide: " + fmt_ratio([b / a for b, a in zip(thr["best"], thr["verl guide"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
