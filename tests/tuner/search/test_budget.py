"""The search's budget (tuner.search.budget) alone, with no process."""

from __future__ import annotations

from tests.tuner.rules.test_candidates import frozen


def test_the_budget_alone(monkeypatch):
    from tuner.search.budget import Budget

    clock = [1000.0]
    monkeypatch.setattr("tuner.search.budget.time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    budget = Budget(trials=3, timeout_s=100.0, confirm=1, finalists=3, probe=1, started=clock[0])
    ok = [frozen(i, "ok", {}, duration_s=10.0) for i in range(2)]
    # 1 confirmation round (at most 3 finalists + the baseline) and 1 probe: 5 runs of the median 10 s kept
    assert budget.reserve_s(ok) == 50.0 and budget.stop_reason(ok) is None
    assert Budget(trials=3, timeout_s=100.0, confirm=2, finalists=1, probe=0).reserve_s(ok) == 40.0  # 2 x (1 + 1)
    clock[0] += 60.0
    assert budget.stop_reason(ok).startswith("--timeout 100 s")
    said = []
    assert not budget.past_timeout("confirm", said.append) and said == []
    clock[0] += 50.0
    assert budget.past_timeout("confirm", said.append) and said == [
        "confirm: --timeout 100 s reached; no further run started"
    ]
    assert budget.stop_reason([*ok, frozen(2, "ok", {})]) is not None
    assert not budget.taken_by_others(ok, 2, counted=False)  # a --confirm re-run is outside the budget
