"""When a search process stops: ``--trials`` counted over every worker of the study, ``--timeout`` with the
after-search stages' share of it kept free. The rules themselves are pure (:mod:`tuner.search.decide`); this is
their clock and the options they read.

And when it stops because it cannot work (:class:`FailureRule`, a :class:`Halt`): the baseline trial failed (a
crash, a config the trainer refused, a hang: every other trial runs the same inputs), or
``--max-failures-in-a-row`` launched trials in a row failed with the same error. Such a search ends at once with
the reason, never "done"."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from optuna.trial import TrialState

from trainer.contracts import ExitCode, Status
from tuner.search import decide
from tuner.stages.confirm import DEFAULT_FINALISTS
from tuner.study import lifecycle as st

__all__ = [
    "Budget",
    "MAX_FAILURES_IN_A_ROW",
    "BASELINE_FAILED",
    "Halt",
    "FailureRule",
    "error_signature",
]

MAX_FAILURES_IN_A_ROW = 3  # launched trials in a row failing with the same error before the search stops


@dataclass
class Budget:
    """The budget of one search process: ``trials`` counted trials in the study (all processes together),
    no new run after ``timeout_s`` seconds, of which the confirmation's ``confirm`` rounds of up to ``finalists``
    finalists and the baseline, and the ``probe`` worst-case probes, keep their estimated share
    (:func:`tuner.search.decide.after_search_s`)."""

    trials: int
    timeout_s: Optional[float] = None
    confirm: int = 0
    finalists: int = DEFAULT_FINALISTS
    probe: int = 0
    started: float = field(default_factory=time.monotonic)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def stop_reason(self, trials: list) -> Optional[str]:
        """Why the search takes no further trial (:func:`tuner.search.decide.search_stop_reason`), or None."""
        return decide.search_stop_reason(
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
        return decide.after_search_s(trials, runs=reruns + self.probe, timeout_s=self.timeout_s)

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
        if decide.count_progress(trials) < self.trials or self.over_timeout():
            return False
        return any(t.state == TrialState.RUNNING and decide.counted(t) and not st.owned_here(t) for t in trials)

    def taken_by_others(self, trials: list, number: int, *, counted: bool) -> bool:
        """Did another worker take the budget's last slot as trial ``number`` was asked? (Possible only
        without a cross-process lock: the gRPC proxy, MySQL; checked always, so workers on one study may mix
        storages.) A ``--confirm`` re-run (not ``counted``) is outside the budget."""
        return counted and decide.over_budget(trials, number, budget=self.trials)


# --------------------------------------------------------------------------- a search that cannot work
#: launched trials that failed without teaching the sampler anything (FAIL in Optuna): a streak of these counts
_FAILED = (Status.CRASH, Status.INVALID)
#: what the baseline must not end in: every other trial runs the same model, data and environment
BASELINE_FAILED = (Status.CRASH, Status.INVALID, Status.HANG)
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Halt:
    """Why a search stopped because it cannot work: one line, and whether the user's input is the cause
    (a config the trainer refused: exit 2) or not (exit 1)."""

    reason: str
    user_input: bool

    @property
    def exit_code(self) -> int:
        return ExitCode.USAGE if self.user_input else ExitCode.ERROR


def error_signature(status: Status, error: Optional[str]) -> str:
    """What makes two failures "the same error": the status and the error's first clause (its first line up to
    ``; ``: the launcher joins the cause and what the other ranks said after it, which varies with who noticed
    first) with its numbers blanked (a rank, a trial number or a size differ between trials that fail alike)."""
    first = (str(error or "").strip().splitlines() or [""])[0].split("; ")[0]
    return f"{status}: {_DIGITS.sub('#', first)[:300]}"


def _first_line(error: Optional[str]) -> str:
    line = (str(error or "").strip().splitlines() or ["no error recorded"])[0]
    return line if len(line) <= 300 else line[:300] + "..."


class FailureRule:
    """Watches the trials this process finished (thread-safe) and says when the search must stop: the baseline
    failed, or ``max_in_a_row`` launched trials in a row failed with the same :func:`error_signature`
    (0: never for a streak). Trials rejected before launch and ``--confirm`` re-runs are not watched."""

    def __init__(self, max_in_a_row: int = MAX_FAILURES_IN_A_ROW):
        self.max_in_a_row = max_in_a_row
        self._lock = threading.Lock()
        self._streak: tuple[Optional[str], int] = (None, 0)

    def seen(
        self, *, number: int, status: Status, error: Optional[str], launched: bool, baseline: bool
    ) -> Optional[Halt]:
        """One finished trial; a :class:`Halt` when the search must stop now."""
        if not launched:
            return None
        user_input = status is Status.INVALID
        if baseline and status in BASELINE_FAILED:
            hint = (
                " (raise --step-timeout/--trial-timeout if the base config is only slow)"
                if status is Status.HANG
                else ""
            )
            return Halt(
                f"the baseline trial #{number} (the base config as written) ended {status}: {_first_line(error)}; "
                f"every other trial runs the same model, data and environment: the search stops here{hint}",
                user_input,
            )
        with self._lock:
            if status not in _FAILED:
                self._streak = (None, 0)
                return None
            sig = error_signature(status, error)
            last, n = self._streak
            n = n + 1 if sig == last else 1
            self._streak = (sig, n)
        if self.max_in_a_row and n >= self.max_in_a_row:
            return Halt(
                f"{n} trials in a row (the last #{number}) ended {status} with the same error: {_first_line(error)} "
                f"(--max-failures-in-a-row {self.max_in_a_row})",
                user_input,
            )
        return None
