"""The points a trial may be pruned against (pure, over recorded trials)."""

import optuna
from optuna.distributions import IntDistribution

from trainer.contracts import Status, TrialRecord
from tuner.search.fidelity import front_points, with_front


def _trial(number, status, thr=None, mem=None, ci=None, constraint=None):
    rec = TrialRecord(status=status, throughput=thr, peak_memory_gb=mem, throughput_ci=ci, constraint=constraint)
    t = optuna.trial.create_trial(
        params={"x": number},
        distributions={"x": IntDistribution(0, 100)},
        values=[thr or 0.0, mem or 9.0],
        user_attrs=rec.to_user_attrs(),
    )
    t.number = number
    return t


def test_front_uses_the_lower_end_of_the_interval_and_drops_dominated_and_infeasible_points():
    trials = [
        _trial(0, Status.OK, 100.0, 1.0, ci=[90.0, 110.0]),
        _trial(1, Status.OK, 120.0, 2.0),  # no interval: its median
        _trial(2, Status.OK, 80.0, 1.5, ci=[70.0, 90.0]),  # beaten by 0: more memory, less throughput
        _trial(3, Status.OOM),
        _trial(4, Status.OK, 500.0, 9.0, constraint=0.2),  # over the limit
    ]
    assert front_points(trials) == [[1, 120.0, 2.0], [0, 90.0, 1.0]]


def test_with_front_copies():
    cfg = {"ppotune": {"precision": 0.05}}
    out = with_front(cfg, [[1, 2.0, 3.0]])
    assert out["ppotune"]["front"] == [[1, 2.0, 3.0]] and "front" not in cfg["ppotune"]
