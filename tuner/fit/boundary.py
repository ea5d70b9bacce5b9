"""The pure decisions of ``ppotune fit``: where each knob's boundary is, what to probe next, what a probe says.

Each knob (:class:`~tuner.fit.ladder.SizeKnob`) keeps an interval of its ladder: ``lo``, the largest rung known to fit
(-1: none yet), and ``hi``, the smallest rung known not to (the ladder's length: none). A probe runs every knob at a
rung; :func:`judge_probe` turns its outcome into one :class:`Observation` per knob it can speak for, read pass by
pass in the order the step runs them:

* a pass whose peak (on the memory objective's basis) stays within the limit: its knob **fits** at that rung;
* the first pass over the limit, or the pass a rank ran out of memory in: its knob is **over** (measured) or
  **oom**; a pass no knob sizes (an ``adv`` holding what ``values`` left) is charged to the nearest earlier knob's;
* passes after it: nothing (an earlier pass's memory may be what pushed them over, and an OOM ends the step);
* an engine that says neither per-pass peaks nor the OOM's pass (verl): the outcome speaks for the one knob above
  its known fit, else for none, and from then on one knob is probed at a time (:attr:`FitState.split`);
* a failure whose message names its knob (:data:`trainer.contracts.MEMORY_MESSAGES`: vLLM's start-up refusals name
  ``gpu_memory_utilization``) speaks for that knob whatever the pass: an OOM (the share is more than the device has
  free) is an upper bound as any other; a share too small to hold one sequence is **too small**, the opposite bound:
  that rung and every one below it cannot work at any limit (:attr:`KnobFit.floor`).

:func:`next_probe` picks the rungs: a pending repeat first (an OOM one rung above a measured fit counts only once it
happens twice: a noisy boundary), else the start (the base config's rungs, or the top without a model), else the
memory model's proposal inside the interval, else the interval's middle. Knobs whose passes overlap in time (a vLLM
engine resident in every phase on a CPU) are fitted one at a time before the rest; the others share each probe.
Once every interval is closed, the answer (every knob at ``lo``) is probed as a whole unless a probe already ran it
within the limit, and a failure there reopens the knob it is charged to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from trainer.contracts import PHASES, MemoryOutcome, Status, memory_message
from tuner.fit.ladder import SizeKnob

__all__ = [
    "FITS",
    "OVER",
    "OOM",
    "PREDICTED",
    "TOO_SMALL",
    "Observation",
    "KnobFit",
    "ProbeOutcome",
    "FitState",
    "FitBlocked",
    "ProbePlan",
    "judge_probe",
    "next_probe",
]

FITS, OVER, OOM, PREDICTED = "fits", "over", "oom", "predicted"
#: vLLM's share at this rung holds no sequence: a lower bound (more memory is what it needs), never a crash
TOO_SMALL = "too_small"
_FAILS = (OVER, OOM, PREDICTED)


class FitBlocked(ValueError):
    """A probe says no size can fit (a pass no knob sizes is over the limit, the model does not load: ``no_size``)
    or the probe could not run (a crash, a hang): the fit stops with this reason."""

    def __init__(self, message: str, *, no_size: bool = False):
        super().__init__(message)
        self.no_size = no_size


@dataclass(frozen=True)
class Observation:
    """What one probe (or the memory model) says about one knob at one rung."""

    rung: int
    verdict: str  # fits | over | oom | predicted | too_small
    peak_gb: Optional[float] = None  # the knob's passes' peak (measured, or predicted), objective basis
    probe: Optional[int] = None  # the probe's trial number; None for a prediction
    phase: Optional[str] = None  # the pass it speaks of (over / oom: the pass that failed)
    predicted_gb: Optional[float] = None  # the memory model's figure for the same passes, when it had one
    error: Optional[float] = None  # the model's relative error the figure was judged with
    #: an OOM the memory model put beyond the limit by more than ``error``: not a noisy boundary, never repeated
    expected: bool = False

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Observation":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


@dataclass
class KnobFit:
    """One knob's interval and the evidence for it: the answer lies above :attr:`low` and below ``hi``."""

    knob: SizeKnob
    lo: int = -1
    hi: Optional[int] = None  # None: the ladder's length (set in __post_init__)
    observations: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hi is None:
            self.hi = len(self.knob.ladder)

    @property
    def key(self) -> str:
        return self.knob.key

    def at(self, rung: int) -> list[Observation]:
        return [o for o in self.observations if o.rung == rung]

    @property
    def pending_repeat(self) -> bool:
        """The boundary rests on one OOM one rung above a measured fit: it is repeated before it counts."""
        if self.hi >= len(self.knob.ladder) or self.hi != self.lo + 1 or self.lo < 0:
            return False
        here = self.at(self.hi)
        measured_fit = any(o.verdict == FITS for o in self.at(self.lo))
        fails = [o for o in here if o.verdict in _FAILS]
        return measured_fit and len(fails) == 1 and fails[0].verdict == OOM and not fails[0].expected

    @property
    def floor(self) -> int:
        """The largest rung known too small (a vLLM share that holds no sequence): it and every rung below it cannot
        work whatever the limit (-1: none)."""
        return max((o.rung for o in self.observations if o.verdict == TOO_SMALL), default=-1)

    @property
    def low(self) -> int:
        """The rung the answer lies above: the largest known fit, else the floor."""
        return max(self.lo, self.floor)

    @property
    def settled(self) -> bool:
        return self.low + 1 >= self.hi and not self.pending_repeat

    @property
    def impossible(self) -> bool:
        """No value fits: not even the smallest, or none between the floor and the smallest that fails."""
        return self.hi == 0 or (self.lo < 0 and self.floor + 1 >= self.hi)

    def record(self, obs: Observation) -> None:
        self.observations.append(obs)
        r = obs.rung
        if obs.verdict == TOO_SMALL:  # a start-up check of the share itself, not a noisy boundary: it outranks a fit
            if r >= self.lo:
                self.lo = max((o.rung for o in self.observations if o.verdict == FITS and o.rung > r), default=-1)
        elif obs.verdict == FITS:
            if r <= self.floor:
                return
            if r >= self.hi:  # a failure at or below it was noise (an OOM that did not repeat)
                above = [o.rung for o in self.observations if o.verdict in _FAILS and o.rung > r]
                self.hi = min(above, default=len(self.knob.ladder))
            self.lo = max(self.lo, r)
        else:
            if r <= self.lo:  # a value that fitted fails now (in another combination, or noise)
                self.lo = r - 1 if r - 1 > self.floor else -1
            self.hi = min(self.hi, r)

    def to_dict(self) -> dict:
        return {"knob": self.knob.to_dict(), "observations": [o.to_dict() for o in self.observations]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KnobFit":
        fit = cls(SizeKnob.from_dict(d["knob"]))
        for o in d.get("observations") or []:
            fit.record(Observation.from_dict(o))
        return fit


@dataclass(frozen=True)
class ProbeOutcome:
    """A probe's outcome, as the decisions read it (:class:`trainer.contracts.TrialRecord`'s fields)."""

    status: Status
    peak_gb: Optional[float] = None  # the memory objective
    by_phase_gb: Mapping[str, float] = field(default_factory=dict)  # per-pass peaks (allocator / RSS basis)
    oom_phase: Optional[str] = None
    error: Optional[str] = None


@dataclass
class FitState:
    """Every knob's interval, the probes that ran within the limit, and whether outcomes can be split by pass."""

    fits: list  # [KnobFit], in the order their passes run
    passed: list = field(default_factory=list)  # [{key: rung}] of probes that ran within the limit
    passed_by: list = field(default_factory=list)  # their probes' trial numbers (None: not known)
    split: bool = False  # an outcome could not be charged to one knob: probe one knob at a time
    probes: int = 0

    def fit(self, key: str) -> KnobFit:
        return next(f for f in self.fits if f.key == key)

    @property
    def answer(self) -> dict:
        """Every knob at its largest fitting rung (-1: none fits)."""
        return {f.key: f.lo for f in self.fits}

    @property
    def answer_probe(self) -> Optional[int]:
        """The last probe that ran the answer within the limit (None: none did, or its number is not known)."""
        ran = [n for rungs, n in zip(self.passed, self.passed_by) if rungs == self.answer]
        return ran[-1] if ran else None

    @property
    def done(self) -> bool:
        """Every interval closed and the answer run within the limit (or a knob with no fitting value)."""
        if any(f.impossible for f in self.fits):
            return True
        return all(f.settled for f in self.fits) and self.answer in self.passed

    def to_dict(self) -> dict:
        return {
            "fits": [f.to_dict() for f in self.fits],
            "passed": [dict(p) for p in self.passed],
            "passed_by": list(self.passed_by),
            "split": self.split,
            "probes": self.probes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FitState":
        return cls(
            fits=[KnobFit.from_dict(f) for f in d["fits"]],
            passed=[{str(k): int(v) for k, v in p.items()} for p in d.get("passed") or []],
            passed_by=list(d.get("passed_by") or []),
            split=bool(d.get("split")),
            probes=int(d.get("probes") or 0),
        )


# --------------------------------------------------------------------------- what a probe says
def _owners(fits: Sequence[KnobFit], phase: str) -> list[KnobFit]:
    """The knobs charged with ``phase``: those whose passes include it, else those of the nearest earlier phase
    some knob sizes (what that pass left behind); empty when no earlier pass is sized."""
    for p in reversed(PHASES[: PHASES.index(phase) + 1]):
        owners = [f for f in fits if p in f.knob.phases]
        if owners:
            return owners
    return []


def _charged(
    fits: Sequence[KnobFit], rungs: Mapping[str, int], phase: Optional[str], tested: Sequence[str]
) -> list[KnobFit]:
    """Who a failure in ``phase`` is charged to: the knobs of that pass above their known fit, else (the known fits
    failing together) the most specific knob of the pass. ``phase`` None (the engine did not say): the one knob the
    probe tested, or the one above its known fit; nobody when that is several."""
    if phase is None:
        above = [f for f in fits if f.key in tested] if len(tested) == 1 else [f for f in fits if rungs[f.key] > f.lo]
        return above if len(above) == 1 else []
    owners = _owners(fits, phase) if phase in PHASES else []
    if not owners:
        what = "the model could not even be set up" if phase == "setup" else f"phase {phase} is sized by no knob"
        raise FitBlocked(f"the worst case fails in {phase} whatever the sizes: {what}", no_size=True)
    above = [f for f in owners if rungs[f.key] > f.lo]
    return above or [min(owners, key=lambda f: len(f.knob.phases))]


def _first_line(error: Optional[str]) -> str:
    return ((error or "no error recorded").strip().splitlines() or [""])[0]


def _named(fits: Sequence[KnobFit], outcome: ProbeOutcome) -> Optional[tuple[KnobFit, MemoryOutcome]]:
    """The knob a failed probe's own message names as the cause, and what it says of it (vLLM's start-up refusals
    name its share: trainer.contracts.MEMORY_MESSAGES), whatever the status the probe was recorded with (a share too
    small is a config refusal; an older study recorded vLLM's refusals as crashes). None: no such message, or an OOM
    naming a knob the fit does not size (judged as any OOM). FitBlocked: a share too small that the fit cannot
    raise."""
    if outcome.status is Status.OK:
        return None
    found = memory_message(outcome.error)
    if found is None or found.key is None:
        return None
    fit = next((f for f in fits if f.key == found.key), None)
    if fit is None and found.outcome is MemoryOutcome.UNDERSIZED:
        raise FitBlocked(f"{found.key} is not a size this fit varies: {_first_line(outcome.error)}")
    return (fit, found.outcome) if fit is not None else None


def _own_peak(knob: SizeKnob, by_phase: Mapping[str, float], offset: float) -> Optional[float]:
    got = [by_phase[p] for p in knob.phases if p in by_phase]
    return max(got) + offset if got else None


def judge_probe(
    state: FitState,
    rungs: Mapping[str, int],
    outcome: ProbeOutcome,
    *,
    limit_gb: float,
    tested: Sequence[str] = (),
    probe: Optional[int] = None,
    predicted: Optional[Mapping[str, float]] = None,
    error: float = 0.25,
) -> list[tuple[str, Observation]]:
    """Record what the probe of ``rungs`` says (see the module docstring) into ``state``; returns the observations
    made. ``tested``: the knobs the probe tested (the others held at their fit); ``predicted``: the memory model's
    figure for each knob's passes at these rungs, and ``error`` the relative error it is trusted to (an OOM it put
    over the limit by more than that is expected: not repeated). Raises :class:`FitBlocked`."""
    state.probes += 1
    predicted = predicted or {}
    made: list[tuple[str, Observation]] = []

    def note(f: KnobFit, verdict: str, peak: Optional[float], phase: Optional[str] = None) -> None:
        pred = predicted.get(f.key)
        expected = verdict == OOM and pred is not None and pred / (1.0 + error) > limit_gb
        err = error if pred is not None else None
        obs = Observation(rungs[f.key], verdict, peak, probe, phase, pred, err, expected)
        f.record(obs)
        made.append((f.key, obs))

    named = _named(state.fits, outcome)
    if named is not None:
        f, said = named
        note(f, TOO_SMALL if said is MemoryOutcome.UNDERSIZED else OOM, None, outcome.oom_phase)
        return made
    if outcome.status not in (Status.OK, Status.OOM):
        raise FitBlocked(f"a probe ended {outcome.status.value}: {_first_line(outcome.error)}")
    by_phase, peak = dict(outcome.by_phase_gb or {}), outcome.peak_gb
    within = outcome.status is Status.OK and (peak is None or peak <= limit_gb + 1e-12)
    if outcome.status is Status.OK and by_phase:
        offset = max(0.0, (peak or 0.0) - max(by_phase.values()))  # what the objective sees beyond the passes
        over = [p for p in PHASES if p in by_phase and by_phase[p] + offset > limit_gb + 1e-12]
        first = (over or [max(by_phase, key=by_phase.get)])[0]
        charged = [] if within and not over else _charged(state.fits, rungs, first, tested)
        for f in state.fits:
            own = _own_peak(f.knob, by_phase, offset)
            if f in charged:
                note(f, OVER, own, first)
            elif (own is None and within and not over) or (own is not None and own <= limit_gb + 1e-12):
                note(f, FITS, own)
        within = within and not over
    elif within:  # one figure for the whole step (verl)
        for f in state.fits:
            note(f, FITS, peak)
    else:
        phase = None if outcome.status is Status.OK else outcome.oom_phase
        phase = phase if phase in PHASES or phase == "setup" else None
        charged = _charged(state.fits, rungs, phase, tested)
        state.split = state.split or not charged  # who failed cannot be told: one knob per probe from now on
        if phase in PHASES and outcome.status is Status.OOM:  # under the limit's cap, the passes before it fit
            for f in state.fits:
                if f not in charged and all(PHASES.index(p) < PHASES.index(phase) for p in f.knob.phases):
                    note(f, FITS, None)
        verdict = OVER if outcome.status is Status.OK else OOM
        for f in charged:
            note(f, verdict, peak if verdict == OVER else None, phase)
    if within:
        state.passed.append({k: int(v) for k, v in rungs.items()})
        state.passed_by.append(probe)
    return made


# --------------------------------------------------------------------------- what to probe next
@dataclass(frozen=True)
class ProbePlan:
    """The next probe: every knob's rung, and why each tested knob is where it is."""

    rungs: dict
    why: dict  # key -> start | model | middle | repeat | verify (the knobs held at their fit are absent)


def _held(f: KnobFit, start: Mapping[str, int], split: bool) -> int:
    """A knob the probe does not test: at its known fit, else at its start (its smallest value once outcomes
    cannot be told apart: an untested value must not be what fails), never at or below its floor."""
    if f.lo >= 0:
        return f.lo
    rung = 0 if split or f.hi <= 0 else min(start.get(f.key, 0), f.hi - 1)
    return max(rung, min(f.floor + 1, f.hi - 1)) if f.floor >= 0 else rung


def _candidate(f: KnobFit, start: Mapping[str, int], proposals: Mapping[str, int]) -> tuple[int, str]:
    lo, hi = f.low, f.hi
    if f.pending_repeat:
        return hi, "repeat"
    inside = lambda r: max(lo + 1, min(hi - 1, int(r)))  # noqa: E731
    if not f.observations and f.key in start:
        return inside(start[f.key]), "start"
    if f.key in proposals:
        return inside(proposals[f.key]), "model"
    return inside((lo + hi) // 2), "middle"


def next_probe(
    state: FitState, *, start: Mapping[str, int], proposals: Optional[Mapping[str, int]] = None
) -> Optional[ProbePlan]:
    """The next probe, or None when the fit is done (:attr:`FitState.done`). ``start``: each knob's first rung
    (the base config's, or the top of its ladder); ``proposals``: the memory model's largest fitting rung of each
    knob, when there is a model."""
    if state.done:
        return None
    fits = state.fits
    open_ = [f for f in fits if not f.settled]
    if not open_:
        return ProbePlan(dict(state.answer), {f.key: "verify" for f in fits})
    overlapping = [f for f in open_ if any(f.knob.overlaps(g.knob) for g in fits if g is not f)]
    tested = overlapping[:1] or (open_[:1] if state.split else open_)
    rungs, why = {}, {}
    for f in fits:
        if f in tested:
            rungs[f.key], why[f.key] = _candidate(f, start, proposals or {})
        else:
            rungs[f.key] = _held(f, start, state.split)
    return ProbePlan(rungs, why)
