"""The invariance check's machinery (shared by test_invariance.py and test_gpu.py): the knob variants,
torchrun of the worker over them, and the parameter comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from support import REPO

ROOT = REPO
WORKER = Path(__file__).resolve().parent / "invariance_worker.py"
TOL = 1e-5  # per-tensor relative difference ||a - b|| / ||b||

VARIANTS_2 = {
    "base": {},
    "micro_batch_1": {
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
        "critic.ppo_micro_batch_size_per_gpu": 1,
    },
    "micro_batch_4": {
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        "critic.ppo_micro_batch_size_per_gpu": 4,
    },
    "dynamic_bsz_96": {
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 96,
        "critic.ppo_max_token_len_per_gpu": 96,
    },
    "dynamic_bsz_300": {
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 300,
        "critic.ppo_max_token_len_per_gpu": 300,
    },
    "gradient_checkpointing": {
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        "critic.model.enable_gradient_checkpointing": True,
    },
    "padded": {"actor_rollout_ref.model.use_remove_padding": False, "critic.model.use_remove_padding": False},
    "fsdp2": {"actor_rollout_ref.actor.strategy": "fsdp2"},
}


def run_variants(nproc: int, out: Path, variants: dict, env: dict | None = None) -> dict:
    """torchrun the worker over ``variants``; -> {variant: saved parameters and stats}."""
    spec = out / f"variants{nproc}.json"
    spec.write_text(json.dumps(variants))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(WORKER),
            str(out),
            str(spec),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: torch.load(out / f"{name}.pt") for name in variants}


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
