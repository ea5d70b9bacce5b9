"""An in-run sweep's schedule and what a verl run's rows and result make of it, without verl
(tests/e2e/test_verl.py runs the plugin in real verl): which setting runs at which step and what it puts into each
worker call, the plugin's figures read into our rows, and one result entry per setting."""

from __future__ import annotations

import json
import time

import pytest

from trainer.config import ConfigError
from trainer.verl_engine.metrics import lengths_of, steps_from_jsonl
from trainer.verl_engine.result import verl_result
from trainer.verl_engine.run_file import load_run
from trainer.verl_engine.schedule import SETTING_METRIC, Schedule, Setting

MICRO, BUDGET = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
)
LOGPROB = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"


def test_a_schedule_runs_each_setting_after_its_warm_up_step():
    sched = Schedule([Setting({MICRO: 1}, steps=2, warmup=1), Setting({MICRO: 4, LOGPROB: 8}, steps=2, warmup=1)])
    assert sched.total_steps == 6
    assert [sched.at(s) for s in range(1, 8)] == [
        (0, False),
        (0, True),
        (0, True),
        (1, False),
        (1, True),
        (1, True),
        None,
    ]
    # each pass's worker call gets its own keys of the setting, named as verl's batch names them
    assert sched.settings[1].batch_keys("update_actor") == {"micro_batch_size_per_gpu": 4}
    assert sched.settings[1].batch_keys("old_log_prob") == {"micro_batch_size_per_gpu": 8}
    assert sched.settings[0].batch_keys("ref") == {}
    assert Schedule.from_json(sched.to_json()) == sched


def test_each_setting_replays_the_batches_a_run_of_its_own_gets():
    """A later setting measured on later batches reads another throughput (the data sets a step's tokens): each
    setting's steps get the sampler's first batches, then the order goes on past the schedule."""
    sched = Schedule([Setting({MICRO: 1}, steps=2, warmup=1), Setting({MICRO: 4}, steps=1, warmup=1)])
    assert sched.replay(20, 2) == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, *range(10, 20)]
    assert sched.replay(4, 2) == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3]  # a small dataset: cycled, as more epochs would


def test_the_driver_hands_verls_dataloader_the_replayed_order(monkeypatch, tmp_path):
    """verl's create_rl_sampler wrapped: a seeded sampler's batches for each setting equal a run alone's."""
    import types

    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from trainer.verl_engine.plugin import driver
    from trainer.verl_engine.schedule import LOG_ENV, SWEEP_ENV

    sched = Schedule([Setting({MICRO: 1}, steps=2), Setting({MICRO: 4}, steps=2)])
    (tmp_path / "sweep.json").write_text(sched.to_json())
    monkeypatch.setenv(SWEEP_ENV, str(tmp_path / "sweep.json"))
    monkeypatch.setenv(LOG_ENV, str(tmp_path / "phases.jsonl"))
    monkeypatch.setattr(driver, "_STATE", None)

    def create_rl_sampler(data_config, dataset):  # verl's, with data.shuffle and data.seed
        return RandomSampler(dataset, generator=torch.Generator().manual_seed(1))

    utils = types.SimpleNamespace(create_rl_sampler=create_rl_sampler)
    driver._patch_sampler(utils)
    driver._patch_sampler(utils)  # idempotent: wrapped once
    data = list(range(40))
    config = {"train_batch_size": 4}
    batches = lambda sampler: [b.tolist() for b in DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)]  # noqa: E731
    swept, alone = batches(utils.create_rl_sampler(config, data)), batches(create_rl_sampler(config, data))
    assert swept[:3] == swept[3:6] == alone[:3] and len(swept) == len(alone) == 10
    assert sorted(x for b in alone for x in b) == data


def test_a_run_file_sweeps_only_per_step_knobs(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(f"overrides: []\nppotune: {{steps: 3, warmup: 1, sweep: [{{{MICRO}: 1}}, {{{MICRO}: 2}}]}}\n")
    spec = load_run(run)
    assert spec.total_steps == 6 and [s.knobs for s in spec.schedule.settings] == [{MICRO: 1}, {MICRO: 2}]
    run.write_text("overrides: []\nppotune: {sweep: [{actor_rollout_ref.model.enable_gradient_checkpointing: true}]}\n")
    with pytest.raises(ConfigError) as e:
        load_run(run)
    assert e.value.key == "ppotune.sweep" and "not a per-step knob" in str(e.value)


def _line(step: int, **extra) -> str:
    data = {"timing_s/step": 1.0, "perf/throughput": 100.0 + step, "perf/total_num_tokens": 480, **extra}
    return json.dumps({"step": step, "data": data})


def test_the_plugins_figures_become_our_rows():
    """ppotune/memory/<pass>_gb (a pass's peak, max over ranks) becomes memory/<pass>_gb as our trainer's rows have
    it; the setting tags the row; a setting's first step is its warm-up; measured length percentiles are kept."""
    sched = Schedule([Setting({MICRO: 1}, steps=1), Setting({MICRO: 2}, steps=1)])
    lines = [
        _line(
            s,
            **{
                SETTING_METRIC: (s - 1) // 2,
                "ppotune/memory/update_actor_gb": 0.5 * s,
                "ppotune/micro_batches/update_actor": 4 // s,
                "ppotune/lengths/response/p50": 20.0 + s,
                "response_length/min": 3.0,
                "response_length/max": 32.0,
                "response_length/mean": 21.0,
            },
        )
        for s in range(1, 5)
    ]
    rows = steps_from_jsonl("\n".join(lines), warmup=1, device="cpu", schedule=sched)
    assert [(r["step"], r["setting"], r["warmup"]) for r in rows] == [
        (1, 0, True),
        (2, 0, False),
        (3, 1, True),
        (4, 1, False),
    ]
    assert rows[3]["memory/update_actor_gb"] == 2.0 and rows[3]["ppotune/micro_batches/update_actor"] == 1
    assert lengths_of(rows[1:2])["response"]["p50"] == 22.0


def test_a_sweeps_result_has_one_entry_per_setting(tmp_path):
    """Settings that finished are ok with their own rows; the run's OOM is the setting it happened in; the rest
    did not run (the tuner infers or re-runs them: tuner.trials.sweep)."""
    run = tmp_path / "run.yaml"
    sweep = "[{%s: 1}, {%s: 2}, {%s: 4}]" % (MICRO, MICRO, MICRO)
    run.write_text(f"overrides: []\nppotune: {{steps: 3, warmup: 1, sweep: {sweep}}}\n")
    spec = load_run(run)
    rows = steps_from_jsonl("\n".join(_line(s) for s in range(1, 5)), warmup=1, device="cpu", schedule=spec.schedule)
    res = verl_result(
        spec,
        device="cpu",
        version="0.9.1",
        config={},
        status="oom",
        error="CPU OOM",
        rows=rows,
        tail="",
        t0=time.time(),
    )
    got = [(s["status"], s["knobs"][MICRO], len(s["steps"])) for s in res["settings"]]
    assert got == [("ok", 1, 3), ("oom", 2, 1), ("not_run", 4, 0)]
    assert res["settings"][0]["summary"]["num_measured_steps"] == 2 and res["settings"][1]["error"] == "CPU OOM"
