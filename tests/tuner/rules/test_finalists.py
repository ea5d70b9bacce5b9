"""Finalists confirmed side by side: tuner.rules.finalists's pure decisions with hand-computed figures, then the
confirmation stage over a replay runner (the real loop, no process): interleaving, rounds until the leader separates,
resume. The rounds' rule itself: tests/tuner/rules/test_race.py."""

from __future__ import annotations

import math
import random
import textwrap
from dataclasses import dataclass

import optuna
import pytest

from support import search_over, tiny_setup
from trainer.contracts import DIRECTIONS, Status, TrialRecord
from tuner.rules import finalists as confirm
from tuner.rules.finalists import Contender
from tuner.rules.race import RUN_NOISE_FLOOR, Rerun, repeat_noise
from tuner.search.policy import build_sampler
from tuner.trials.runners import Recorded, ReplayRunner, TrialOutcome

optuna.logging.set_verbosity(optuna.logging.WARNING)


# --------------------------------------------------------------------------- who is a finalist
def test_within_noise_is_interval_overlap_and_unknown_says_no():
    best = Contender(1, 100.0, (90.0, 110.0), True)
    assert confirm.within_noise(best, Contender(2, 88.0, (80.0, 95.0), False))  # 95 >= 90
    assert confirm.within_noise(best, Contender(3, 85.0, (80.0, 90.0), False))  # touching counts
    assert not confirm.within_noise(best, Contender(4, 80.0, (70.0, 89.9), False))
    assert not confirm.within_noise(best, Contender(5, 99.0, None, False))  # unknown interval
    assert not confirm.within_noise(Contender(1, 100.0, None, True), Contender(6, 99.0, (95.0, 101.0), False))


def test_finalists_are_the_front_plus_what_is_within_noise_fastest_first_capped():
    cands = [
        Contender(0, 250.0, (240.0, 260.0), False),  # the baseline: dominated here
        Contender(3, 320.0, (300.0, 340.0), True),  # the fastest
        Contender(5, 310.0, (290.0, 330.0), False),  # dominated, but its interval reaches the best's
        Contender(6, 290.0, (280.0, 299.0), False),  # dominated and clearly slower: out
        Contender(7, 200.0, (190.0, 210.0), True),  # front: less memory
        Contender(8, 100.0, None, True),  # front: the smallest
    ]
    assert confirm.pick_finalists(cands, exclude=[0], cap=10) == [3, 5, 7, 8]
    assert confirm.pick_finalists(cands, exclude=[0]) == [3, 5, 7]  # cap 3: the fastest three
    assert confirm.pick_finalists(cands, exclude=[0], cap=1) == [3]
    assert confirm.pick_finalists([], exclude=[0]) == []


def test_the_baseline_is_never_a_finalist_but_still_sets_the_best():
    cands = [
        Contender(0, 400.0, (380.0, 420.0), True),  # the baseline is the fastest
        Contender(2, 390.0, (370.0, 400.0), False),  # within its noise
        Contender(4, 300.0, (290.0, 310.0), False),  # not
        Contender(9, 150.0, (140.0, 160.0), True),  # front
    ]
    assert confirm.pick_finalists(cands, exclude=[0]) == [2, 9]
    assert confirm.pick_finalists([Contender(0, 400.0, None, True)], exclude=[0]) == []


# --------------------------------------------------------------------------- the schedule
def test_single_trials_are_suspect_when_the_first_clean_round_contradicts_them_by_more_than_the_ratio():
    searched = {0: Rerun(0, "ok", 100.0), 1: Rerun(1, "ok", 150.0), 2: Rerun(2, "ok", 140.0)}
    # the baseline re-runs 1.19x its trial, #1 1.25x the baseline (1.5x said: 1.2x off), #2 1.17x (1.4x said)
    runs = {0: [Rerun(10, "ok", 119.0)], 1: [Rerun(11, "ok", 148.75)], 2: [Rerun(12, "ok", 139.23)]}
    assert confirm.suspicion(runs, searched, finalists=[1, 2], baseline=0, round_k=0) is None
    runs[0] = [Rerun(10, "ok", 125.0)]  # 1.25x its trial: #1 now 1.19x the baseline for 1.5x said
    got = confirm.suspicion(runs, searched, finalists=[1, 2], baseline=0, round_k=0)
    assert got.why.startswith("the baseline's re-run measured 1.25x its own search trial; #1 measured 1.19x")
    assert got.spread == pytest.approx(1.260504, abs=1e-6)  # #1: 1.5 / (148.75 / 125)
    assert confirm.suspicion(runs, searched, finalists=[1, 2], baseline=None, round_k=0) is None
    assert confirm.suspicion(runs, searched, finalists=[1, 2], baseline=0, round_k=1) is None  # no such round


def test_widen_takes_what_is_within_the_spread_of_a_finalist_fastest_first_capped():
    c = [
        Contender(0, 100.0, None, True),  # the baseline
        Contender(1, 200.0, None, True),
        Contender(2, 180.0, None, False),
        Contender(3, 130.0, None, False),
        Contender(4, 120.0, None, True),
        Contender(5, 110.0, None, False),
    ]
    # within 1.5x of the slower finalist (#2, 180): 120 and up
    assert confirm.widen(c, [1, 2], spread=1.5, exclude=[0], cap=4) == [1, 2, 3, 4]
    assert confirm.widen(c, [1, 2], spread=1.5, exclude=[0], cap=3) == [1, 2, 3]
    assert confirm.widen(c, [1, 2], spread=1.1, exclude=[0], cap=4) == [1, 2]
    assert confirm.widen(c, [1], spread=2.0, exclude=[0], cap=4) == [1, 2, 3, 4]


def test_schedule_rotates_so_no_config_always_runs_first():
    plan = confirm.schedule(["A", "B", "C"], "base", 5)
    assert plan == [
        ["A", "B", "C", "base"],
        ["B", "C", "base", "A"],
        ["C", "base", "A", "B"],
        ["base", "A", "B", "C"],
        ["A", "B", "C", "base"],
    ]
    assert {r[0] for r in plan[:4]} == {"A", "B", "C", "base"}
    assert confirm.schedule(["A"], None, 2) == [["A"], ["A"]]  # no baseline to pair with
    assert confirm.schedule([], None, 3) == [] and confirm.schedule(["A"], "b", 0) == []


# --------------------------------------------------------------------------- the figures
def test_log_interval_is_students_t_on_the_logs():
    ratio, ci = confirm.log_interval([1.2, 1.5, 1.4])
    assert ratio == 1.4
    # logs 0.18232, 0.40547, 0.33647: s = 0.11425; t(0.95, 2) = 2.920; half = 2.920 * 0.11425 / sqrt(3) = 0.19261
    # around the median's log 0.33647: exp(0.14386) = 1.1547, exp(0.52908) = 1.6974
    assert ci == pytest.approx((1.1547, 1.6974), abs=1e-4)
    assert confirm.log_interval([2.0]) == (2.0, None)  # one value: no interval
    assert confirm.log_interval([]) == (None, None)
    same, ci = confirm.log_interval([1.6, 1.6, 1.6])
    assert same == 1.6 and ci == pytest.approx((1.6, 1.6))


def test_paired_ratios_pair_the_same_round_and_skip_a_round_either_side_lost():
    runs = [Rerun(10, "ok", 300.0, 1.0), Rerun(13, "ok", 280.0, 1.1), Rerun(16, "oom", None, 2.0)]
    base = [Rerun(11, "ok", 200.0, 1.0), Rerun(14, "crash"), Rerun(17, "ok", 190.0, 0.9)]
    assert confirm.paired_ratios(runs, base) == [1.5]  # round 2: no baseline; round 3: the finalist OOMed
    e = confirm.summarize(3, runs, base)
    # one pair, no interval of its own on either run: the floor 0.045 each, half 1.6449 x 0.045 x sqrt(2) = 0.104681
    assert e["ratio"] == 1.5 and e["ratio_ci"] == pytest.approx([1.350918, 1.665534], abs=1e-6) and e["rounds"] == 1
    assert e["throughput"] == 290.0  # the median of the ok re-runs
    assert e["peak_memory_gb"] == 2.0  # the largest peak over the re-runs, the failed one included
    assert e["trials"] == [10, 13, 16] and e["failed"] == 1 and e["statuses"] == ["oom"]


def test_aggregate_holds_every_finalist_and_the_baseline():
    runs = {
        0: [Rerun(20, "ok", 100.0, 1.0), Rerun(23, "ok", 80.0, 1.0), Rerun(26, "ok", 90.0, 1.0)],
        4: [Rerun(21, "ok", 104.0, 2.0), Rerun(24, "ok", 84.0, 2.1), Rerun(27, "ok", 92.0, 2.0)],
        7: [Rerun(22, "ok", 103.0, 1.5), Rerun(25, "ok", 82.0, 1.5)],
    }
    agg = confirm.aggregate(baseline=0, finalists=[4, 7], rounds=3, headroom=0.1, runs=runs)
    assert agg["baseline"] == 0 and agg["rounds"] == 3 and agg["headroom"] == 0.1
    assert agg["complete"] is False and agg["rounds_run"] == 2  # #7 has two of round 3's re-runs missing one
    f4, f7 = agg["finalists"]
    # the figures come from the complete rounds: 1.04 and 1.05 (geometric mean 1.044988), 1.03 and 1.025
    assert f4["ratios"] == pytest.approx([1.04, 1.05]) and f4["ratio"] == pytest.approx(1.044988, abs=1e-6)
    lo, hi = f4["ratio_ci"]
    assert lo < 1.04 and hi > 1.05
    assert f7["ratios"] == pytest.approx([1.03, 1.025]) and f7["rounds"] == 2
    assert f4["throughput"] == 94.0 and f4["peak_memory_gb"] == 2.1
    assert agg["leader"] == 4 and agg["runner_up"] == 7 and not agg["separated"]
    b = agg["baseline_result"]
    assert b["number"] == 0 and b["ratio"] == 1.0 and b["throughput"] == 90.0 and b["rounds"] == 2
    runs[7].append(Rerun(28, "ok", 91.0, 1.5))
    done = confirm.aggregate(baseline=0, finalists=[4, 7], rounds=3, headroom=0.1, runs=runs)
    assert done["complete"] and done["rounds_run"] == 3 and not done["separated"]
    assert done["finalists"][0]["not_separated_from"] == "#7" and "not_separated_from" not in done["finalists"][1]


def _conf(entries, baseline_thr=100.0):
    base = {"number": 0, "ratio": 1.0, "ratio_ci": None, "ratios": [], "throughput": baseline_thr, "rounds": 3}
    base.update(throughput_ci=None, peak_memory_gb=3.0, trials=[1, 2, 3], failed=0, statuses=[])
    return {"baseline": 0, "rounds": 3, "complete": True, "finalists": entries, "baseline_result": base}


def _e(n, ratio, peak=2.0, failed=0, thr=None):
    return {
        "number": n,
        "ratio": ratio,
        "ratio_ci": None if ratio is None else [ratio - 0.1, ratio + 0.1],
        "ratios": [] if ratio is None else [ratio] * 3,
        "throughput": thr or (None if ratio is None else 100.0 * ratio),
        "throughput_ci": None,
        "peak_memory_gb": peak,
        "trials": [10 + n],
        "failed": failed,
        "statuses": ["oom"] if failed else [],
        "rounds": 3,
    }


def test_rank_confirmed_orders_by_ratio_and_leaves_out_what_cannot_be_recommended():
    conf = _conf([_e(3, 1.3), _e(5, 1.45, peak=9.5), _e(7, 1.5, failed=1), _e(8, 1.35), _e(9, 1.4)])
    ranked, left = confirm.rank_confirmed(conf, eligible=[0, 3, 5, 7, 8], limit_gb=9.0)
    assert [e["number"] for e in ranked] == [8, 3, 0]  # 1.35, 1.3, the baseline at 1.0
    why = dict(left)
    assert "9.50 GB" in why[5] and "oom" in why[7] and "not a feasible trial" in why[9]
    # the baseline beats every finalist: it is the pick
    ranked, _ = confirm.rank_confirmed(_conf([_e(3, 0.9)]), eligible=[0, 3], limit_gb=None)
    assert [e["number"] for e in ranked] == [0, 3]


def test_rank_confirmed_without_a_baseline_uses_the_confirmed_throughput():
    conf = {
        "baseline": None,
        "finalists": [_e(3, None, thr=120.0), _e(4, None, thr=150.0)],
        "baseline_result": None,
    }
    ranked, left = confirm.rank_confirmed(conf, eligible=[3, 4], limit_gb=None)
    assert [e["number"] for e in ranked] == [4, 3] and not left


def test_describe():
    e = {"number": 4, "ratio": 1.42, "ratio_ci": [1.31, 1.55], "ratios": [1.3, 1.42, 1.5], "rounds": 3}
    assert confirm.describe(e) == "1.42x the baseline (90% interval 1.31–1.55, 3 interleaved rounds)"
    one = {"number": 4, "ratio": 1.5, "ratio_ci": None, "ratios": [1.5], "rounds": 1}
    assert confirm.describe(one) == "1.50x the baseline (no interval from one round, 1 interleaved round)"
    base = {"number": 0, "ratio": 1.0, "ratio_ci": None, "ratios": [], "rounds": 3}
    assert confirm.describe(base) == "the baseline itself (1.00x; 3 interleaved rounds)"
    alone = {"number": 4, "ratio": None, "throughput": 812.3, "throughput_ci": [790.0, 840.5], "rounds": 3}
    assert confirm.describe(alone) == (
        "812.3 tokens/s/GPU (90% interval 790.0–840.5, median of 3 interleaved rounds; no baseline to pair with)"
    )


# --------------------------------------------------------------------------- the loop over a replay runner
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
GC = "actor_rollout_ref.model.enable_gradient_checkpointing"
SPACE = textwrap.dedent(f"""
    knobs:
      {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
      {GC}: {{type: bool, memory: decreasing}}
""")
# the search's trials in order; the baseline (the tiny config: micro-batch 2, no checkpointing) first
ORDER = [(2, False), (4, True), (1, False), (2, True), (1, True)]


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(SPACE)


def _table(space, flat, *, close: bool = False):
    """throughput 100 x micro-batch (x0.8 with checkpointing), peak 1 + micro-batch GB; (4, no GC) OOMs.
    ``close``: (4, GC), the fastest, only 2.5% faster than the baseline (2, no GC): the rounds go to their cap."""
    table = {}
    for i, cand in enumerate(space.grid(flat)):
        micro, gc = cand.params[MICRO], cand.params[GC]
        thr = None if micro == 4 and not gc else 100.0 * micro * (0.8 if gc else 1.0)
        if close and (micro, gc) == (4, True):
            thr = 205.0
        entry = Recorded(Status.OOM if thr is None else Status.OK, thr, None if thr is None else 1.0 + micro, 1.0, i)
        table[space.identity(cand.effective)] = [entry]
    return table


@dataclass
class InterruptsAt(ReplayRunner):
    """The replay runner, but its ``at``-th launch is stopped by the user (as Ctrl-C stops a real one)."""

    at: int = 0

    def run(self, request, stop):
        if self.launched + 1 == self.at:
            self.launched += 1
            stop.set()
            return TrialOutcome(Status.INTERRUPTED, TrialRecord(error="interrupted: the tuner was stopped"))
        return super().run(request, stop)


def _study(space, flat, *, device_gb):
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(
        storage=storage, directions=list(DIRECTIONS), sampler=build_sampler("grid", seed=0, n_trials=5)
    )
    study.set_user_attr("device", {"kind": "cpu", "name": "test", "memory_total_gb": device_gb})
    for i, (micro, gc) in enumerate(ORDER):
        params = space.to_params({MICRO: micro, GC: gc})
        study.enqueue_trial(params, user_attrs={"baseline": True} if i == 0 else {})
    return study, storage


def _search(setup, study, storage, runner, rounds=3):
    return search_over(setup, study, storage, runner, trials=len(ORDER), sampler="grid", confirm=rounds)


def _reruns(study):
    return [
        (t.number, TrialRecord.from_user_attrs(t.user_attrs))
        for t in study.get_trials()
        if TrialRecord.from_user_attrs(t.user_attrs).confirm_of is not None
    ]


def test_a_dominant_finalist_is_confirmed_in_one_round(setup):
    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)  # limit 9 GB: everything fits
    runner = ReplayRunner(_table(space, flat), rng=random.Random(0))
    _search(setup, study, storage, runner).run()
    # front: #1 (320 tokens/s at 5 GB), the baseline #0 (200 at 3), #2 (100 at 2); the baseline is no finalist.
    # Round 1: #1 runs 1.6x the baseline and #2 0.5x: #2 leaves the race, #1 separates from the baseline: done
    reruns = _reruns(study)
    assert [r.confirm_of for _, r in reruns] == [1, 2, 0]
    assert all(r.status == Status.OK and not r.counted for _, r in reruns)
    assert runner.launched == 5 + 3
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    assert conf["baseline"] == 0 and conf["rounds"] == 3 and conf["rounds_run"] == 1 and conf["complete"]
    assert conf["separated"] and conf["leader"] == 1 and conf["dropped"] == [2]
    a, b = conf["finalists"]
    assert (a["number"], b["number"]) == (1, 2)
    # one round, no interval of their own: half 1.6449 x 0.045 x sqrt(2) = 0.104681 around ln 1.6
    assert a["ratio"] == pytest.approx(1.6) and a["ratio_ci"] == pytest.approx([1.440979, 1.776570], abs=1e-6)
    assert b["ratio"] == pytest.approx(0.5) and b["rounds"] == 1 and b["peak_memory_gb"] == 2.0
    assert a["trials"] == [n for n, r in reruns if r.confirm_of == 1]
    assert conf["baseline_result"]["throughput"] == 200.0
    assert confirm.describe(a) == "1.60x the baseline (90% interval 1.44–1.78, 1 interleaved round)"


def test_close_finalists_are_re_run_interleaved_until_the_cap(setup):
    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)
    runner = ReplayRunner(_table(space, flat, close=True), rng=random.Random(0))
    _search(setup, study, storage, runner).run()
    # round 1: #1 #2 base; #2 (0.5x) leaves; #1 (1.025x) and the baseline, rotated: base #1 | #1 base
    assert [r.confirm_of for _, r in _reruns(study)] == [1, 2, 0, 0, 1, 1, 0]
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    assert conf["complete"] and conf["rounds_run"] == 3 and not conf["separated"]
    lead = conf["finalists"][0]
    assert lead["rounds"] == 3 and lead["ratio"] == pytest.approx(1.025)
    assert lead["not_separated_from"] == "the baseline"
    assert "; not separated from the baseline after 3 interleaved rounds)" in confirm.describe(lead)


def test_finalists_keep_the_export_headroom(setup):
    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=5.5)  # limit 4.95 GB: #1 (5 GB) is out
    _search(setup, study, storage, ReplayRunner(_table(space, flat)), rounds=2).run()
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    assert [e["number"] for e in conf["finalists"]] == [2]
    # the baseline leads #2 (0.5x) by far: one round separates them
    assert [r.confirm_of for _, r in _reruns(study)] == [2, 0] and conf["leader"] == 0 and conf["separated"]


def test_confirm_0_runs_nothing(setup):
    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)
    _search(setup, study, storage, ReplayRunner(_table(space, flat)), rounds=0).run()
    assert _reruns(study) == [] and confirm.CONFIRMATION_ATTR not in study.user_attrs


def test_an_interrupted_confirmation_resumes_where_it_stopped(setup):
    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)
    # the 5 search trials, then re-runs 1 2 0 | 0 ...: the 4th re-run (the baseline, round 2) is stopped mid-trial
    first = _search(setup, study, storage, InterruptsAt(_table(space, flat, close=True), at=5 + 4))
    first.run()
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    assert not conf["complete"]  # what was measured so far is stored, marked incomplete
    reruns = _reruns(study)
    assert [(r.confirm_of, r.status) for _, r in reruns] == [
        (1, Status.OK),
        (2, Status.OK),
        (0, Status.OK),
        (0, Status.INTERRUPTED),
        (0, None),  # enqueued again, waiting
    ]
    # the same search again: the retry first, then the rest of round 2 and round 3; nothing redone
    again = _search(setup, study, storage, ReplayRunner(_table(space, flat, close=True)))
    again.run()
    done = [(n, r.confirm_of) for n, r in _reruns(study) if r.status == Status.OK]
    assert [c for _, c in done] == [1, 2, 0, 0, 1, 1, 0]
    assert again.session.runner.launched == 4 and sum(1 for _, r in _reruns(study) if r.status is None) == 0
    retry = [r for _, r in _reruns(study) if r.retry_of is not None]
    assert len(retry) == 1 and retry[0].confirm_of == 0 and retry[0].status == Status.OK
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    assert conf["complete"] and [e["rounds"] for e in conf["finalists"]] == [3, 1]
    assert math.isclose(conf["finalists"][0]["ratio"], 1.025)


@dataclass
class Clocked(ReplayRunner):
    """The replay runner on a fake clock: every launch takes 10 s of it."""

    now: float = 0.0

    def monotonic(self) -> float:
        return self.now

    def run(self, request, stop):
        self.now += 10.0
        return super().run(request, stop)


class Said:
    def __init__(self):
        self.messages: list[str] = []

    def trial_done(self, event) -> None:
        pass

    def message(self, text: str) -> None:
        self.messages.append(text)


def test_timeout_bounds_the_confirmation_too(setup, monkeypatch):
    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)
    runner, said = Clocked(_table(space, flat, close=True)), Said()
    monkeypatch.setattr("tuner.search.budget.time", type("Clock", (), {"monotonic": staticmethod(runner.monotonic)}))
    search = search_over(
        setup, study, storage, runner, trials=len(ORDER), sampler="grid", confirm=3, timeout_s=85.0, observer=said
    )
    search.budget.started = 0.0
    search.run()
    # 5 search trials (0-50 s), then re-runs while the clock is not past 85 s: at 50, 60, 70 and 80 s
    assert len(_reruns(study)) == 4 and runner.now == 90.0
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    assert not conf["complete"]  # what was measured is stored, marked incomplete
    assert any("confirm: --timeout 85 s reached" in m for m in said.messages)


def test_the_confirmation_stage_runs_on_its_own_over_a_finished_study(setup):
    """A stage takes a study and a runner (through the study's session): a search done without --confirm is
    confirmed afterwards exactly as the search would have (the same interleaved re-runs), and the worst-case
    stage's plan then puts the confirmed finalists first."""
    from tuner.search.confirmation import ConfirmationStage
    from tuner.search.worst_case import WorstCaseStage

    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)
    search = _search(setup, study, storage, ReplayRunner(_table(space, flat), rng=random.Random(0)), rounds=0)
    search.run()
    assert _reruns(study) == []
    ConfirmationStage(search.session).run(3)
    assert [r.confirm_of for _, r in _reruns(study)] == [1, 2, 0]  # #1 separates in one round
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    assert conf["complete"] and [e["number"] for e in conf["finalists"]] == [1, 2]
    # the confirmed ranking: #1 (1.6x the baseline), the baseline (1.0x), #2 (0.5x)
    assert WorstCaseStage(search.session).plan(3) == [1, 0, 2]


def test_the_stage_takes_the_run_to_run_noise_of_the_search_trials_and_their_re_runs(setup):
    """Each config recorded twice, 15% apart (within what a single trial may be off by: none is suspect): the stored
    ``run_noise`` is the pooled scatter of the finalists' and
    the baseline's search trials with their re-runs (tuner.rules.race.repeat_noise), widened by Student's t for its
    degrees of freedom, above the floor."""
    from tuner.search.confirmation import ConfirmationStage

    space, _, flat = setup
    table = {
        ident: [
            rs[0],
            Recorded(rs[0].status, rs[0].throughput and 1.15 * rs[0].throughput, rs[0].peak_memory_gb, 1.0, 99),
        ]
        for ident, rs in _table(space, flat).items()
    }
    study, storage = _study(space, flat, device_gb=10.0)
    # seed 1: some re-runs draw the other repeat than their search trial did (seed 0 draws the same: the floor)
    search = _search(setup, study, storage, ReplayRunner(table, rng=random.Random(1)), rounds=0)
    search.run()
    ConfirmationStage(search.session).run(1)
    conf = study.user_attrs[confirm.CONFIRMATION_ATTR]
    trials = study.get_trials()
    members = [e["number"] for e in conf["finalists"]] + [conf["baseline"]]
    groups = [
        [
            Rerun(t.number, "ok", t.user_attrs["throughput"])
            for t in trials
            if n in (t.number, t.user_attrs.get("confirm_of"))
        ]
        for n in members
    ]
    assert all(len(g) == 2 for g in groups)
    noise = repeat_noise(groups, widened=True)
    assert conf["run_noise"] == pytest.approx(noise, abs=1e-6) and conf["run_noise"] > RUN_NOISE_FLOOR


def test_the_searchs_pick_and_headroom_decide_what_is_confirmed_and_probed(setup):
    """``ppotune search --memory-headroom F --pick P`` (a :class:`tuner.study.selection.Selection`): the finalists
    keep F free, and the probes follow P's order, as export will take them."""
    from tuner.search.confirmation import ConfirmationStage
    from tuner.search.worst_case import WorstCaseStage
    from tuner.study.selection import Selection

    space, _, flat = setup
    study, storage = _study(space, flat, device_gb=10.0)
    search = _search(setup, study, storage, ReplayRunner(_table(space, flat), rng=random.Random(0)), rounds=0)
    search.run()
    # the trials: #0 the baseline (200 tokens/s, 3 GB), #1 (320, 5), #2 (100, 2), #3 (160, 3), #4 (80, 2)
    assert ConfirmationStage(search.session).plan(1, finalists=3)[0] == [1, 2]  # 10% of 10 GB free: all fit
    assert ConfirmationStage(search.session).plan(1, finalists=1)[0] == [1]  # --finalists 1: the pick's first choice
    assert ConfirmationStage(search.session, selection=Selection(headroom=0.55)).plan(1)[0] == [2]  # #1 is over
    assert WorstCaseStage(search.session).plan(2) == [1, 0]  # the fastest first
    assert WorstCaseStage(search.session, selection=Selection(pick="min-memory")).plan(2) == [2, 4]
