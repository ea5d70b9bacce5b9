"""The confirmation stage: the finalists re-run side by side with the baseline (rules: :mod:`tuner.rules.finalists`).

Runs after a search, or on its own over a study whose search is done (``ppotune search --confirm R`` on a study
that already holds its ``--trials``): it takes the study's session (:class:`tuner.search.session.TrialSession`:
the study, its lock and the runner) and stores the aggregate in the study attribute ``confirmation``.

Three things keep one noisy draw from deciding (docs/how-it-works.md, "Confirmation"):

* **load is waited out**: after a re-run measured under load (:func:`tuner.trials.memory.is_loaded`), the next one
  waits until the host reads quiet (:func:`host_load`, the trial's own meter run with no trial), at most
  :data:`DEFAULT_LOAD_WAIT_S` over the whole confirmation; the loaded round is run again. When the load outlasts the
  wait, the stage stops and records how long it waited and the command that confirms later;
* **single trials that the first clean round contradicts are suspect** (:func:`tuner.rules.finalists.suspicion`):
  the finalists widen to every config within that much of one (:func:`tuner.rules.finalists.widen`) and the race
  starts again with them, the first rounds kept as a screening that nothing is claimed from;
* **a race that did not separate goes on** while the confirmation has spent less than the search's own trial time
  (:func:`extra_budget_s`), at most :data:`tuner.rules.finalists.MAX_ROUNDS` rounds.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from optuna.trial import TrialState

from trainer.contracts import Status, TrialRecord
from tuner.rules import candidates as decide
from tuner.rules import finalists as rules
from tuner.rules.race import Race, Rerun, race
from tuner.search.budget import Budget
from tuner.search.session import Proposal, TrialSession
from tuner.study.frame import headroom_filter, measured_feasible, missing, pareto_mask, trials_frame
from tuner.study.selection import Selection, rank_trials
from tuner.trials.memory import host_load

__all__ = ["ConfirmationStage", "DEFAULT_LOAD_WAIT_S", "LOAD_POLL_S", "reconfirm_command"]

#: the longest a confirmation waits for load to pass, all its waits together (``--timeout`` bounds it too): long
#: enough for a test run or a build beside the tuner to end, short enough that a search left alone still finishes
#: (see docs/decisions.md#confirm-suspect-and-load-wait)
DEFAULT_LOAD_WAIT_S = 600.0
#: one reading of the host's load while waiting: the window the meter averages over (at least its shortest)
LOAD_POLL_S = 5.0
def reconfirm_command(command: Sequence[str], rounds: int) -> str:
    """``command`` (a ``ppotune search`` command line, its arguments after ``ppotune``) with ``--confirm rounds``:
    the study's trials are done, so run again it resumes the study and only confirms."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
            continue
        if arg == "--confirm":
            skip = True
            continue
        if not arg.startswith("--confirm="):
            out.append(arg)
    return shlex.join(["ppotune", *out, "--confirm", str(rounds)])


@dataclass
class _Plan:
    """Who races (the finalists, widened once the single trials are suspect) and from which of each config's re-runs
    (``offsets``: the re-runs before those are the screening, not claimed from)."""

    finalists: list
    baseline: Optional[int]
    first: list  # the finalists before widening
    offsets: dict = field(default_factory=dict)
    suspect: Optional[str] = None  # why the single trials were suspect (None: they were not, or not yet reviewed)
    reviewed: bool = False

    def runs(self, runs: dict) -> dict:
        return {n: list(rs)[self.offsets.get(n, 0) :] for n, rs in runs.items()}

    def to_attr(self) -> Optional[dict]:
        if self.suspect is None:
            return None
        return {
            "why": self.suspect,
            "first_finalists": list(self.first),
            "offsets": [[int(n), int(k)] for n, k in sorted(self.offsets.items())],
        }


class ConfirmationStage:
    """Re-run the finalists interleaved with the baseline for ``rounds`` rounds (``budget``: ``--timeout``;
    ``selection``: the headroom the finalists keep, and the pick whose first choice is always one of them;
    ``load_wait_s``: the longest all waits for load together take; ``probe``: the host's load now, as
    :func:`host_load` reads it; ``clock``: seconds, for the waits; ``command``: the search's command line, for the
    one that confirms later; ``seeds``: knob values of configs the search had reasons beyond their one trial to
    rate (the fit's largest sizes, the hints' corner): each measured and eligible one is a finalist too)."""

    def __init__(
        self,
        session: TrialSession,
        *,
        budget: Optional[Budget] = None,
        selection: Optional[Selection] = None,
        load_wait_s: float = DEFAULT_LOAD_WAIT_S,
        probe: Optional[Callable[[], Optional[dict]]] = None,
        clock: Callable[[], float] = time.monotonic,
        command: Sequence[str] = (),
        seeds: Sequence[dict] = (),
    ):
        self.session = session
        self.budget = budget
        self.selection = selection or Selection()
        self.load_wait_s, self.clock, self.command = load_wait_s, clock, tuple(command)
        self.seeds = [dict(v) for v in seeds]
        # a stop ends a reading's window at once, as it ends a trial
        self.probe = probe or (lambda: host_load(LOAD_POLL_S, wait=session.stop_event.wait))
        self.waited_s = 0.0
        self.gave_up: Optional[dict] = None  # the load outlasted the wait: what it was and how long it was waited
        self._quiet_after = -1  # the last loaded re-run the load was waited out after

    def run(self, rounds: int, *, finalists: int = rules.DEFAULT_FINALISTS) -> None:
        """Confirm the finalists side by side, then store the aggregate in the study attribute ``confirmation``.

        Rounds go on until the leader separates from the runner-up, at least ``rounds`` rounds measured without load
        unless it separates sooner (:func:`tuner.rules.race.race`), more while the confirmation's spent less than
        :func:`extra_budget_s`. Each re-run is a trial of its own (``confirm_of`` = the finalist's or the baseline's
        number) launched by the session's runner exactly like a search trial, one at a time (two at once would skew
        the pair). Nothing done is redone: the re-runs already taken (finished, or running in another worker) are
        counted, so a resumed search or a second worker runs only the rest, and an interrupted re-run, enqueued
        again by the interruption, is run first."""
        s = self.session
        with s.lock():
            plan = self.plan(rounds, finalists=finalists)
        if plan is None:
            return
        p = self._restore(_Plan(plan[0], plan[1], list(plan[0])))
        base = f" against the baseline #{p.baseline}" if p.baseline is not None else " (no baseline to pair with)"
        s.say(
            f"confirm: finalists {', '.join(f'#{n}' for n in p.finalists)}{base}, interleaved rounds until the leader "
            f"separates (at least {rounds} unless it does sooner)"
        )
        cap = rounds
        while True:
            state = self._race(p, cap)
            if state is None:
                break
            if not p.reviewed:
                self._review(p, state, finalists)
                continue
            settled = state.separated or state.why.endswith("under load") or state.why == "nothing to confirm"
            if settled or not self._extend(p, cap):
                break
            cap += 1
        with s.lock():
            conf = self._record(p, rounds)
        if conf["loaded_rounds"]:
            s.say(f"confirm: {conf['loaded_rounds']} round(s) measured under load: not claimed from, run again")

    def _race(self, p: _Plan, cap: int) -> Optional[Race]:
        """Run rounds until the race at ``cap`` is over (or, before the review, its first clean round is in): the
        race then, or None when the stage must stop (a stop, ``--timeout``, the load outlasting the wait)."""
        s = self.session
        last_round = -1
        while not s.stop_event.is_set() and not self._past_timeout():
            with s.lock():
                loaded = self._last_loaded(p)
            if loaded is not None and not self._wait_for_quiet(loaded):
                return None
            with s.lock():
                got = self._next(p, cap)
            if isinstance(got, Race):
                return got
            if got is None:
                return None
            r, members, prop = got
            if r is not None and r != last_round:
                last_round = r
                s.say(f"confirm round {r + 1}: " + " ".join(f"#{n}" for n in members))
            s.process(prop, 0)
        return None

    def _past_timeout(self) -> bool:
        return self.budget is not None and self.budget.past_timeout("confirm", self.session.say)

    # ---- waiting out load
    def _last_loaded(self, p: _Plan) -> Optional[int]:
        """The number of the confirmation's latest finished re-run when it was measured under load and the load has
        not been waited out after it, else None."""
        trials = self.session.study.get_trials(deepcopy=False)
        runs = _reruns(trials, {*p.finalists, p.baseline})
        last = max((r for rs in runs.values() for r in rs), key=lambda r: r.number, default=None)
        return last.number if last is not None and last.loaded and last.number > self._quiet_after else None

    def _wait_for_quiet(self, after: int) -> bool:
        """Wait, reading the host's load, until it is quiet (True) or the wait's bound is spent (False: recorded in
        :attr:`gave_up`); a stop or ``--timeout`` ends the wait too (False)."""
        s = self.session
        while True:
            t0 = self.clock()
            got = self.probe()
            self.waited_s += max(0.0, self.clock() - t0)
            if not (got or {}).get("loaded"):
                if self.waited_s:
                    s.say(f"confirm: the load passed ({_load_text(got)}); the round under load runs again")
                self._quiet_after = after
                return True
            if s.stop_event.is_set() or self._past_timeout():
                return False
            if self.waited_s >= self.load_wait_s:
                self.gave_up = {"waited_s": round(self.waited_s, 1), "load": got}
                s.say(
                    f"confirm: still under load after waiting {self.waited_s:.0f} s ({_load_text(got)}): stopped; "
                    "what was measured is stored"
                )
                return False
            s.say(
                f"confirm: re-run #{after} was measured under load, and the host still is ({_load_text(got)}): "
                f"waiting ({self.waited_s:.0f} of at most {self.load_wait_s:.0f} s)"
            )

    # ---- suspect single trials, and rounds past the cap
    def _review(self, p: _Plan, state: Race, cap_finalists: int) -> None:
        """After the first clean round: widen the finalists when that round contradicts the single trials."""
        p.reviewed = True
        if not state.clean or p.suspect is not None:
            return
        trials = self.session.study.get_trials(deepcopy=False)
        who = {*p.finalists, p.baseline}
        found = rules.suspicion(
            p.runs(_reruns(trials, who)),
            _searched(trials, who),
            finalists=p.finalists,
            baseline=p.baseline,
            round_k=state.clean[0],
        )
        if found is None:
            return
        cands = self._contenders()
        exclude = [p.baseline] if p.baseline is not None else []
        wider = rules.widen(cands, p.finalists, spread=found.spread, exclude=exclude, cap=2 * cap_finalists)
        p.suspect = found.why
        if wider == p.finalists:  # no other config within the spread: the round stands, the race goes on
            self.session.say(f"confirm: the single trials are suspect ({found.why}); no other config is within it")
            return
        everyone = _reruns(trials, {*wider, p.baseline})
        p.offsets = {n: len(rs) for n, rs in everyone.items()}
        p.finalists = wider
        self.session.say(
            f"confirm: the single trials are suspect ({found.why}): finalists now "
            f"{', '.join(f'#{n}' for n in wider)}; the rounds start again, the first ones kept as a screening"
        )

    def _extend(self, p: _Plan, cap: int) -> bool:
        """One more round for a race that did not separate, when the confirmation has budget left for it."""
        trials = self.session.study.get_trials(deepcopy=False)
        spent = _rerun_seconds(trials)
        members = len(p.finalists) + (p.baseline is not None)
        per_round = spent / max(1, _rerun_count(trials)) * members
        left = extra_budget_s(trials) - spent
        if cap + 1 > rules.MAX_ROUNDS or per_round > left:
            return False
        self.session.say(
            f"confirm: not separated after {cap} round{'s' if cap != 1 else ''}; one more ({left:.0f} s of the "
            "confirmation's budget left)"
        )
        return True

    def _restore(self, p: _Plan) -> _Plan:
        """A resumed confirmation goes on with the finalists it widened to (the study attribute says)."""
        conf = self.session.study.user_attrs.get(rules.CONFIRMATION_ATTR) or {}
        old = conf.get("suspect")
        if old and list(old.get("first_finalists") or []) == p.first:
            p.offsets = {int(n): int(k) for n, k in old.get("offsets") or []}
            p.finalists = [int(e["number"]) for e in conf["finalists"]]
            p.suspect, p.reviewed = str(old.get("why")), True
        return p

    def _contenders(self) -> list[rules.Contender]:
        study = self.session.study
        df = trials_frame(study)
        fit = headroom_filter(df, study.user_attrs, self.selection.headroom)
        return _contenders(df, fit.mask, pareto_mask(df, among=fit.mask))

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
        cands = _contenders(df, fit.mask, front)
        base = df.loc[df["baseline"] & measured_feasible(df), "number"]
        baseline = int(base.iloc[0]) if len(base) else None
        cap = finalists
        finalists = rules.pick_finalists(cands, exclude=[baseline] if baseline is not None else [], cap=cap)
        top = rank_trials(df, fit.mask, front, self.selection.pick)[:1]
        if top and top[0] != baseline and top[0] not in finalists:  # min-memory, knee: what export takes first
            finalists = top + finalists[: cap - 1]
        finalists += [n for n in self._seeded({c.number for c in cands}) if n != baseline and n not in finalists]
        if not finalists:
            self.session.say("confirm: no finalist besides the baseline fits the memory limit; nothing to do")
            return None
        return finalists, baseline

    def _seeded(self, eligible: set) -> list[int]:
        """The search trials that measured :attr:`seeds` (in their order), among ``eligible``: a seed's one trial is
        as noisy as any, and a config the fit or the hints rate fastest deserves a re-run when it lands behind the
        finalists by a draw (docs/how-it-works.md, "Finalists confirmed side by side")."""
        s = self.session
        known = decide.known_configs(s.study.get_trials(deepcopy=False), s.space, s.trial_flat)
        out = []
        for values in self.seeds:
            cand = s.space.complete(values, s.trial_flat)
            t = known.get(s.space.identity(cand.effective))
            if t is not None and t.number in eligible and t.number not in out:
                out.append(t.number)
        return out

    def _next(self, p: _Plan, cap: int) -> "Race | tuple[Optional[int], list[int], Proposal] | None":
        """The next re-run to launch (its round and that round's members, or None for an interrupted trial run
        again), under the lock; the race when it is over at ``cap`` (or its first clean round is in, before the
        review); None when the rest of the round runs in another worker."""
        s = self.session
        s.sweep_if_due()
        trials = s.study.get_trials(deepcopy=False)
        r, members = None, []
        if not any(t.state == TrialState.WAITING for t in trials):
            who = {*p.finalists, p.baseline}
            runs, searched = p.runs(_reruns(trials, who)), _searched(trials, who)
            state = race(runs, finalists=p.finalists, baseline=p.baseline, rounds=cap, searched=searched)
            if state.done or (not p.reviewed and state.clean):
                return state
            r, members = state.rounds, state.members(p.baseline)
            taken = _taken(trials)
            number = next((n for n in members if taken.get(n, 0) - p.offsets.get(n, 0) <= r), None)
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

    def _record(self, p: _Plan, rounds: int) -> dict:
        """Aggregate every finished re-run of the plan's configs into the study attribute ``confirmation``."""
        study = self.session.study
        trials, members = study.get_trials(deepcopy=False), {*p.finalists, p.baseline}
        every = _reruns(trials, members)
        conf = rules.aggregate(
            baseline=p.baseline,
            finalists=p.finalists,
            rounds=rounds,
            headroom=self.selection.headroom,
            runs=p.runs(every),
            searched=_searched(trials, members),
        )
        conf["suspect"] = p.to_attr()
        conf["screening"] = {str(n): [r.number for r in rs[: p.offsets.get(n, 0)]] for n, rs in every.items()}
        conf["budget_s"] = round(extra_budget_s(trials), 1)
        conf["spent_s"] = round(_rerun_seconds(trials), 1)
        conf["load_wait"] = None
        if self.gave_up is not None:
            conf["complete"] = False
            conf["load_wait"] = {
                **self.gave_up,
                "bound_s": self.load_wait_s,
                "reconfirm": reconfirm_command(self.command or ("search", "..."), rounds + conf["loaded_rounds"]),
            }
        study.set_user_attr(rules.CONFIRMATION_ATTR, conf)
        return conf


def _load_text(got: Optional[dict]) -> str:
    if not got:
        return "no reading"
    gpu = got.get("gpu_other_processes")
    tail = f", {gpu} other process(es) on its GPUs" if gpu not in (0, None) else ""
    return f"other processes kept {got.get('cpu_others', 0):.2f} CPUs busy, {got.get('cpu_others_share', 0):.0%}{tail}"


def extra_budget_s(trials: list) -> float:
    """What a confirmation may spend in re-runs (seconds): as much as the search's own trials took (their
    ``duration_s``), so confirming at most doubles a search. Rounds past ``--confirm`` run only within it."""
    total = 0.0
    for t in trials:
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if rec.confirm_of is None and t.state.is_finished() and rec.duration_s:
            total += float(rec.duration_s)
    return total


def _finished_reruns(trials: list) -> list[TrialRecord]:
    """Every finished confirmation re-run's record, whichever config it re-ran."""
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in trials if t.state.is_finished()]
    return [r for r in recs if r.confirm_of is not None]


def _rerun_seconds(trials: list) -> float:
    return sum(float(r.duration_s or 0.0) for r in _finished_reruns(trials))


def _rerun_count(trials: list) -> int:
    return len(_finished_reruns(trials))


def _contenders(df, mask, front) -> list[rules.Contender]:
    return [
        rules.Contender(
            number=int(row["number"]),
            throughput=float(row["throughput"]),
            throughput_ci=None
            if missing(row["throughput_ci_low"]) or missing(row["throughput_ci_high"])
            else (float(row["throughput_ci_low"]), float(row["throughput_ci_high"])),
            pareto=bool(front[i]),
        )
        for i, row in df.loc[mask].iterrows()
    ]


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
