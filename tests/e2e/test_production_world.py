"""Tuning on 2 processes for a 4-process job (issue 12.4), with REAL trials on CPU (gloo): the trials run the
production's per-GPU batch, and the memory model's projection of the sharded state from 2 ranks to 4 matches
a real 4-process run of the same config within the model's stated error. Nothing stands in for a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from support import REPO
from trainer.config import flatten
from trainer.contracts import TrialRecord

pytestmark = pytest.mark.slow  # a 6-trial search and a 4-process run

# The tiny preset, 256 wide and 4 layers: ~3.3 M parameters, so the sharded state (fp32 params + grads +
# Adam for actor and critic, fp32 ref: ~36 B/param, ~115 MB in all) is large next to the RSS noise, and
# halves from 2 ranks to 4. The production job: 1 node x 4 GPUs, 16 prompts per step (4 per GPU, one mini-batch).
BASE = {
    "data": {"train_batch_size": 16, "max_prompt_length": 48, "max_response_length": 24},
    "actor_rollout_ref": {
        "model": {"path": "tiny", "use_remove_padding": True},
        "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 1, "use_torch_compile": False,
                  "fsdp_config": {"mixed_precision": {"param_dtype": "fp32"}}},
        "ref": {"log_prob_micro_batch_size_per_gpu": 2, "fsdp_config": {"mixed_precision": {"param_dtype": "fp32"}}},
        "rollout": {"name": "hf", "n": 1, "log_prob_micro_batch_size_per_gpu": 2},
    },
    "critic": {"ppo_micro_batch_size_per_gpu": 1, "fsdp": {"mixed_precision": {"param_dtype": "fp32"}}},
    "trainer": {"n_gpus_per_node": 4, "nnodes": 1, "total_training_steps": 3},
    "ppotune": {"device": "cpu", "warmup_steps": 1,
                "tiny": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                         "num_attention_heads": 8, "num_key_value_heads": 2}},
}  # fmt: skip
SPACE = {
    "description": "per-GPU micro-batches and checkpointing",
    "knobs": {
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": {
            "type": "pow2", "low": 1, "high": 4, "memory": "increasing",
        },
        "actor_rollout_ref.model.enable_gradient_checkpointing": {"type": "bool", "memory": "decreasing"},
    },
    "derived": {"critic.ppo_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"},
}  # fmt: skip


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tuner.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_two_process_trials_keep_the_per_gpu_batch_and_project_to_four(tmp_path):
    from tuner.memory_model import MemoryModel, samples_from_trials

    base, space = tmp_path / "base.yaml", tmp_path / "space.yaml"
    base.write_text(yaml.safe_dump(BASE))
    space.write_text(yaml.safe_dump(SPACE))
    out = tmp_path / "search"
    # 1. the search: 2 processes per trial for the base config's 1 x 4 job (the default target)
    r = _cli(
        "search", str(base), "--space", str(space), "--nproc", "2", "--trials", "6", "--sampler", "grid",
        "--steps", "3", "--precision", "0", "--confirm", "0", "--probe", "0", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "trials run 2 GPUs for a 1 x 4 = 4-GPU job" in r.stdout
    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    assert study.user_attrs["target"]["world"] == 4 and study.user_attrs["target"]["trial_world"] == 2
    trials = [t for t in study.get_trials() if TrialRecord.from_user_attrs(t.user_attrs).status == "ok"]
    assert len(trials) == 6  # 3 micro-batch sizes x checkpointing: enough for the model to state its error
    for t in trials:  # every trial ran the production's per-GPU batch on its 2 ranks
        res = json.loads(Path(TrialRecord.from_user_attrs(t.user_attrs).result_path).read_text())
        assert res["per_gpu"] == {"world_size": 2, "sequences": 4, "actor_mini_batch_sequences": 4}
        assert res["config"]["data"]["train_batch_size"] == 8  # 16 x 2/4

    # 2. the production run itself: the base config on 4 real processes (its global sizes)
    result = tmp_path / "four.json"
    r = _cli("train", str(base), "--nproc", "4", "--result", str(result))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    four = json.loads(result.read_text())
    assert four["per_gpu"] == {"world_size": 4, "sequences": 4, "actor_mini_batch_sequences": 4}

    # 3. the baseline measured on 2 ranks, projected to 4 by the model fitted on the study's trials
    model = MemoryModel.calibrate(samples_from_trials(study.get_trials(), study.user_attrs["base_config"]))
    baseline = next(t for t in trials if TrialRecord.from_user_attrs(t.user_attrs).baseline)
    rec = TrialRecord.from_user_attrs(baseline.user_attrs)
    config = {**flatten(study.user_attrs["base_config"]), **(rec.overrides or {})}
    at_two, at_four = model.predict(config), model.predict(config, world=4)
    assert at_two.world == 2 and at_four.world == 4
    state_two, state_four = max(at_two.state_gb.values()), max(at_four.state_gb.values())
    assert state_four < 0.6 * state_two  # the sharded state halves (the unsharded units do not)
    projected = rec.peak_memory_gb + (at_four.peak_gb - at_two.peak_gb)
    measured = four["summary"]["peak_memory_gb"]
    error = model.gate_error
    assert error is not None
    print(
        f"2 ranks measured {rec.peak_memory_gb:.4f} GB; projected to 4: {projected:.4f} GB; 4 ranks measured "
        f"{measured:.4f} GB; model error {error:.1%}; state {state_two:.4f} -> {state_four:.4f} GB"
    )
    assert abs(projected - measured) <= error * measured + 0.005  # + 5 MB: the RSS floor's own jitter
    # Not asserted: that the projection beats the unprojected 2-rank figure. On a CPU the two are about as far
    # from the 4-rank figure, and one run's RSS noise decides which is nearer (benchmarks/README.md,
    # "Figures behind the code's comments").
