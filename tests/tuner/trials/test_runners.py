"""tuner/trials/runners.py: what a launched trial's record keeps of its run."""

from pathlib import Path

from trainer.contracts import Status
from tuner.trials.launch import TrialRun
from tuner.trials.memory import MemoryPeaks
from tuner.trials.runners import trial_record


def test_how_the_gpus_were_read_reaches_the_trials_notes_once():
    note = "CUDA_VISIBLE_DEVICES=GPU-89: an ambiguous UUID prefix; NVML not read, psutil instead"
    run = TrialRun(
        status=Status.OK,
        error=None,
        returncode=0,
        result={"notes": [note], "summary": {}},
        duration_s=1.0,
        log_path="t.log",
        result_path="t.json",
        memory=MemoryPeaks(external_source="psutil", notes=[note, "psutil: no NVML on this machine"]),
    )
    record = trial_record(run, config_path=Path("c.yaml"), gpus=None, engine="ppotune")
    assert record.notes == [note, "psutil: no NVML on this machine"]
