"""The budget's rules, pure: which trials count toward ``--trials``, when a search process stops asking, the share of
``--timeout`` the after-search stages keep, a trial asked past the budget by a race between workers; and when a
search stops because it cannot work (:class:`FailureRule`, a :class:`Halt`): the baseline trial failed (a crash, a
config the trainer refused, a hang: every other trial runs the same inputs), or ``--max-failures-in-a-row`` launched
trials in a row failed with the same error. Such a search ends at once with the reason, never "done".

The clock that reads them is :class:`tuner.search.budget.Budget`.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Iterable, Optional

from optuna.trial import FrozenTrial, TrialState

from trainer.contracts import ExitCode, Status, TrialRecord, undersized

__all__ = [
    "counted",
    "count_progress",
    "search_stop_reason",
    "after_search_s",
    "over_budget",
    "MAX_FAILURES_IN_A_ROW",
    "BASELINE_FAILED",
    "Halt",
    "FailureRule",
    "error_signature",
]

_IN_STUDY = (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING)
MAX_FAILURES_IN_A_ROW = 3  # launched trials in a row failing with the same error before the search stops


# --------------------------------------------------------------------------- the budget
def counted(t: FrozenTrial) -> bool:
    """Does this trial count toward ``--trials``? Finished or running trials, except interrupted
    ones (their retry counts), what was rejected before launch (duplicates, inferred OOMs, invalid
    configs at 0 s) and ``--confirm`` re-runs (:attr:`TrialRecord.counted`)."""
    return t.state in _IN_STUDY and TrialRecord.from_user_attrs(t.user_attrs).counted


def count_progress(trials: Iterable[FrozenTrial]) -> int:
    return sum(1 for t in trials if counted(t))


def search_stop_reason(
    trials: list[FrozenTrial],
    *,
    budget: int,
    elapsed_s: float,
    timeout_s: Optional[float],
    reserve_s: float = 0.0,
) -> Optional[str]:
    """Why this search process should ask no more trials (None: go on): the budget or the timeout. ``reserve_s``:
    the part of ``timeout_s`` kept for the confirmation and the probes (:func:`after_search_s`). Proposals rejected
    before launch never stop a search: when the sampler stalls the search proposes itself (:mod:`tuner.search.stall`),
    until every config is measured or ruled out."""
    if count_progress(trials) >= budget:
        return f"the study holds {budget} counted trials"
    if timeout_s is not None and elapsed_s > timeout_s - reserve_s:
        if reserve_s > 0:
            return f"--timeout {timeout_s:g} s: ~{reserve_s:.0f} s of it left for the confirmation and the probes"
        return f"--timeout {timeout_s:g} s reached"
    return None


def after_search_s(trials: Iterable[FrozenTrial], *, runs: int, timeout_s: float) -> float:
    """How much of ``timeout_s`` the search leaves for ``runs`` trials after it (the confirmation's
    re-runs and the worst-case probes): that many times the median duration of the search's measured
    trials, at most half of ``timeout_s`` (the search itself keeps the other half); 0 before any trial
    was measured or without runs."""
    if runs <= 0:
        return 0.0
    durations = sorted(
        rec.duration_s
        for rec in (TrialRecord.from_user_attrs(t.user_attrs) for t in trials if t.state.is_finished())
        if rec.status == Status.OK and rec.confirm_of is None and rec.duration_s
    )
    if not durations:
        return 0.0
    return min(runs * durations[len(durations) // 2], timeout_s / 2)


def over_budget(trials: Iterable[FrozenTrial], number: int, *, budget: int) -> bool:
    """Was trial ``number`` (just asked, RUNNING) asked past ``budget`` by a race with another worker?

    For storages with no cross-process lock (the gRPC proxy, MySQL). The storage numbers trials
    in creation order under its own lock (a row lock on the study in an RDB), so the trials
    numbered below ours existed when ours was made. Ours is over the budget when ``budget`` of
    them count or may still count: counted ones (running or finished) and waiting ones that
    will count once popped (an enqueued retry holds its slot). A trial that was uncounted at
    the check (interrupted, duplicate, over budget, a ``--confirm`` re-run) never counts later;
    a waiting one does, and it is included. So every counted trial saw fewer than ``budget``
    counted-or-reserved trials below it: the counted total never exceeds ``budget``.
    """
    below = 0
    for t in trials:
        if t.number >= number:
            continue
        if counted(t) or (t.state == TrialState.WAITING and TrialRecord.from_user_attrs(t.user_attrs).counted):
            below += 1
    return below >= budget


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
        if not launched or undersized(error):  # one knob's value too small (vLLM's share): other values run
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
