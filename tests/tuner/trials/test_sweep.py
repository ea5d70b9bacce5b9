"""Which configs share a verl run (tuner.trials.sweep.group_for): those that differ only in per-step knobs, not held
by the study, in the order of rising memory; and how one run's result splits into its settings' outcomes."""

from __future__ import annotations

import json

from support import REPO
from trainer.contracts import Status, TrialRecord
from trainer.verl_engine.schedule import is_per_step
from tuner.space.load import base_flat_config, load_space
from tuner.trials.runners import TrialOutcome
from tuner.trials.sweep import group_for, split_outcome

SPACE = REPO / "search_spaces" / "verl_cpu.yaml"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
CKPT = "actor_rollout_ref.model.enable_gradient_checkpointing"


def _setup():
    space = load_space(SPACE)
    flat = base_flat_config(None, extra={"data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 4})[
        1
    ]
    return space, flat


def test_a_group_shares_everything_but_per_step_knobs_and_rises_in_memory():
    space, flat = _setup()
    cand = next(c for c in space.grid(flat) if not c.violated and c.effective.get(MICRO) == 2 and not c.effective[CKPT])
    group = group_for(space, cand, flat, held=set(), settings=4, seed=0)
    assert len(group) == 4 and cand in group
    fixed = lambda c: {k: v for k, v in space.identity(c.effective) if not is_per_step(k)}  # noqa: E731
    assert all(fixed(c) == fixed(cand) for c in group)  # only per-step knobs differ: one verl run can hold them
    assert len({space.identity(c.effective) for c in group}) == 4
    # rising memory: none is at least as hungry as a later one unless they are the same on every monotone knob
    for i, a in enumerate(group):
        for b in group[i + 1 :]:
            assert not space.at_least_as_hungry(a.effective, b.effective) or space.at_least_as_hungry(
                b.effective, a.effective
            )
    held = {space.identity(c.effective) for c in group if c is not cand}
    again = group_for(space, cand, flat, held=held, settings=4, seed=0)
    assert not held & {space.identity(c.effective) for c in again}  # what the study holds is not run again
    assert group_for(space, cand, flat, held=set(), settings=1, seed=0) == [cand]


def test_one_runs_result_splits_into_its_settings(tmp_path):
    """ok settings keep their own figures (memory: their largest pass + what the run held beside its passes); the
    OOM is its setting's; a setting after it that is at least as hungry is an inferred OOM, any other is left."""
    space, flat = _setup()
    fixed = [c for c in space.grid(flat) if not c.violated and not c.effective[CKPT] and MICRO in c.params]
    by_micro = {
        c.effective[MICRO]: c
        for c in fixed
        if c.effective["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] == 2
    }
    cands = [by_micro[1], by_micro[2], by_micro[4]]

    def setting(status, peak, thr):
        summary = {"throughput": thr, "num_measured_steps": 2, "peak_memory_by_phase_gb": {"update_actor": peak}}
        return {"knobs": {}, "status": status, "error": None, "steps": [], "summary": summary}

    result = tmp_path / "result.json"
    result.write_text(
        json.dumps({"settings": [setting("ok", 1.0, 50.0), setting("oom", 1.4, None), setting("not_run", 0, None)]})
    )
    whole = TrialOutcome(Status.OOM, TrialRecord(peak_memory_gb=3.0, duration_s=90.0, result_path=str(result)))
    ok, oom, left = split_outcome(whole, cands, space)
    assert ok.status == Status.OK and ok.record.throughput == 50.0 and ok.record.duration_s == 45.0
    assert ok.record.peak_memory_gb == 1.0 + (3.0 - 1.4) and ok.record.memory["by_phase_gb"] == {"update_actor": 1.0}
    assert oom.status == Status.OOM and left.status == Status.INFERRED_OOM  # micro 4 >= micro 2 on every knob
