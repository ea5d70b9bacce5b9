"""Warm trials end to end: REAL trials (the tiny preset, 2 CPU ranks, gloo) through the real runners.

One :class:`tuner.trials.warm.WarmRunner` runs a sequence, each trial from its own thread (as ``--parallel``
worker threads and ``--confirm`` do): two ok trials, a config the job's launcher refuses, another ok
trial, one on other data (all five in one job), a real OOM (``--memory-limit-gb``: a 1024-wide model cannot allocate its
weights under the cap) that ends the job, an ok trial in a fresh job, and a real distributed hang
(``ppotune.fault=hang``) caught by the step timeout. The first config also runs cold
(:class:`tuner.trials.runners.SubprocessRunner`): a warm trial must measure what a cold one measures.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from support import REPO, TINY_BASE, processes_with, wait_until
from trainer.config import config_to_dict, load_config
from trainer.contracts import Status
from tuner.trials.runners import SubprocessRunner, TrialRequest
from tuner.trials.warm import WarmRunner

pytestmark = pytest.mark.slow

SCHEMA = json.loads((REPO / "trainer" / "result_schema.json").read_text())
STEP_TIMEOUT_S = 20.0
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def config(**flat) -> dict:
    flat = {"trainer.total_training_steps": 3, "ppotune.warmup_steps": 1, **flat}
    return config_to_dict(load_config(TINY_BASE, [f"{k}={json.dumps(v)}" for k, v in flat.items()]))


BASE = config()
SEQUENCE = [  # (name, config): run in this order by one WarmRunner
    ("first", BASE),
    (
        "second",
        config(**{MICRO: 4, "critic.ppo_micro_batch_size_per_gpu": 4, "actor_rollout_ref.actor.strategy": "fsdp2"}),
    ),
    ("refused", {**BASE, "data": {**BASE["data"], "train_batch_size": 0}}),  # the launcher's validation says no
    ("after_refused", BASE),
    ("other_data", config(**{"data.max_prompt_length": 32})),  # the job's tokenized prompts are not reused
    ("oom", config(**{"ppotune.tiny.hidden_size": 1024, "ppotune.memory_limit_gb": 0.25})),
    ("fresh_job", BASE),
    ("hang", config(**{"ppotune.fault": "hang"})),
]


def serve_ranks(jobs_dir: Path) -> set[int]:
    """The rank processes of the warm jobs under ``jobs_dir`` (not their launcher)."""
    cmds = {p.pid: " ".join(p.cmdline()) for p in processes_with(str(jobs_dir))}
    return {pid for pid, cmd in cmds.items() if "-m trainer.rank.serve" in cmd}


@pytest.fixture(scope="module")
def seq(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    cold = SubprocessRunner(
        device_kind="cpu", nproc=2, grace_s=3.0, startup_timeout_s=300, step_timeout_s=STEP_TIMEOUT_S
    )
    warm = WarmRunner(cold=cold, jobs_dir=d / "jobs")
    got, ranks = {}, {}
    try:
        for number, (name, cfg) in enumerate(SEQUENCE):
            req = TrialRequest(number=number, config=cfg, identity=(number,), trial_dir=d / "trials" / str(number))
            worker = threading.Thread(target=lambda r=req, n=name: got.__setitem__(n, warm.run(r, threading.Event())))
            worker.start()  # a thread per trial: the job must outlive the thread that started it
            worker.join()
            ranks[name] = serve_ranks(d / "jobs")
        req = TrialRequest(number=99, config=BASE, identity=(99,), trial_dir=d / "trials" / "cold")
        got["cold"] = cold.run(req, threading.Event())
    finally:
        warm.close()
    return SimpleNamespace(dir=d, out=got, ranks=ranks, warm=warm)


def note(outcome) -> str:
    (n,) = [n for n in outcome.record.notes if n.startswith("warm:") or n.startswith("cold:")]
    return n


def test_trials_of_one_layout_run_in_one_job(seq):
    o = seq.out
    assert [o[n].status for n in ("first", "second", "after_refused")] == [Status.OK] * 3
    job = note(o["first"]).split(" of job ")[1].split(":")[0]
    assert note(o["first"]).startswith(f"warm: trial 1 of job {job}: its seconds include the job's start-up")
    assert note(o["second"]).startswith(f"warm: trial 2 of job {job} (started for trial 0)")
    assert note(o["after_refused"]).startswith(f"warm: trial 4 of job {job} ")
    # the same two rank processes ran them all, each trial started from another thread
    assert len(seq.ranks["first"]) == 2 and seq.ranks["first"] == seq.ranks["second"] == seq.ranks["after_refused"]
    # a later trial does not pay for processes, imports and the model load again
    assert o["second"].record.duration_s < 0.75 * o["first"].record.duration_s, (
        o["first"].record.duration_s,
        o["second"].record.duration_s,
    )


def test_warm_results_and_files_follow_the_contract(seq):
    for name in ("first", "second", "after_refused", "fresh_job"):
        rec = seq.out[name].record
        result = json.loads(Path(rec.result_path).read_text())
        jsonschema.validate(result, SCHEMA)
        assert result["status"] == "ok" and rec.throughput == result["summary"]["throughput"] > 0
        assert rec.memory_source == "rss_above_start" and rec.peak_memory_gb > 0
        assert rec.memory["samples"] >= 5 and rec.memory["external_peak_gb"] > 0  # sampled over its own window
        assert rec.returncode == 0 and rec.engine == "ppotune" and rec.error is None
        d = Path(rec.config_path).parent
        assert Path(rec.result_path) == d / "result.json" and Path(rec.log_path) == d / "train.log"
        log = (d / "train.log").read_text()
        # the trial's own part of the job's output: its steps and its outcome line, no other trial's
        first = log.splitlines()[0]
        assert first.startswith("$ [warm job ") and first.endswith(
            f"train {d / 'config.yaml'} --result {d / 'result.json'}"
        )
        assert log.count("ppotune train: ok |") == 1
        # a job's first trial runs its warm-up step; a later one none: its first step is measured unless it turns
        # out to be an outlier (trainer.summary.first_step_outlier), when it is marked warm-up afterwards
        later = name in ("second", "after_refused")
        assert log.count("step 1 (warm-up) |") == (0 if later else 1)
        counted_as_warmup = any("counted as the warm-up" in n for n in rec.notes)
        assert result["steps"][0]["warmup"] == (counted_as_warmup or not later)
        assert result["summary"]["num_measured_steps"] == 3 - result["steps"][0]["warmup"]


def test_a_warm_trial_measures_what_a_cold_trial_measures(seq):
    warm, cold = seq.out["fresh_job"], seq.out["cold"]  # the same config; warm: the second job's first trial
    warm_first = seq.out["first"]
    for w in (warm, warm_first, seq.out["after_refused"]):  # the same batches, warm-up or none
        wr = json.loads(Path(w.record.result_path).read_text())
        cr = json.loads(Path(cold.record.result_path).read_text())
        # the same responses step by step: the trainer's code path and its random state are a cold run's
        keys = ("perf/total_num_tokens", "response_length/mean", "reward/mean")
        assert [[s[k] for k in keys] for s in wr["steps"]] == [[s[k] for k in keys] for s in cr["steps"]]
    # The CPU memory objective (resident memory above the start level) agrees with a cold run's. On the tiny
    # model it is ~30 MiB, mostly what a process allocates on first use, with a few MiB of run-to-run noise:
    # a later trial counted from its own start (no first-use correction) would read ~8 MiB.
    later = seq.out["after_refused"]  # a job's later trial: counted from its start less the first-use memory
    assert any("first-use memory" in n for n in later.record.notes)
    for w in (warm, later):
        assert abs(w.record.peak_memory_gb - cold.record.peak_memory_gb) * 1024 < 8.0, (
            w.record.peak_memory_gb,
            cold.record.peak_memory_gb,
        )


def test_a_later_trial_on_other_data_tokenizes_its_own_prompts(seq):
    """A job keeps the prompts it tokenized while the data config stays the same (after_refused ran on them and
    saw a cold run's batches, above); a trial with another data config builds its own."""
    lengths = {
        n: json.loads(Path(seq.out[n].record.result_path).read_text())["summary"]["lengths"]["prompt"]
        for n in ("after_refused", "other_data")
    }
    assert seq.out["other_data"].status == Status.OK and seq.ranks["other_data"] == seq.ranks["first"]
    assert lengths["after_refused"]["max"] > 32 >= lengths["other_data"]["max"], lengths


def test_a_refused_config_is_invalid_and_the_job_goes_on(seq):
    r = seq.out["refused"]
    assert r.status == Status.INVALID and r.record.error.startswith("config:")
    assert "data.train_batch_size" in r.record.error
    assert seq.out["after_refused"].status == Status.OK and seq.ranks["refused"] == seq.ranks["first"]


def test_an_oom_ends_the_job_and_the_next_trial_starts_a_fresh_one(seq):
    oom, fresh = seq.out["oom"], seq.out["fresh_job"]
    assert oom.status == Status.OOM and "out of memory" in oom.record.error
    assert oom.record.returncode == 3 and oom.record.notes[-1].endswith("the job ended with it")
    assert oom.record.log_tail and "out of memory" in oom.record.log_tail
    old_job = note(seq.out["first"]).split(" of job ")[1].split(":")[0]
    assert fresh.status == Status.OK and note(fresh).startswith("warm: trial 1 of job ")
    assert old_job not in note(fresh)
    assert not seq.ranks["fresh_job"] & seq.ranks["first"]  # other processes
    assert not any(old_job in " ".join(p.cmdline()) for p in processes_with(str(seq.dir / "jobs")))


def test_a_hang_is_killed_by_the_step_timeout_with_nothing_left(seq):
    hang = seq.out["hang"]
    assert hang.status == Status.HANG and "--step-timeout" in hang.record.error, hang.record.error
    assert STEP_TIMEOUT_S <= hang.record.duration_s < STEP_TIMEOUT_S + 15
    assert "terminating its warm job's process group" in Path(hang.record.log_path).read_text()
    assert hang.record.notes[-1].endswith("the job ended with it")
    # every job is gone: the hung one was killed, the others stopped by close()
    assert wait_until(lambda: not processes_with(str(seq.dir / "jobs")), 15), [
        p.cmdline() for p in processes_with(str(seq.dir / "jobs"))
    ]


def test_close_leaves_no_process_and_a_stopped_job_exits_cleanly(seq):
    jobs = sorted((seq.dir / "jobs").iterdir())
    assert len(jobs) == 2 and all((j / "job.log").is_file() for j in jobs)
    time.sleep(0.5)
    assert processes_with(str(seq.dir)) == []


def test_a_job_started_ahead_runs_the_first_trial_or_ends_unused(tmp_path):
    """``prestart``: the job's processes start before the first trial is asked (while the tuner opens its study);
    the first trial runs in it and says so. One never used is ended by ``close`` with nothing left."""
    cold = SubprocessRunner(device_kind="cpu", nproc=2, grace_s=3.0, startup_timeout_s=300, step_timeout_s=60)
    used, unused = (
        WarmRunner(cold=cold, jobs_dir=tmp_path / "used"),
        WarmRunner(cold=cold, jobs_dir=tmp_path / "unused"),
    )
    try:
        used.prestart(BASE)
        unused.prestart(BASE)
        wait_until(lambda: len(serve_ranks(tmp_path / "unused")) == 2, timeout=60)
        unused.close()
        assert processes_with(str(tmp_path / "unused")) == []
        req = TrialRequest(number=0, config=BASE, identity=(0,), trial_dir=tmp_path / "trials" / "0")
        out = used.run(req, threading.Event())
        assert out.status == Status.OK
        assert note(out).endswith("its seconds include what was left of the job's start-up (started ahead of it)")
        ranks = serve_ranks(tmp_path / "used")
        req = TrialRequest(number=1, config=BASE, identity=(1,), trial_dir=tmp_path / "trials" / "1")
        out = used.run(req, threading.Event())
        assert out.status == Status.OK and serve_ranks(tmp_path / "used") == ranks
        assert " (started ahead of the search's first trial): " in note(out)
    finally:
        used.close()
        unused.close()
    assert processes_with(str(tmp_path)) == []
