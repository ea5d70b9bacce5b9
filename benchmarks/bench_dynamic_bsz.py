"""Fixed micro-batches with padding vs dynamic batch size with remove-padding, side by side.

Same skewed-length synthetic data, same global batch, same algorithm; only the per-GPU knobs
differ. Each configuration runs as a real `ppotune train` (2 processes, gloo); the configs are
interleaved run by run so machine noise hits both alike. Prints tokens/s/GPU (median of the
measured steps of each run, then the median over runs) and the ratio (b)/(a).

    python benchmarks/bench_dynamic_bsz.py [--runs 3] [--steps 4] [--nproc 2]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Longer responses and a heavier prompt tail than the demo, so padding is a real share of the work.
COMMON = [
    "data.max_prompt_length=96",
    "data.max_response_length=64",
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "ppotune.synthetic.length_alpha=0.8",
    "ppotune.synthetic.max_terms=24",
    "ppotune.tiny.hidden_size=128",
    "ppotune.tiny.intermediate_size=512",
]
CONFIGS = {
    "(a) fixed micro-batch 2, padded": [
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.model.use_remove_padding=false",
        "critic.model.use_remove_padding=false",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    ],
    "(b) dynamic bsz 640 tokens, remove padding": [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.model.use_remove_padding=true",
        "critic.model.use_remove_padding=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=640",
        "critic.ppo_max_token_len_per_gpu=640",
    ],
}


def run_once(overrides: list[str], steps: int, nproc: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "r.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tuner.cli",
                "train",
                str(ROOT / "configs" / "tiny_cpu.yaml"),
                *COMMON,
                *overrides,
                "--nproc",
                str(nproc),
                "--steps",
                str(steps),
                "--warmup",
                "1",
                "--result",
                str(result),
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        r = json.loads(result.read_text())
        # the update phases are what the knobs change; generation is identical in both
        s = r["summary"]
        return s["throughput"], s["timing_s"]["update_actor"] + s["timing_s"]["update_critic"] + s["timing_s"][
            "old_log_prob"
        ] + s["timing_s"]["ref"] + s["timing_s"]["values"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    thr = {k: [] for k in CONFIGS}
    train_s = {k: [] for k in CONFIGS}
    for i in range(args.runs):
        for name, overrides in CONFIGS.items():
            t, s = run_once(overrides, args.steps, args.nproc)
            thr[name].append(t)
            train_s[name].append(s)
            print(f"run {i + 1}: {name}: {t:.1f} tokens/s/GPU, forward+update phases {s:.2f} s", flush=True)
    a, b = (statistics.median(thr[k]) for k in CONFIGS)
    sa, sb = (statistics.median(train_s[k]) for k in CONFIGS)
    print()
    for name in CONFIGS:
        print(f"{name}: median {statistics.median(thr[name]):.1f} tokens/s/GPU over {args.runs} runs")
    print(f"throughput ratio (b)/(a): {b / a:.2f}x   (whole PPO step, generation included)")
    print(f"time of the phases the knobs change (log-probs, values, updates) (a)/(b): {sa / sb:.2f}x")


if __name__ == "__main__":
    main()
