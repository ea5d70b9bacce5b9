"""Remove-padding and dynamic batch size, alone and together, against the best padded fixed micro-batch.

Same skewed-length synthetic data, same global batch, same algorithm; only the per-GPU knobs
differ. The baseline (a) is the fastest padded fixed micro-batch that runs (a pre-pass tries
1, 2, 4, 8), what a user tuning by hand would keep; (b) adds remove-padding, (c) dynamic bsz
alone, (d) both, at the token budget a second pre-pass finds fastest (640, 1280, 2560). Each
configuration runs as a real `ppotune train` (2 processes, gloo); the configs are interleaved run
by run so machine noise hits all alike. Prints tokens/s/GPU (median of the
measured steps of each run, then the median over runs) and each ratio to (a).

    python benchmarks/bench_dynamic_bsz.py [--runs 3] [--steps 4] [--nproc 2]
"""

import argparse
import statistics
import subprocess

from demo_train import train_summary

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
PADDED = [
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.model.use_remove_padding=false",
    "critic.model.use_remove_padding=false",
]
PACKED = [
    "actor_rollout_ref.model.use_remove_padding=true",
    "critic.model.use_remove_padding=true",
]
#: the padded fixed micro-batches the baseline is chosen from (the per-GPU mini-batch is 16 x 1 / 2 = 8)
MICRO_CHOICES = (1, 2, 4, 8)
#: the per-GPU token budgets dynamic bsz is given (one sequence is at most 96 + 64 = 160 tokens)
BUDGET_CHOICES = (640, 1280, 2560)


def dynamic(budget: int) -> list[str]:
    """Dynamic bsz with a per-GPU token budget (the log-prob and value passes follow the actor's)."""
    return [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        f"critic.ppo_max_token_len_per_gpu={budget}",
    ]


def micro(n: int) -> list[str]:
    """Every fixed micro-batch of the step at ``n`` sequences per GPU."""
    return [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={n}",
        f"critic.ppo_micro_batch_size_per_gpu={n}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={n}",
    ]


def configs(best_micro: int, best_budget: int) -> dict:
    """(a) the best padded fixed micro-batch, then remove-padding and dynamic bsz alone and together."""
    return {
        f"(a) padded, fixed micro-batch {best_micro} (the best padded)": PADDED + micro(best_micro),
        f"(b) remove padding, fixed micro-batch {best_micro}": [*PADDED[:1], *PACKED, *micro(best_micro)],
        f"(c) dynamic bsz {best_budget} tokens, padded": [*PADDED[1:], *dynamic(best_budget)],
        f"(d) dynamic bsz {best_budget} tokens + remove padding": PACKED + dynamic(best_budget),
    }


def fastest(candidates: dict, steps: int, nproc: int) -> object:
    """The key of the fastest candidate config (one run each); a config that fails is no candidate."""
    got = {}
    for key, overrides in candidates.items():
        try:
            got[key] = run_once(overrides, steps, nproc)[0]
        except subprocess.CalledProcessError:
            got[key] = None
        print(f"pre-pass {key}: " + (f"{got[key]:.1f} tokens/s/GPU" if got[key] else "did not run"), flush=True)
    return max((k for k in got if got[k]), key=lambda k: got[k])


def run_once(overrides: list[str], steps: int, nproc: int) -> tuple[float, float]:
    """(tokens/s/GPU, seconds of the phases the knobs change): the update phases and the forward passes;
    generation is identical in every configuration."""
    s = train_summary([*COMMON, *overrides], steps=steps, nproc=nproc)
    t = s["timing_s"]
    return s["throughput"], t["update_actor"] + t["update_critic"] + t["old_log_prob"] + t["ref"] + t["values"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    # each side at its own best: the padded fixed micro-batch a user tuning by hand would keep, and the
    # token budget that suits dynamic bsz (one run each)
    best_micro = fastest({m: PADDED + micro(m) for m in MICRO_CHOICES}, args.steps, args.nproc)
    best_budget = fastest({b: PACKED + dynamic(b) for b in BUDGET_CHOICES}, args.steps, args.nproc)
    cfgs = configs(best_micro, best_budget)
    thr = {k: [] for k in cfgs}
    train_s = {k: [] for k in cfgs}
    for i in range(args.runs):
        for name, overrides in cfgs.items():
            t, s = run_once(overrides, args.steps, args.nproc)
            thr[name].append(t)
            train_s[name].append(s)
            print(f"run {i + 1}: {name}: {t:.1f} tokens/s/GPU, forward+update phases {s:.2f} s", flush=True)
    print()
    base = next(iter(cfgs))
    a, sa = statistics.median(thr[base]), statistics.median(train_s[base])
    for name in cfgs:
        t, s = statistics.median(thr[name]), statistics.median(train_s[name])
        print(
            f"{name}: median {t:.1f} tokens/s/GPU over {args.runs} runs; vs (a): whole step {t / a:.2f}x, "
            f"phases the knobs change (log-probs, values, updates) {sa / s:.2f}x"
        )


if __name__ == "__main__":
    main()
