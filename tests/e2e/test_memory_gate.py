"""The search's memory-model gate (issue 12.2) on REAL trials: ``tuner.loop.Search`` with the real warm runner on
the recorded grid's preset (a 128-wide tiny model, 1 CPU process, a real 0.15 GB cap: RLIMIT_DATA above the
post-start level). Ten configs are measured first (micro-batch 1..16 x gradient checkpointing), which calibrates
the model; then a candidate the model puts far over the cap is recorded ``predicted_oom`` and never launched,
and one within the model's error of the cap is launched, so the boundary is measured, not guessed."""

from __future__ import annotations

import json

import optuna
import pytest
import yaml

from support import REPO
from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import DIRECTIONS, Status, TrialRecord
from tuner import study as st
from tuner.loop import MEMORY_MODEL_ATTR, Search, SearchOptions
from tuner.runners import SubprocessRunner
from tuner.space import base_flat_config, space_from_dict
from tuner.warm import WarmRunner

pytestmark = pytest.mark.slow

BASE = REPO / "benchmarks" / "data" / "grid_base.yaml"
CAP_GB = 0.15
MICRO, CKPT = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
)
SPACE = {
    "knobs": {
        MICRO: {"type": "pow2", "low": 1, "high": 32, "memory": "increasing"},
        CKPT: {"type": "bool", "memory": "decreasing"},
    },
    "derived": {"critic.ppo_micro_batch_size_per_gpu": MICRO, "critic.model.enable_gradient_checkpointing": CKPT},
}
# measured first (the calibration), then the two judged against the cap: 32 without checkpointing (its
# activations are ~4x the cap's worth: far over), 32 with checkpointing (near the cap). The far one is asked
# first: were the near one to run first and OOM, the far one would be an inferred OOM instead.
ORDER = [(mb, ck) for mb in (1, 2, 4, 8, 16) for ck in (False, True)] + [(32, False), (32, True)]


def test_far_over_the_cap_is_never_launched_and_near_it_is(tmp_path):
    space = space_from_dict(SPACE, source="space.yaml")
    nested, _ = base_flat_config(str(BASE), nproc=1)
    extra = {"trainer.total_training_steps": 3, "ppotune.warmup_steps": 1, "ppotune.memory_limit_gb": CAP_GB}
    trial_base = config_to_dict(config_from_dict(apply_overrides(nested, extra)))
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS), study_name="gate")
    study.set_user_attr("base_config", trial_base)
    for mb, ck in ORDER:
        study.enqueue_trial(space.to_params({MICRO: mb, CKPT: ck}))
    cold = SubprocessRunner(device_kind="cpu", nproc=1, grace_s=3.0, startup_timeout_s=300, step_timeout_s=120)
    runner = WarmRunner(cold=cold, jobs_dir=tmp_path / "jobs")
    search = Search(
        options=SearchOptions(trials=11, sampler="random", seed=0),  # the 10 measured + the near one
        study=study,
        storage=storage,
        lock=st.StudyLock(None),
        space=space,
        trial_base=trial_base,
        trial_flat=flatten(trial_base),
        runner=runner,
        penalty_gb=CAP_GB,
        trials_dir=tmp_path / "trials",
    )
    try:
        search.run()
    finally:
        runner.close()
    recs = {}
    for t in study.get_trials():
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        recs[(rec.overrides or {}).get(MICRO), (rec.overrides or {}).get(CKPT)] = (t, rec)
    print(json.dumps({f"{k}": (str(r.status), r.peak_memory_gb, r.predicted) for k, (_, r) in recs.items()}, indent=1))
    assert study.user_attrs.get(MEMORY_MODEL_ATTR), "the search stored its calibrated model"
    far_t, far = recs[(32, False)]
    assert far.status == Status.PREDICTED_OOM and far.duration_s == 0.0 and far.result_path is None
    assert far.predicted["peak_gb"] / (1 + far.predicted["error"]) > CAP_GB  # over by more than the error
    assert far_t.state == optuna.trial.TrialState.COMPLETE and far.constraint > 1.0  # told: infeasible, graded
    near_t, near = recs[(32, True)]
    assert near.status in (Status.OK, Status.OOM) and near.duration_s > 0  # launched: really measured
    assert near.predicted is not None
    assert (
        near.predicted["peak_gb"] / (1 + near.predicted["error"])
        <= CAP_GB
        < near.predicted["peak_gb"] * (1 + near.predicted["error"])
    )
    print(yaml.safe_dump({"near": near.predicted, "far": far.predicted}))
