"""Warm-trial drift (issue 24): the same config as a warm job's first trial and again as later ones, with nothing
left in the later trials that a cold run would not pay: no compile inside a measured step, every step measured.
REAL trials (the tiny preset, 2 CPU ranks, gloo) through the real warm runner. The step times themselves are a
timing claim: benchmarks/bench_warm_drift.py measures them over several jobs (benchmarks/README.md).

The config is the one where drift was built in: ``use_torch_compile`` with chunked entropy and token-budget
micro-batches. The compiled entropy is compiled once per shape family (trainer.engine.roles.compiled_entropy)
and kept across a job's trials; before, a job reset dynamo between trials and the chunked entropy recompiled
for every new micro-batch token count, so compiles landed inside measured steps, more of them in some trials
than in others. A measured step that compiles says so in the trial's notes (trainer.rank.trial)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from support import TINY_BASE
from trainer.config import config_to_dict, load_config
from trainer.contracts import Status
from tuner.trials.runners import SubprocessRunner, TrialRequest
from tuner.trials.warm import WarmRunner

pytestmark = pytest.mark.slow

ACTOR = "actor_rollout_ref.actor"
COMPILED = {
    f"{ACTOR}.use_torch_compile": True,
    f"{ACTOR}.entropy_from_logits_with_chunking": True,
    f"{ACTOR}.entropy_from_logits_chunk_size": 16,
    f"{ACTOR}.use_dynamic_bsz": True,
    f"{ACTOR}.ppo_max_token_len_per_gpu": 160,
}
OTHER = {f"{ACTOR}.strategy": "fsdp2", f"{ACTOR}.ppo_micro_batch_size_per_gpu": 4}


def config(**flat) -> dict:
    flat = {"trainer.total_training_steps": 6, "ppotune.warmup_steps": 1, "ppotune.min_measured_steps": 5, **flat}
    return config_to_dict(load_config(TINY_BASE, [f"{k}={json.dumps(v)}" for k, v in flat.items()]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("drift")
    cold = SubprocessRunner(device_kind="cpu", nproc=2, grace_s=3.0, startup_timeout_s=300, step_timeout_s=120)
    warm = WarmRunner(cold=cold, jobs_dir=d / "jobs")
    sequence = [("first", config(**COMPILED)), ("other", config(**OTHER)), ("later", config(**COMPILED))]
    sequence.append(("last", config(**COMPILED)))
    got = {}
    try:
        for number, (name, cfg) in enumerate(sequence):
            req = TrialRequest(number=number, config=cfg, identity=(number,), trial_dir=d / "trials" / str(number))
            worker = threading.Thread(target=lambda r=req, n=name: got.__setitem__(n, warm.run(r, threading.Event())))
            worker.start()
            worker.join()
    finally:
        warm.close()
    return got


def _measured_step_s(outcome) -> list[float]:
    result = json.loads(Path(outcome.record.result_path).read_text())
    return [s["timing_s/step"] for s in result["steps"] if not s["warmup"]]


def test_every_trial_runs_and_the_later_ones_measure_every_step(runs):
    """The first trial measures after its warm-up step; a later trial of the same config has nothing to warm up:
    all its steps are measured (its first one provisionally: trainer.rank.trial), the same batches as a cold run."""
    assert all(o.status == Status.OK for o in runs.values()), {n: o.status for n, o in runs.items()}
    first = _measured_step_s(runs["first"])
    assert len(first) == 5 and all(s > 0 for s in first)
    for name in ("later", "last"):
        steps = _measured_step_s(runs[name])
        assert len(steps) >= 5 and all(s > 0 for s in steps), (name, steps)


def test_no_measured_step_compiles(runs):
    for name, outcome in runs.items():
        compiles = [n for n in outcome.record.notes if n.startswith("torch.compile:")]
        assert not compiles, (name, compiles)
