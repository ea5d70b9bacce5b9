"""Per-GPU knobs must not change training: one PPO update of actor and critic from the same
weights and batch gives the same parameters under every knob setting (fp32, gloo, real FSDP)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "invariance_worker.py"
TOL = 1e-5  # per-tensor relative difference ||a - b|| / ||b||

VARIANTS_2 = {
    "base": {},
    "micro_batch_1": {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1, "critic.ppo_micro_batch_size_per_gpu": 1},
    "micro_batch_4": {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4, "critic.ppo_micro_batch_size_per_gpu": 4},
    "dynamic_bsz_96": {"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 96,
                       "critic.ppo_max_token_len_per_gpu": 96},
    "dynamic_bsz_300": {"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 300,
                        "critic.ppo_max_token_len_per_gpu": 300},
    "gradient_checkpointing": {"actor_rollout_ref.model.enable_gradient_checkpointing": True,
                               "critic.model.enable_gradient_checkpointing": True},
    "padded": {"actor_rollout_ref.model.use_remove_padding": False, "critic.model.use_remove_padding": False},
    "fsdp2": {"actor_rollout_ref.actor.strategy": "fsdp2"},
}


def run_variants(nproc: int, out: Path, variants: dict, env: dict | None = None) -> dict:
    """torchrun the worker over ``variants``; -> {variant: saved parameters and stats}."""
    spec = out / f"variants{nproc}.json"
    spec.write_text(json.dumps(variants))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(WORKER), str(out), str(spec)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: torch.load(out / f"{name}.pt") for name in variants}


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    out = tmp_path_factory.mktemp("invariance")
    return {**run_variants(2, out, VARIANTS_2), **run_variants(1, out, {"one_process": {}})}


# Softmax is shift-invariant, so the exact gradient of a key-projection bias is zero: what the
# backward gives is rounding noise, which Adam normalizes into a full-size step of random sign.
# Those tensors carry no signal about the knobs and are left out.
_ZERO_GRADIENT = ("self_attn.k_proj.bias",)


def max_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k, v in b.items():
        if k.endswith(_ZERO_GRADIENT):
            continue
        rel = ((a[k] - v).norm() / v.norm().clamp(min=1e-12)).item()
        if rel > worst:
            worst, where = rel, k
    return worst, where


def test_update_moves_parameters_far_beyond_the_tolerance(updated):
    moved, _ = max_rel_diff(updated["base"]["init_actor"], updated["base"]["actor"])
    assert moved > 100 * TOL, "the update is too small for the invariance check to mean anything"


@pytest.mark.parametrize("variant", [v for v in VARIANTS_2 if v != "base"] + ["one_process"])
def test_same_parameters_under_every_knob(updated, variant):
    for part in ("actor", "critic"):
        rel, key = max_rel_diff(updated[variant][part], updated["base"][part])
        assert rel <= TOL, f"{variant}: {part}.{key} differs by {rel:.2e} (relative)"
    for k, v in updated["base"]["stats"].items():
        assert updated[variant]["stats"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
