"""Each setting of an in-run sweep gets the memory its own steps held (tuner.trials.sweep over the verl trial record
of tuner.trials.runners.trial_record), not the largest pass plus one offset shared by all settings.

The run: verl 0.9.1's v1 sync trainer with a colocated vLLM (the phase windows as trainer/verl_engine/plugin/driver.py
records them: tests/trainer/verl_engine/test_plugin_phases.py), two settings of two steps each, the lighter first. Per
GPU, NVML's per-process figures (tests/tuner/trials/test_memory_timeline.py): vLLM's worker holds its weights and KV
cache while awake (the weight sync, generation) and its CUDA context while asleep (the passes); the FSDP rank holds
what each phase needs. The allocator's per-pass peaks (the plugin's worker lines) are what the old rule added one
offset to."""

from __future__ import annotations

import json

import pytest

from tests.tuner.trials.test_sweep import MICRO, _setup
from trainer.contracts import Status
from tuner.trials.launch import TrialRun
from tuner.trials.memory import MemoryPeaks
from tuner.trials.runners import TrialOutcome, trial_record
from tuner.trials.sweep import split_outcome
from tuner.trials.timeline import Timeline

VLLM_GB, ASLEEP_GB = 30.0, 0.1
#: per setting, each phase's (FSDP rank's GB, vLLM worker's GB): the heavier setting's update holds 40 GB
PHASES = {
    0: [("generation", 4.0, VLLM_GB), ("old_log_prob", 6.0, ASLEEP_GB), ("update_actor", 8.0, ASLEEP_GB)],
    1: [("generation", 4.0, VLLM_GB), ("old_log_prob", 6.0, ASLEEP_GB), ("update_actor", 40.0, ASLEEP_GB)],
}
SYNC = ("weight_sync", 6.0, VLLM_GB)


def _run(tmp_path, *, with_windows: bool) -> TrialRun:
    """Steps 1-2 run setting 0, steps 3-4 setting 1; each phase 1 s, sampled at 10 Hz inside it."""
    timeline, windows, t = Timeline(), [], 0.0
    for step in range(1, 5):
        setting = 0 if step <= 2 else 1
        for phase, rank, server in [*PHASES[setting], SYNC]:
            windows.append({"step": step, "phase": phase, "start": t, "end": t + 1.0})
            for k in range(10):
                timeline.add(t + 0.05 + k / 10, (rank + server,))
            t += 1.0

    def entry(setting: int, steps: list) -> dict:
        allocator = {p: rank for p, rank, _ in PHASES[setting]}  # the worker lines' peaks: no vLLM there
        summary = {"throughput": 10.0, "num_measured_steps": 1, "peak_memory_by_phase_gb": allocator}
        rows = [{"step": s, "warmup": s in (1, 3), "setting": setting} for s in steps]
        return {"knobs": {}, "status": "ok", "error": None, "steps": rows, "summary": summary}

    result = {"summary": {}, "settings": [entry(0, [1, 2]), entry(1, [3, 4])]}
    if with_windows:
        result["phase_windows"] = windows
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    peaks = MemoryPeaks(external_peak_gb=40.1, external_source="nvml", process_peak_gb=40.1, timeline=timeline)
    return TrialRun(Status.OK, None, 0, result, 90.0, str(tmp_path / "log"), str(path), memory=peaks)


def _split(tmp_path, *, with_windows: bool):
    space, flat = _setup()
    valid = [c for c in space.grid(flat) if not c.violated]
    cands = [next(c for c in valid if c.effective.get(MICRO) == micro) for micro in (1, 4)]  # rising memory
    record = trial_record(
        _run(tmp_path, with_windows=with_windows), config_path=tmp_path / "c", gpus=["0"], engine="verl"
    )
    return record, split_outcome(TrialOutcome(Status.OK, record), cands, space)


def test_the_run_records_each_phase_as_its_processes_held_it(tmp_path):
    record, _ = _split(tmp_path, with_windows=True)
    assert record.memory["external_by_phase_gb"] == {
        "generation": 34.0,  # vLLM awake beside the rank
        "weight_sync": 36.0,
        "old_log_prob": 6.1,  # vLLM asleep: its context only
        "update_actor": 40.1,
    }
    assert record.memory["external_by_step_gb"]["1"]["step"] == 36.0
    assert record.memory["by_phase_gb"] == {}  # the allocator's per-phase peaks (the memory model's) stay apart


def test_each_setting_gets_the_peak_of_its_own_steps(tmp_path):
    """The lighter setting peaks in its weight sync (36 GB, vLLM awake), the heavier in its update (40.1 GB). The old
    rule gave the lighter one its largest pass plus the run's one offset, 8 + (40.1 - 40) = 8.1 GB: a config that
    needs 36 GB would pass a 20 GB headroom filter."""
    _, (light, heavy) = _split(tmp_path, with_windows=True)
    assert light.record.peak_memory_gb == pytest.approx(36.0)
    assert heavy.record.peak_memory_gb == pytest.approx(40.1)
    assert light.record.memory["external_by_phase_gb"]["update_actor"] == 8.1
    assert set(light.record.memory["external_by_step_gb"]) == {"1", "2"}
    assert "what the trial held over its own steps" in light.record.notes[-1]


def test_without_a_timeline_the_one_offset_rule_stays_and_says_so(tmp_path):
    _, (light, heavy) = _split(tmp_path, with_windows=False)
    assert light.record.peak_memory_gb == pytest.approx(8.0 + (40.1 - 40.0))
    assert heavy.record.peak_memory_gb == pytest.approx(40.1)
    assert "the one offset" in light.record.notes[-1]
