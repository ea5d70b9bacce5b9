"""How long a confirmation goes on (tuner.rules.race): its interval by hand, and the rounds it asks for."""

from __future__ import annotations

import pytest

from tuner.rules import finalists as confirm
from tuner.rules.race import RUN_NOISE_FLOOR, Rerun, paired_interval, race, repeat_noise, run_noise, t90


def ok(number: int, thr: float, ci=None, *, loaded: bool = False) -> Rerun:
    return Rerun(number, "ok", thr, 1.0, ci, loaded)


# --------------------------------------------------------------------------- the interval
def test_one_round_has_an_interval_from_the_runs_own_noise():
    a, b = ok(1, 150.0, (140.0, 160.0)), ok(2, 100.0, (95.0, 105.0))
    # each run's 90% interval as a log-sd: ln(160/140) / 2 / 1.6449 = 0.040590, ln(105/95) / 2 / 1.6449 = 0.030422
    assert run_noise(a) == pytest.approx(0.040590, abs=1e-6) and run_noise(b) == pytest.approx(0.030422, abs=1e-6)
    # the ratio's: sqrt(0.040590^2 + 0.030422^2) = 0.050726; half 1.6449 x 0.050726 = 0.083439 around ln 1.5
    assert paired_interval([(a, b)], noise_floor=0.01) == pytest.approx((1.5, 1.379923, 1.630526), abs=1e-6)
    # a floor above a run's own noise lifts it: 0.035 for b, sqrt(0.040590^2 + 0.035^2) = 0.053595, half 0.088160
    assert paired_interval([(a, b)], noise_floor=0.035) == pytest.approx((1.5, 1.373422, 1.638244), abs=1e-6)


def test_more_rounds_take_the_larger_of_the_runs_noise_and_the_rounds_scatter():
    # no interval of their own: the floor, 0.05 each, so sd of the mean sqrt(8 x 0.0025 / 16) = 0.035355, half
    # 1.6449 x 0.035355 = 0.058156; four rounds' logs (mean 0.202833) scatter less: sd of the mean 0.008498, half
    # t90(3) x 0.008498 = 0.019999. The runs' noise decides
    close = [(ok(2 * k + 1, thr), ok(2 * k + 2, 100.0)) for k, thr in enumerate((120.0, 125.0, 122.0, 123.0))]
    assert paired_interval(close, noise_floor=0.05) == pytest.approx((1.224867, 1.155666, 1.298213), abs=1e-6)
    # logs 0.405465 and 0: their scatter (sd of the mean 0.202733) is larger and decides, on Student's t for its one
    # degree of freedom: half 6.3138 x 0.202733 = 1.280016 around 0.202733
    apart = [(ok(1, 150.0), ok(2, 100.0)), (ok(3, 100.0), ok(4, 100.0))]
    assert paired_interval(apart, noise_floor=0.05) == pytest.approx((1.224745, 0.340520, 4.405022), abs=1e-6)
    # a pair with a failed run is no pair; none at all: no interval
    assert paired_interval([(Rerun(1, "oom"), ok(2, 100.0))]) is None and paired_interval([]) is None


def test_the_run_to_run_noise_is_pooled_over_the_configs_run_more_than_once():
    # logs within a config around their mean: ln(110/100)^2 / 2 = 0.004542 and ln(200/180)^2 / 2 = 0.005550,
    # one degree of freedom each: sqrt((0.004542 + 0.005550) / 2) = 0.071037
    assert repeat_noise([[ok(0, 100.0), ok(1, 110.0)], [ok(2, 200.0), ok(3, 180.0)]]) == pytest.approx(0.071037, 1e-5)
    # one run each, a failed run, a run under load (its scatter is the load's): nothing measured
    assert repeat_noise([[ok(0, 100.0)], [Rerun(1, "oom"), ok(2, 100.0)]]) is None
    assert repeat_noise([[ok(0, 100.0), ok(1, 150.0, loaded=True)]]) is None
    # widened for its 2 degrees of freedom: times t90(2) / z = 2.9200 / 1.6449
    widened = repeat_noise([[ok(0, 100.0), ok(1, 110.0)], [ok(2, 200.0), ok(3, 180.0)]], widened=True)
    assert widened == pytest.approx(0.071037 * 2.9200 / 1.6449, 1e-4)


def test_t90_is_students_t_95_percent_point():
    assert [t90(d) for d in (1, 2, 3, 10, 30)] == [6.3138, 2.92, 2.3534, 1.8125, 1.6973]
    assert t90(60) == pytest.approx(1.6706, abs=2e-3) and t90(10_000) == pytest.approx(1.6449, abs=1e-3)
    assert all(t90(d) > t90(d + 1) for d in range(1, 100))
    with pytest.raises(ValueError):
        t90(0)


def test_the_interval_carries_the_run_to_run_noise_the_search_trials_and_rounds_show():
    # each run's own interval is narrow (under the floor); the finalist's search trial read 180, its re-run 150,
    # the baseline 100 both times: pooled sqrt((ln(1.2)^2 / 2 + 0) / 2) = 0.091161 on 2 degrees of freedom, widened
    # by t/z = 2.9200 / 1.6449 to 0.161827, above the floor
    runs = {1: [ok(10, 150.0, (148.0, 152.0))], 0: [ok(11, 100.0, (99.0, 101.0))]}
    searched = {1: ok(1, 180.0), 0: ok(0, 100.0)}
    assert race(runs, finalists=[1], baseline=0, rounds=1).noise == RUN_NOISE_FLOOR  # no search trials: the floor
    state = race(runs, finalists=[1], baseline=0, rounds=1, searched=searched)
    assert state.noise == pytest.approx(0.161827, abs=1e-6) and state.done and state.separated
    # the ratio's sd sqrt(2) x 0.161827 = 0.228857, half 1.6449 x 0.228857 = 0.376447 around ln 1.5
    conf = confirm.aggregate(baseline=0, finalists=[1], rounds=1, headroom=0.1, runs=runs, searched=searched)
    assert conf["run_noise"] == pytest.approx(0.161827, abs=1e-6)
    assert conf["finalists"][0]["ratio_ci"] == pytest.approx([1.029441, 2.185651], abs=1e-6)
    # without the search trials: the floor 0.045 for both runs, half 1.6449 x 0.063640 = 0.104682
    conf = confirm.aggregate(baseline=0, finalists=[1], rounds=1, headroom=0.1, runs=runs)
    assert conf["run_noise"] == RUN_NOISE_FLOOR
    assert conf["finalists"][0]["ratio_ci"] == pytest.approx([1.350918, 1.665534], abs=1e-6)


# --------------------------------------------------------------------------- the rounds
def test_a_dominant_finalist_stops_after_one_round_and_the_slow_one_leaves():
    runs = {1: [ok(10, 150.0, (140.0, 160.0))], 2: [ok(11, 80.0, (75.0, 85.0))], 0: [ok(12, 100.0, (95.0, 105.0))]}
    state = race(runs, finalists=[1, 2], baseline=0, rounds=3)
    assert state.rounds == 1 and state.clean == [0] and state.done and state.separated
    assert state.leader == 1 and state.runner_up == 0 and state.dropped == [2]  # 0.53x #1: wholly below it
    conf = confirm.aggregate(baseline=0, finalists=[1, 2], rounds=3, headroom=0.1, runs=runs, noise_floor=0.01)
    lead = conf["finalists"][0]
    assert conf["complete"] and conf["rounds_run"] == 1 and conf["separated"] and lead["separated"]
    assert confirm.describe(lead) == "1.50x the baseline (90% interval 1.38–1.63, 1 interleaved round)"


def _close(rounds: int, loaded_round: int = -1) -> dict:
    """Two finalists 3% and 1% faster than the baseline, round after round (no interval of their own)."""
    runs = {1: [], 2: [], 0: []}
    for k in range(rounds):
        for n, thr in ((1, 103.0), (2, 101.0), (0, 100.0)):
            runs[n].append(ok(10 * k + n, thr, loaded=(k == loaded_round and n == 0)))
    return runs


def test_close_finalists_run_to_the_cap_and_the_claim_says_they_did_not_separate():
    state = race(_close(1), finalists=[1, 2], baseline=0, rounds=3)
    assert state.rounds == 1 and not state.done and state.members(0) == [2, 0, 1]  # rotated for round 2
    state = race(_close(3), finalists=[1, 2], baseline=0, rounds=3)
    assert state.done and not state.separated and state.why == "not separated after 3 rounds"
    assert state.leader == 1 and state.runner_up == 2 and not state.dropped
    conf = confirm.aggregate(baseline=0, finalists=[1, 2], rounds=3, headroom=0.1, runs=_close(3))
    lead = conf["finalists"][0]
    assert lead["not_separated_from"] == "#2" and lead["ratio"] == pytest.approx(1.03)
    assert confirm.describe(lead).endswith("3 interleaved rounds; not separated from #2 after 3 interleaved rounds)")


def test_a_round_under_load_is_not_claimed_from_and_another_is_run():
    state = race(_close(3, loaded_round=1), finalists=[1, 2], baseline=0, rounds=3)
    assert state.loaded == [1] and state.clean == [0, 2] and not state.done  # a fourth round replaces it
    state = race(_close(4, loaded_round=1), finalists=[1, 2], baseline=0, rounds=3)
    assert state.done and state.clean == [0, 2, 3]
    conf = confirm.aggregate(baseline=0, finalists=[1, 2], rounds=3, headroom=0.1, runs=_close(4, loaded_round=1))
    lead = conf["finalists"][0]
    assert conf["loaded_rounds"] == 1 and lead["rounds"] == 3 and lead["loaded_rounds"] == 1
    assert "; 1 round under load, not claimed from)" in confirm.describe(lead)
    # every round under load: each is run again, the cap's worth of them; one more ends it, claiming nothing
    runs = {n: [ok(10 * k + n, 100.0, loaded=True) for k in range(3)] for n in (1, 0)}
    assert not race(runs, finalists=[1], baseline=0, rounds=3).done
    runs = {n: [ok(10 * k + n, 100.0, loaded=True) for k in range(4)] for n in (1, 0)}
    state = race(runs, finalists=[1], baseline=0, rounds=3)
    assert state.done and state.why == "4 rounds under load" and not state.clean
    entry = confirm.aggregate(baseline=0, finalists=[1], rounds=3, headroom=0.1, runs=runs)["finalists"][0]
    assert entry["ratio"] is None and entry["throughput"] is None
    assert confirm.describe(entry) == (
        "not confirmed (no re-run measured without load; 4 rounds under load, not claimed from)"
    )


def test_with_confirm_1_rounds_under_load_are_run_again_twice():
    """``--confirm 1``: the rounds measured under load do not end the confirmation (they claimed nothing): two are
    run again (MIN_LOADED_RERUNS), a third ends it; a clean one ends it with its claim."""
    runs = {n: [ok(10 * k + n, 100.0, loaded=True) for k in range(2)] for n in (1, 0)}
    assert not race(runs, finalists=[1], baseline=0, rounds=1).done
    runs = {n: [ok(10 * k + n, 100.0, loaded=True) for k in range(3)] for n in (1, 0)}
    assert race(runs, finalists=[1], baseline=0, rounds=1).why == "3 rounds under load"
    conf = confirm.aggregate(baseline=0, finalists=[1], rounds=1, headroom=0.1, runs=runs)
    assert confirm.rounds_text(conf) == (
        "3 rounds (1 asked, the ones under load run again), 3 under load (not claimed from): "
        "the leader did not separate"
    )
    runs = {n: [ok(10 + n, 100.0, loaded=True), ok(20 + n, 150.0 if n else 100.0)] for n in (1, 0)}
    state = race(runs, finalists=[1], baseline=0, rounds=1)
    assert state.done and state.clean == [1] and state.loaded == [0] and state.leader == 1


def test_a_finalist_whose_rerun_failed_leaves_the_race():
    runs = {1: [ok(10, 103.0)], 2: [Rerun(11, "oom", None, 2.0)], 0: [ok(12, 100.0)]}
    state = race(runs, finalists=[1, 2], baseline=0, rounds=3)
    assert state.dropped == [2] and state.active == [1] and state.runner_up == 0
    assert not state.done and state.members(0) == [0, 1]  # #1 against the baseline alone, rotated


def test_a_single_finalist_separates_from_one():
    runs = {1: [ok(10, 99.0)], 0: [ok(11, 100.0)]}
    state = race(runs, finalists=[1], baseline=0, rounds=2)
    assert state.leader == 0 and state.runner_up == 1 and not state.separated and not state.done
    runs = {1: [ok(10, 99.0), ok(12, 100.5)], 0: [ok(11, 100.0), ok(13, 100.0)]}
    state = race(runs, finalists=[1], baseline=0, rounds=2)
    assert state.done and not state.separated and state.why == "not separated after 2 rounds"
    assert race({}, finalists=[], baseline=0, rounds=2).done  # nothing to confirm
