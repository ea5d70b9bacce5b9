"""The worst-case stage: the configs export would take first, each probed at its worst case (:mod:`tuner.trials.probe`:
one step with every prompt and response at its maximum length).

Runs after the confirmation, or on its own over a study whose search is done; it takes the study's session
(:class:`tuner.search.session.TrialSession`: the study, its lock, the runner) and stores each result in the study
attribute ``worst_case`` (``{trial number: ProbeResult.to_dict()}``); export refuses a pick whose worst case
breaks the headroom and takes the next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainer.config import apply_overrides, config_from_dict, config_to_dict
from trainer.contracts import Status, TrialRecord
from tuner.rules import finalists as rules
from tuner.search.budget import Budget
from tuner.search.session import TrialSession
from tuner.study.frame import headroom_filter, pareto_mask, trials_frame
from tuner.study.selection import Selection, rank_trials
from tuner.trials.probe import WORST_CASE_ATTR, ProbeResult, probe

__all__ = ["WorstCaseStage"]


class WorstCaseStage:
    """Probe the worst case of the ``count`` configs export would take first (``budget``: ``--timeout``)."""

    def __init__(
        self, session: TrialSession, *, budget: Optional[Budget] = None, selection: Optional[Selection] = None
    ):
        self.session = session
        self.budget = budget
        self.selection = selection or Selection()  # the headroom and pick export takes them by

    def run(self, count: int) -> None:
        """A config already probed is not run again (a resumed search, another worker)."""
        s = self.session
        with s.lock():
            numbers = self.plan(count)
        for n in numbers:
            if s.stop_event.is_set() or (self.budget is not None and self.budget.past_timeout("worst case", s.say)):
                return
            with s.lock():
                if str(n) in (s.study.user_attrs.get(WORST_CASE_ATTR) or {}):
                    continue
            s.say(f"worst case: probing trial #{n} (every prompt and response at its maximum)")
            result = self._probe(n)
            if result.status == Status.INTERRUPTED:
                return
            with s.lock():
                done = dict(s.study.user_attrs.get(WORST_CASE_ATTR) or {})
                done[str(n)] = result.to_dict()
                s.study.set_user_attr(WORST_CASE_ATTR, done)
            s.say(f"worst case of trial #{n}: " + result.lines()[-1])

    def _probe(self, n: int) -> ProbeResult:
        s = self.session
        trial = s.study.get_trials(deepcopy=False)[n]  # numbers are list positions
        over = dict(TrialRecord.from_user_attrs(trial.user_attrs).overrides or {})
        try:
            config = config_to_dict(config_from_dict(apply_overrides(s.trial_base, over)))
        except ValueError as e:  # the trial ran this config, so it validated; say so if it no longer does
            return ProbeResult(Status.INVALID, error=f"config: {e}")
        trial_dir = (s.trials_dir or Path("trials")) / f"probe-{n}"
        return probe(config, runner=s.runner, trial_dir=trial_dir, number=n, stop=s.stop_event, overrides=over)

    def plan(self, count: int) -> list[int]:
        """The configs export would take first under the selection's headroom: for ``max-throughput`` the
        confirmed finalists ranked by their confirmed ratio, then the fastest measured feasible trials (re-runs and
        duplicates left out); for another pick its order of the single trials (as export ranks them)."""
        study = self.session.study
        df = trials_frame(study)
        if df.empty:
            return []
        fit = headroom_filter(df, study.user_attrs, self.selection.headroom)
        if self.selection.pick != "max-throughput":
            return rank_trials(df, fit.mask, pareto_mask(df, among=fit.mask), self.selection.pick)[:count]
        fastest = df.loc[fit.mask].sort_values(["throughput", "number"], ascending=[False, True])["number"]
        eligible = [int(n) for n in fastest]
        conf = study.user_attrs.get(rules.CONFIRMATION_ATTR)
        confirmed = []
        if conf:
            ranked, _ = rules.rank_confirmed(conf, eligible=eligible, limit_gb=fit.limit_gb)
            confirmed = [e["number"] for e in ranked]
        ordered = list(dict.fromkeys([*confirmed, *eligible]))
        return ordered[:count]
