"""When a search process stops: ``--trials`` counted over every worker of the study, ``--timeout`` with the
after-search stages' share of it kept free. The rules themselves are pure (:mod:`tuner.rules.budget`, with the
rule that stops a search that cannot work); this is their clock and the options they read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from optuna.trial import TrialState

from tuner.rules.budget import after_search_s, count_progress, counted, over_budget, search_stop_reason
from tuner.rules.finalists import DEFAULT_FINALISTS
from tuner.study import lifecycle as st

__all__ = ["Budget"]


@dataclass
class Budget:
    """The budget of one search process: ``trials`` counted trials in the study (all processes together),
    no new run after ``timeout_s`` seconds, of which the confirmation's ``confirm`` rounds of up to ``finalists``
    finalists and the baseline, and the ``probe`` worst-case probes, keep their estimated share
    (:func:`tuner.rules.budget.after_search_s`)."""

    trials: int
    timeout_s: Optional[float] = None
    confirm: int = 0
    finalists: int = DEFAULT_FINALISTS
    probe: int = 0
    started: float = field(default_factory=time.monotonic)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def stop_reason(self, trials: list) -> Optional[str]:
        """Why the search takes no further trial (:func:`tuner.rules.budget.search_stop_reason`), or None."""
        return search_stop_reason(
            trials,
            budget=self.trials,
            elapsed_s=self.elapsed_s(),
            timeout_s=self.timeout_s,
            reserve_s=self.reserve_s(trials),
        )

    def reserve_s(self, trials: list) -> float:
        """Seconds of ``--timeout`` kept for the confirmation's re-runs and the worst-case probes."""
        if self.timeout_s is None:
            return 0.0
        reruns = self.confirm * (self.finalists + 1)
        return after_search_s(trials, runs=reruns + self.probe, timeout_s=self.timeout_s)

    def over_timeout(self) -> bool:
        return self.timeout_s is not None and self.elapsed_s() > self.timeout_s

    def past_timeout(self, what: str, say: Callable[[str], None]) -> bool:
        """True (and said) when ``--timeout`` has passed: ``what`` starts no further run."""
        if not self.over_timeout():
            return False
        say(f"{what}: --timeout {self.timeout_s:g} s reached; no further run started")
        return True

    def others_still_running(self, trials: list) -> bool:
        """The budget is reached counting trials other workers still run: wait for them (if one's
        worker dies, its trial is swept and re-enqueued, and this worker runs the retry)."""
        if count_progress(trials) < self.trials or self.over_timeout():
            return False
        return any(t.state == TrialState.RUNNING and counted(t) and not st.owned_here(t) for t in trials)

    def taken_by_others(self, trials: list, number: int, *, counted: bool) -> bool:
        """Did another worker take the budget's last slot as trial ``number`` was asked? (Possible only
        without a cross-process lock: the gRPC proxy, MySQL; checked always, so workers on one study may mix
        storages.) A ``--confirm`` re-run (not ``counted``) is outside the budget."""
        return counted and over_budget(trials, number, budget=self.trials)
