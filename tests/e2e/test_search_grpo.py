"""``ppotune search`` of a GRPO job with ppotune's engine, end to end on CPU: real trials (2 gloo processes, 2 steps)
of a critic-free estimator with the KL as a loss. No critic is built (its phases take no time), the space's critic
knob is not searched, the reference model runs for the KL loss, and the report is written."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml

from trainer.config import apply_overrides, read_yaml_mapping
from trainer.contracts import Status, TrialRecord

pytestmark = pytest.mark.slow
VERL_PY = Path(__file__).resolve().parents[2] / ".venv-verl" / "bin" / "python"

GRPO = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "data.train_batch_size": 4,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
}


def test_grpo_search_runs_end_to_end_without_a_critic(tmp_path, cli):
    base = tmp_path / "grpo_cpu.yaml"
    base.write_text(yaml.safe_dump(apply_overrides(read_yaml_mapping("configs/tiny_cpu.yaml"), GRPO)))
    out = tmp_path / "out"
    args = ["--trials", 3, "--confirm", 0, "--probe", 0, "--nproc", 2, "--steps", 2, "--warmup", 1]
    r = cli("search", base, "--space", "search_spaces/tiny_cpu.yaml", *args, "--out", out, "--report", timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    storage = f"sqlite:///{out / 'study.db'}"
    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    assert study.user_attrs["base_config"]["algorithm"]["adv_estimator"] == "grpo"
    records = [TrialRecord.from_user_attrs(t.user_attrs) for t in study.trials]
    ok = [rec for rec in records if rec.status == Status.OK]
    assert len(ok) >= 2 and records[0].baseline, [(rec.status, rec.error) for rec in records]
    for t in study.trials:
        assert not any(key.endswith("critic.ppo_micro_batch_size_per_gpu") for key in t.params), t.params
    for rec in ok:
        assert rec.timing_s["values"] == 0 and rec.timing_s["update_critic"] == 0  # no critic built
        assert rec.timing_s["ref"] > 0 and rec.timing_s["update_actor"] > 0  # the KL loss reads the reference
    assert (out / "report" / "summary.md").is_file()
    # the export (the tuned knobs, appended to the user's own verl command) composes with verl's config (Hydra in
    # verl's venv) on top of the GRPO job's keys, and touches no critic key
    r = cli("export", "--storage", out, "--out", tmp_path / "exp")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = (tmp_path / "exp" / "verl_overrides.txt").read_text().splitlines()
    assert not any(line.startswith("critic.") for line in lines), lines  # empty when the baseline wins
    if not VERL_PY.is_file():
        pytest.skip("verl venv not installed (.venv-verl): the export's composition with verl is not checked")
    from trainer.verl_engine import adapter
    from trainer.verl_engine.overrides import verl_overrides

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"overrides": verl_overrides(GRPO) + lines}))
    composed = adapter.compose_verl(adapter.load_run(run, python=str(VERL_PY)))
    assert composed["algorithm"]["adv_estimator"] == "grpo" and composed["critic"]["enable"] is None
    for line in lines:
        key, value = line.lstrip("+").split("=", 1)
        node = composed
        for part in key.split("."):
            node = node[part]
        assert str(node).lower() == value.lower(), line
