"""The search's memory-model gate (issue 12.2) on REAL trials: ``tuner.search.loop.Search`` with the real warm runner on
the grid recording's preset (a 128-wide tiny model, 1 CPU process, a real 0.15 GB cap: RLIMIT_DATA above the
post-start level). Nine configs are measured first (micro-batch 1..8 x gradient checkpointing and micro-batch
16 with it, FSDP1), which calibrates the model; then a candidate it puts far over the cap (micro-batch 32, no
checkpointing) is recorded ``predicted_oom`` and never launched, and one within the model's error of the cap
(micro-batch 16 without checkpointing on FSDP2: its FSDP1 twin peaks just under the cap) is launched, so the boundary
is measured, not guessed."""

from __future__ import annotations

import json

import optuna
import pytest
import yaml

from support import REPO
from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import DIRECTIONS, Status, TrialRecord
from tuner.search.gate import MEMORY_MODEL_ATTR
from tuner.search.loop import Search, SearchOptions
from tuner.search.session import TrialSession
from tuner.space import base_flat_config, space_from_dict
from tuner.study import lifecycle as st
from tuner.trials.runners import SubprocessRunner
from tuner.trials.warm import WarmRunner

pytestmark = pytest.mark.slow

BASE = REPO / "benchmarks" / "data" / "grid_base.yaml"
CAP_GB = 0.15
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
CKPT = "actor_rollout_ref.model.enable_gradient_checkpointing"
STRATEGY = "actor_rollout_ref.actor.strategy"
SPACE = {
    "knobs": {
        MICRO: {"type": "pow2", "low": 1, "high": 32, "memory": "increasing"},
        CKPT: {"type": "bool", "memory": "decreasing"},
        STRATEGY: {"type": "categorical", "choices": ["fsdp", "fsdp2"], "memory": "none"},
    },
    "derived": {
        "critic.ppo_micro_batch_size_per_gpu": MICRO,
        "critic.model.enable_gradient_checkpointing": CKPT,
        "critic.strategy": STRATEGY,
    },
}
# measured first (the calibration), then the far candidate (free: not counted), then the near one (the 10th
# counted trial: the budget, so nothing else is asked). The far one comes before any OOM that could make it an
# inferred OOM instead.
# Micro-batch 16 without checkpointing is left out: it peaks at ~0.14 GB, so close to the cap that it once ran out of
# memory in CI, and that OOM made the far candidate an inferred OOM before the model could judge it.
CALIBRATION = [(mb, ck, "fsdp") for mb in (1, 2, 4, 8) for ck in (False, True)] + [(16, True, "fsdp")]
FAR, NEAR = (32, False, "fsdp"), (16, False, "fsdp2")


def test_far_over_the_cap_is_never_launched_and_near_it_is(tmp_path):
    space = space_from_dict(SPACE, source="space.yaml")
    nested, _ = base_flat_config(str(BASE), nproc=1)
    extra = {"trainer.total_training_steps": 3, "ppotune.warmup_steps": 1, "ppotune.memory_limit_gb": CAP_GB}
    trial_base = config_to_dict(config_from_dict(apply_overrides(nested, extra)))
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS), study_name="gate")
    study.set_user_attr("base_config", trial_base)
    for mb, ck, strategy in [*CALIBRATION, FAR, NEAR]:
        study.enqueue_trial(space.to_params({MICRO: mb, CKPT: ck, STRATEGY: strategy}))
    cold = SubprocessRunner(device_kind="cpu", nproc=1, grace_s=3.0, startup_timeout_s=300, step_timeout_s=120)
    runner = WarmRunner(cold=cold, jobs_dir=tmp_path / "jobs")
    search = Search(
        options=SearchOptions(trials=len(CALIBRATION) + 1, sampler="random", seed=0),  # + the near one
        session=TrialSession(
            study=study,
            storage=storage,
            lock=st.StudyLock(None),
            space=space,
            trial_base=trial_base,
            trial_flat=flatten(trial_base),
            runner=runner,
            penalty_gb=CAP_GB,
            trials_dir=tmp_path / "trials",
        ),
    )
    try:
        search.run()
    finally:
        runner.close()
    recs = {}
    for t in study.get_trials():
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        o = rec.overrides or {}
        recs[(o.get(MICRO), o.get(CKPT), o.get(STRATEGY))] = (t, rec)
    print(json.dumps({f"{k}": (str(r.status), r.peak_memory_gb, r.predicted) for k, (_, r) in recs.items()}, indent=1))
    assert study.user_attrs.get(MEMORY_MODEL_ATTR), "the search stored its calibrated model"
    assert set(recs) == {*CALIBRATION, FAR, NEAR}  # nothing else was asked

    def beyond_error(p: dict) -> bool:
        return p["peak_gb"] / (1 + p["error"]) > CAP_GB

    far_t, far = recs[FAR]
    assert far.status == Status.PREDICTED_OOM and far.duration_s == 0.0 and far.result_path is None
    assert beyond_error(far.predicted)
    assert far_t.state == optuna.trial.TrialState.COMPLETE and far.constraint > 1.0  # told: infeasible, graded
    _, near = recs[NEAR]
    assert near.status in (Status.OK, Status.OOM) and near.duration_s > 0  # launched: really measured
    p = near.predicted
    assert p is not None and p["peak_gb"] / (1 + p["error"]) <= CAP_GB <= p["peak_gb"] * (1 + p["error"])
    # every candidate judged with the model was launched exactly when it was not beyond the error
    for _, rec in recs.values():
        if rec.predicted is not None:
            assert (rec.status == Status.PREDICTED_OOM) == beyond_error(rec.predicted), rec
    print(yaml.safe_dump({"near": near.predicted, "far": far.predicted}))
