"""The confirmation stage against load and against suspect single trials (tuner.search.confirmation), over the replay
runner of tests/tuner/rules/test_finalists.py: a round under load is run again once the load has passed (the wait
read by an injected probe and clock, then by the real host probe beside a busy-loop it starts and stops); a wait that
runs out stops and says how to confirm later; a first round that contradicts the single trials widens the finalists;
rounds go on past the cap while the leader has not separated and the budget allows."""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest

from support import search_over, tiny_setup
from tests.tuner.rules.test_finalists import ORDER, SPACE, Said, _reruns, _study, _table
from tuner.results import why
from tuner.rules import finalists as rules
from tuner.search.confirmation import ConfirmationStage, reconfirm_command
from tuner.trials.memory import host_load
from tuner.trials.runners import ReplayRunner, TrialOutcome


@pytest.fixture(scope="module")
def finals():
    return tiny_setup(SPACE)


@dataclass
class Shaped(ReplayRunner):
    """The replay runner, each launch's outcome passed through ``shape(launch number from 1, outcome)``."""

    shape: object = None
    outcomes: list = field(default_factory=list)

    def run(self, request, stop):
        got = super().run(request, stop)
        got = self.shape(self.launched, got) if self.shape else got
        self.outcomes.append(got)
        return got


def _loaded(outcome: TrialOutcome) -> TrialOutcome:
    outcome.record.load = {"cpu_others": 1.0, "cpu_others_share": 0.5, "gpu_other_processes": 0, "loaded": True}
    return outcome


def _searched(setup, runner, *, said=None):
    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)
    search = search_over(setup, study, storage, runner, trials=len(ORDER), sampler="grid", confirm=0, observer=said)
    search.run()
    return search, study


class Probe:
    """The host's load as a list of readings (loaded or not), each advancing a fake clock by ``window_s``."""

    def __init__(self, readings, window_s=5.0):
        self.readings, self.window_s, self.now, self.calls = list(readings), window_s, 0.0, 0

    def __call__(self):
        self.calls += 1
        self.now += self.window_s
        loaded = self.readings.pop(0) if self.readings else False
        return {"cpu_others": 1.0 if loaded else 0.0, "cpu_others_share": 0.5 if loaded else 0.0, "loaded": loaded}

    def clock(self):
        return self.now


def test_a_round_under_load_is_run_again_after_the_load_has_passed(finals):
    space, _, flat = finals
    said = Said()
    # the first re-run (launch 6) is measured under load; the host reads loaded twice more, then quiet
    runner = Shaped(_table(space, flat), rng=random.Random(0), shape=lambda k, o: _loaded(o) if k == 6 else o)
    search, study = _searched(finals, runner, said=said)
    probe = Probe([True, True, False])
    ConfirmationStage(search.session, probe=probe, clock=probe.clock, load_wait_s=60.0).run(1)
    conf = study.user_attrs[rules.CONFIRMATION_ATTR]
    # round 1 (#1 #2 base) under load, not claimed from; round 2 rotated, measured quiet: #1 separates
    assert [r.confirm_of for _, r in _reruns(study)] == [1, 2, 0, 2, 0, 1]
    assert conf["loaded_rounds"] == 1 and conf["rounds_run"] == 2 and conf["complete"] and conf["separated"]
    assert conf["finalists"][0]["rounds"] == 1 and conf["load_wait"] is None
    assert probe.calls == 3  # waited once, after the loaded re-run, not before every re-run
    waits = [m for m in said.messages if "waiting (" in m]
    assert len(waits) == 2 and "re-run #5 was measured under load" in waits[0] and "(5 of at most 60 s)" in waits[0]
    assert any("the load passed" in m for m in said.messages)


def test_load_that_outlasts_the_wait_stops_and_says_how_to_confirm_later(finals):
    space, _, flat = finals
    runner = Shaped(_table(space, flat), rng=random.Random(0), shape=lambda k, o: _loaded(o) if k == 6 else o)
    search, study = _searched(finals, runner)
    probe = Probe([True] * 100)
    command = ("search", "configs/tiny_cpu.yaml", "--trials", "5", "--confirm", "1")
    ConfirmationStage(search.session, probe=probe, clock=probe.clock, load_wait_s=12.0, command=command).run(1)
    conf = study.user_attrs[rules.CONFIRMATION_ATTR]
    assert not conf["complete"] and len(_reruns(study)) == 1  # nothing more was run under load
    wait = conf["load_wait"]
    assert wait["waited_s"] == 15.0 and wait["bound_s"] == 12.0 and wait["load"]["loaded"]
    assert wait["reconfirm"] == "ppotune search configs/tiny_cpu.yaml --trials 5 --confirm 1"
    assert why._load_wait_text(wait) == (
        "The confirmation stopped under load: after a re-run measured under load it waited 15 s (at most 12 s) and "
        "the host was still busy (other processes kept 1.00 CPUs busy). To confirm later, on a quiet machine: "
        "`ppotune search configs/tiny_cpu.yaml --trials 5 --confirm 1` (it resumes the study; its trials are done, "
        "so it only confirms)."
    )
    # later, on a quiet host: the same study confirms from where it stopped, launching re-runs only
    before = runner.launched
    ConfirmationStage(search.session, probe=Probe([]), clock=probe.clock).run(1)
    conf = study.user_attrs[rules.CONFIRMATION_ATTR]
    assert conf["complete"] and conf["load_wait"] is None and conf["loaded_rounds"] == 1
    assert runner.launched - before == 5 and all(o.record.load is None for o in runner.outcomes[before:])


def test_a_resumed_search_whose_trials_are_done_only_confirms(finals):
    """The command why.md gives (the same search, ``--confirm N``) runs no search trial on a study holding its
    ``--trials``: only the confirmation's re-runs."""
    space, _, flat = finals
    study, storage = _study(space, flat, device_gb=10.0)
    search_over(finals, study, storage, ReplayRunner(_table(space, flat)), trials=len(ORDER), sampler="grid").run()
    runner = ReplayRunner(_table(space, flat), rng=random.Random(0))
    search_over(finals, study, storage, runner, trials=len(ORDER), sampler="grid", confirm=1).run()
    assert runner.launched == 3 and len(_reruns(study)) == 3


def test_reconfirm_command_replaces_the_confirm_flag():
    assert reconfirm_command(("search", "c.yaml", "--confirm=3", "--report"), 4) == (
        "ppotune search c.yaml --report --confirm 4"
    )
    assert reconfirm_command(("search", "my space.yaml"), 2) == "ppotune search 'my space.yaml' --confirm 2"


def _busy_host() -> bool:
    got = host_load(0.6)
    return bool(got and got["loaded"])


def _hog() -> int:
    """A busy-loop on one core, outside this process's tree (the probe counts the tuner's own tree as its own): its
    pid."""
    cmd = f"{shlex.quote(sys.executable)} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    return int(subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout)


def test_the_host_probe_waits_while_a_busy_loop_runs_and_the_round_then_counts(finals):
    """The real probe (tuner.trials.memory.LoadMeter with no trial): a busy-loop on one core of the host is load;
    the stage waits while it runs, the test stops it, and the round run again counts."""
    if _busy_host():
        pytest.skip("the host is busy already: a busy-loop of ours would not be the only load the probe reads")
    space, _, flat = finals
    stopped = threading.Event()
    runner = Shaped(
        _table(space, flat),
        rng=random.Random(0),
        shape=lambda k, o: o if k <= len(ORDER) or stopped.is_set() else _loaded(o),
    )
    said = Said()
    search, study = _searched(finals, runner, said=said)
    pid = _hog()

    def stop() -> None:
        os.kill(pid, signal.SIGKILL)
        stopped.set()

    stopper = threading.Timer(2.0, stop)
    try:
        stopper.start()
        stage = ConfirmationStage(search.session, probe=lambda: host_load(0.6), load_wait_s=30.0)
        stage.run(1)
    finally:
        stopper.cancel()
        if not stopped.is_set():
            stop()
    conf = study.user_attrs[rules.CONFIRMATION_ATTR]
    assert conf["complete"] and conf["load_wait"] is None and conf["separated"]
    assert conf["loaded_rounds"] == 1 and conf["finalists"][0]["rounds"] == 1
    assert 1.0 < stage.waited_s < 30.0 and any("waiting (" in m for m in said.messages)


# --------------------------------------------------------------------------- suspect single trials
def test_a_baseline_whose_rerun_contradicts_its_trial_widens_the_finalists(finals):
    """The baseline's search trial reads 0.6x what it runs at (it ran first, on a cold machine): the first round
    shows it, so every config whose single trial was within that factor of a finalist's joins the race, and the race
    starts again; the first round is a screening nothing is claimed from."""
    space, _, flat = finals

    def cold_baseline(k, o):
        if k == 1:  # the baseline's search trial
            o.record.throughput *= 0.6
        if k <= len(ORDER):  # the search's trials: the confirmation's budget
            o.record.duration_s = 100.0
        return o

    said = Said()
    search, study = _searched(finals, Shaped(_table(space, flat), rng=random.Random(0), shape=cold_baseline))
    search.session.observer = said
    ConfirmationStage(search.session).run(1)
    conf = study.user_attrs[rules.CONFIRMATION_ATTR]
    # trials: #0 the baseline 120 (it runs at 200), #1 320, #2 100, #3 160, #4 80; finalists #1 and #3 (the front
    # without the baseline, fastest first). Round 1: the baseline 200/120 = 1.67x its trial, #1 1.6x the baseline
    # where the trials said 2.67x, #3 0.8x for 1.33x: the single trials are 1.67x off. Within 1.67x of the slower
    # finalist (#3, 160): #2 (100 x 1.67 = 167), not #4 (133)
    assert conf["suspect"]["why"] == (
        "the baseline's re-run measured 1.67x its own search trial; #1 measured 1.60x the baseline where the single "
        "trials said 2.67x; #3 measured 0.80x the baseline where the single trials said 1.33x"
    )
    assert conf["suspect"]["first_finalists"] == [1, 3]
    assert [e["number"] for e in conf["finalists"]] == [1, 3, 2]
    assert len(conf["screening"]["1"]) == 1 and len(conf["screening"]["0"]) == 1 and not conf["screening"]["2"]
    lead = conf["finalists"][0]
    assert lead["ratio"] == pytest.approx(1.6) and lead["trials"][0] not in conf["screening"]["1"]
    # the baseline's trial against its re-runs is run-to-run noise too: one round does not separate #1 through it,
    # the budget (the search's 500 s) pays for a second
    assert conf["separated"] and conf["leader"] == 1 and conf["complete"] and conf["rounds_run"] == 2
    assert any("the single trials are suspect" in m for m in said.messages)
    assert any("not separated after 1 round; one more" in m for m in said.messages)


def test_rounds_go_past_the_cap_while_not_separated_and_the_budget_allows(finals):
    """Close finalists (2.5% apart) with the search's trials long (100 s each) and re-runs short (1 s): the race goes
    on past --confirm 2 until the rounds' cap; with the search's trials as short as the re-runs, it stops at 2."""
    space, _, flat = finals

    def slow_search(k, o):
        if k <= len(ORDER):
            o.record.duration_s = 100.0
        return o

    search, study = _searched(finals, Shaped(_table(space, flat, close=True), rng=random.Random(0), shape=slow_search))
    ConfirmationStage(search.session).run(2)
    conf = study.user_attrs[rules.CONFIRMATION_ATTR]
    assert conf["rounds_run"] == rules.MAX_ROUNDS and not conf["separated"]
    assert rules.rounds_text(conf).startswith(f"{rules.MAX_ROUNDS} rounds (2 asked, more while the leader")
    search, study = _searched(finals, ReplayRunner(_table(space, flat, close=True), rng=random.Random(0)))
    ConfirmationStage(search.session).run(2)
    assert study.user_attrs[rules.CONFIRMATION_ATTR]["rounds_run"] == 2


def test_suspect_single_trials_with_no_other_config_near_keep_their_round(finals):
    """``--finalists 1``: #1 (320) is 1.67x off like the baseline, but no other config's single trial is within
    1.67x of it (the next, #3, at 160): the suspicion is recorded, the round stands, nothing is screened."""
    space, _, flat = finals

    def cold_baseline(k, o):
        if k == 1:
            o.record.throughput *= 0.6
        return o

    search, study = _searched(finals, Shaped(_table(space, flat), rng=random.Random(0), shape=cold_baseline))
    ConfirmationStage(search.session).run(1, finalists=1)
    conf = study.user_attrs[rules.CONFIRMATION_ATTR]
    assert (
        conf["suspect"]["why"].startswith("the baseline's re-run measured 1.67x") and conf["suspect"]["offsets"] == []
    )
    assert [e["number"] for e in conf["finalists"]] == [1] and not any(conf["screening"].values())
    assert [r.confirm_of for _, r in _reruns(study)][:2] == [1, 0]


def test_the_fits_config_and_the_corner_are_finalists_whatever_their_one_trial_said(finals):
    """``seeds`` (the fit's knob values, the hints' corner): a measured, eligible one joins the finalists past
    ``--finalists``; an unmeasured one or the baseline adds nothing."""
    from tests.tuner.rules.test_finalists import GC, MICRO

    space, _, flat = finals
    search, _ = _searched(finals, ReplayRunner(_table(space, flat), rng=random.Random(0)))
    # #3 is micro-batch 2 with checkpointing (160 tokens/s): behind #1 (320) and #2 (100, on the front)
    assert ConfirmationStage(search.session).plan(1, finalists=1)[0] == [1]
    seeds = [{MICRO: 2, GC: True}, {MICRO: 2, GC: False}, {MICRO: 4, GC: False}]  # #3, the baseline, an OOM
    assert ConfirmationStage(search.session, seeds=seeds).plan(1, finalists=1)[0] == [1, 3]
