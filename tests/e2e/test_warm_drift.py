"""Warm-trial drift (issue 24): the same config as a warm job's first trial and again as later ones, with nothing
left in the later trials that a cold run would not pay: no compile inside a measured step, every step measured.
REAL trials (the tiny preset, 2 CPU ranks, gloo) through the real warm runner. The step times themselves are a
timing claim: benchmarks/bench_warm_drift.py measures them over several jobs (benchmarks/README.md).

The config is the one where drift was built in: ``use_torch_compile`` with chunked entropy and token-budget
micro-batches. The compiled entropy is compiled once per shape family (trainer.engine.parallelize.compiled_entropy)
and kept across a job's trials; before, a job reset dynamo between trials and the chunked entropy recompiled
for every new micro-batch token count, so compiles landed inside measured steps, more of them in some trials
than in others. A measured step that compiles says so in the trial's notes (trainer.rank.trial)."""

from __future__ import annotations

import importlib.util

import pytest

from support import REPO
from trainer.contracts import Status

pytestmark = pytest.mark.slow


def _bench():
    """benchmarks/bench_warm_drift.py: the sequence and the job (one place for both)."""
    spec = importlib.util.spec_from_file_location("bench_warm_drift", REPO / "benchmarks" / "bench_warm_drift.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return BENCH.run_job(tmp_path_factory.mktemp("drift"), steps=6)


def test_every_trial_runs_and_the_later_ones_measure_every_step(runs):
    """The first trial measures after its warm-up step; a later trial of the same config has nothing to warm up:
    all its steps are measured (its first one provisionally: trainer.rank.trial), the same batches as a cold run."""
    assert all(o.status == Status.OK for o in runs.values()), {n: o.status for n, o in runs.items()}
    first = BENCH.measured_step_s(runs["first"])
    assert len(first) == 5 and all(s > 0 for s in first)
    for name in ("later", "last"):
        steps = BENCH.measured_step_s(runs[name])
        assert len(steps) >= 5 and all(s > 0 for s in steps), (name, steps)


def test_no_measured_step_compiles(runs):
    for name, outcome in runs.items():
        assert not BENCH.compiles(outcome), (name, BENCH.compiles(outcome))
