"""The confirmation stage: the finalists re-run side by side with the baseline (rules: :mod:`tuner.rules.finalists`).

Runs after a search, or on its own over a study whose search is done (``ppotune search --confirm R`` on a study
that already holds its ``--trials``): it takes the study's session (:class:`tuner.search.session.TrialSession`:
the study, its lock and the runner) and stores the aggregate in the study attribute ``confirmation``.
"""

from __future__ import annotations

from typing import Optional

from optuna.trial import TrialState

from trainer.contracts import Status, TrialRecord
from tuner.rules import candidates as decide
from tuner.rules import finalists as rules
from tuner.rules.race import Rerun, race
from tuner.search.budget import Budget
from tuner.search.session import Proposal, TrialSession
from tuner.study.frame import headroom_filter, measured_feasible, missing, pareto_mask, trials_frame
from tuner.study.selection import Selection, rank_trials

__all__ = ["ConfirmationStage"]


class ConfirmationStage:
    """Re-run the finalists interleaved with the baseline for ``rounds`` rounds (``budget``: ``--timeout``;
    ``selection``: the headroom the finalists keep, and the pick whose first choice is always one of them)."""

    def __init__(
        self, session: TrialSession, *, budget: Optional[Budget] = None, selection: Optional[Selection] = None
    ):
        self.session = session
        self.budget = budget
        self.selection = selection or Selection()

    def run(self, rounds: int, *, finalists: int = rules.DEFAULT_FINALISTS) -> None:
        """Confirm the finalists side by side, then store the aggregate in the study attribute ``confirmation``.

        Rounds go on until the leader separates from the runner-up, at most ``rounds`` rounds measured without
        load (:func:`tuner.rules.race.race`). Each re-run is a trial of its own (``confirm_of`` = the finalist's or
        the baseline's number) launched by the session's runner exactly like a search trial, one at a time (two at
        once would skew the pair). Nothing done is redone: the re-runs already taken (finished, or running in
        another worker) are counted, so a resumed search or a second worker runs only the rest, and an
        interrupted re-run, enqueued again by the interruption, is run first."""
        s = self.session
        with s.lock():
            plan = self.plan(rounds, finalists=finalists)
        if plan is None:
            return
        finalists, baseline = plan
        base = f" against the baseline #{baseline}" if baseline is not None else " (no baseline to pair with)"
        s.say(
            f"confirm: finalists {', '.join(f'#{n}' for n in finalists)}{base}, interleaved rounds until the leader "
            f"separates (at most {rounds})"
        )
        last_round = -1
        while not s.stop_event.is_set() and not self._past_timeout():
            with s.lock():
                got = self._next(finalists, baseline, rounds)
            if got is None:
                break
            r, members, prop = got
            if r is not None and r != last_round:
                last_round = r
                s.say(f"confirm round {r + 1}: " + " ".join(f"#{n}" for n in members))
            s.process(prop, 0)
        with s.lock():
            conf = self._record(finalists, baseline, rounds)
        if conf["loaded_rounds"]:
            s.say(f"confirm: {conf['loaded_rounds']} round(s) measured under load: not claimed from")

    def _past_timeout(self) -> bool:
        return self.budget is not None and self.budget.past_timeout("confirm", self.session.say)

    def plan(
        self, rounds: int, *, finalists: int = rules.DEFAULT_FINALISTS
    ) -> Optional[tuple[list[int], Optional[int]]]:
        """(at most ``finalists`` finalists, baseline number or None), or None: nothing to confirm.

        Finalists come from the search's own trials (re-runs left out), under the selection's headroom filter
        (export's), so a resumed search finds the same ones; the pick's first choice is always among them."""
        study = self.session.study
        df = trials_frame(study)
        if df.empty:
            return None
        fit = headroom_filter(df, study.user_attrs, self.selection.headroom)
        front = pareto_mask(df, among=fit.mask)
        cands = [
            rules.Contender(
                number=int(row["number"]),
                throughput=float(row["throughput"]),
                throughput_ci=None
                if missing(row["throughput_ci_low"]) or missing(row["throughput_ci_high"])
                else (float(row["throughput_ci_low"]), float(row["throughput_ci_high"])),
                pareto=bool(front[i]),
            )
            for i, row in df.loc[fit.mask].iterrows()
        ]
        base = df.loc[df["baseline"] & measured_feasible(df), "number"]
        baseline = int(base.iloc[0]) if len(base) else None
        cap = finalists
        finalists = rules.pick_finalists(cands, exclude=[baseline] if baseline is not None else [], cap=cap)
        top = rank_trials(df, fit.mask, front, self.selection.pick)[:1]
        if top and top[0] != baseline and top[0] not in finalists:  # min-memory, knee: what export takes first
            finalists = top + finalists[: cap - 1]
        if not finalists:
            self.session.say("confirm: no finalist besides the baseline fits the memory limit; nothing to do")
            return None
        return finalists, baseline

    def _next(
        self, finalists: list[int], baseline: Optional[int], rounds: int
    ) -> Optional[tuple[Optional[int], list[int], Proposal]]:
        """The next re-run to launch (its round and that round's members, or None for an interrupted trial run
        again), under the lock; None when the race is over (or the rest of the round runs in another worker)."""
        s = self.session
        s.sweep_if_due()
        trials = s.study.get_trials(deepcopy=False)
        r, members = None, []
        if not any(t.state == TrialState.WAITING for t in trials):
            who = {*finalists, baseline}
            runs, searched = _reruns(trials, who), _searched(trials, who)
            state = race(runs, finalists=finalists, baseline=baseline, rounds=rounds, searched=searched)
            if state.done:
                return None
            r, members = state.rounds, state.members(baseline)
            taken = _taken(trials)
            number = next((n for n in members if taken.get(n, 0) <= r), None)
            if number is None:
                return None  # the round's last re-runs run in another worker
            s.study.enqueue_trial(
                dict(trials[number].params),  # numbers are list positions
                user_attrs=TrialRecord(confirm_of=number).to_user_attrs(only={"confirm_of"}),
                skip_if_exists=False,
            )
        # else: an interrupted trial enqueued again (Optuna pops the oldest waiting one first): run it now
        trial = s.ask()
        return r, members, s.propose(trial, decide.known_configs(trials, s.space, s.trial_flat))

    def _record(self, finalists: list[int], baseline: Optional[int], rounds: int) -> dict:
        """Aggregate every finished re-run of the plan's configs into the study attribute ``confirmation``."""
        study = self.session.study
        trials, members = study.get_trials(deepcopy=False), {*finalists, baseline}
        conf = rules.aggregate(
            baseline=baseline,
            finalists=finalists,
            rounds=rounds,
            headroom=self.selection.headroom,
            runs=_reruns(trials, members),
            searched=_searched(trials, members),
        )
        study.set_user_attr(rules.CONFIRMATION_ATTR, conf)
        return conf


def _reruns(trials: list, members: set) -> dict[int, list[Rerun]]:
    """The finished re-runs of ``members``, each config's in trial-number order (its k-th ran in round k)."""
    runs: dict[int, list[Rerun]] = {n: [] for n in members if n is not None}
    for t in sorted(trials, key=lambda t: t.number):
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if rec.confirm_of in runs and t.state.is_finished() and rec.status not in (None, Status.INTERRUPTED):
            runs[rec.confirm_of].append(_rerun(t.number, rec))
    return runs


def _searched(trials: list, members: set) -> dict[int, Rerun]:
    """The search trials of ``members`` that finished with a status (numbers are list positions)."""
    out = {}
    for n in members:
        rec = TrialRecord.from_user_attrs(trials[n].user_attrs) if n is not None and n < len(trials) else None
        if rec is not None and trials[n].state.is_finished() and rec.status not in (None, Status.INTERRUPTED):
            out[n] = _rerun(n, rec)
    return out


def _rerun(number: int, rec: TrialRecord) -> Rerun:
    ci = tuple(rec.throughput_ci) if rec.throughput_ci else None
    return Rerun(number, rec.status.value, rec.throughput, rec.peak_memory_gb, ci, loaded=rec.loaded)


def _taken(trials: list) -> dict[int, int]:
    """Re-runs per config that hold a round: finished, running or waiting, not interrupted."""
    taken: dict[int, int] = {}
    for t in trials:
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if rec.confirm_of is not None and rec.status != Status.INTERRUPTED:
            taken[rec.confirm_of] = taken.get(rec.confirm_of, 0) + 1
    return taken
