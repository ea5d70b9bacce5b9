"""What to do with a proposed config, decided without launching anything.

Pure functions over a :class:`tuner.space.Space`, the trial base config and the trials
already in the study (Optuna ``FrozenTrial`` records; tests build them with
``optuna.trial.create_trial``). Nothing here starts a process, opens a storage or asks a
sampler: :mod:`tuner.search.loop` does that and calls these.

* :func:`known_configs` -- which configs the study already holds, and the trial that measured each;
* :func:`judge_candidate` -- launch it, or record it at zero cost as ``invalid`` (space constraint or
  config validation), ``duplicate`` (already measured: answered with its twin's values),
  ``inferred_oom`` (at least as memory-hungry as a known OOM on every monotone knob, in the direction
  of that OOM's kind, unless a measurement contradicts that OOM or the candidate, held only as an inferred
  OOM, is proposed again as the incumbent's neighbour: :func:`ruling_oom`) or ``predicted_oom``
  (the study's calibrated memory model puts it over the limit by more than the model's own error; a
  candidate over the limit within that error is launched, so the boundary is measured, not guessed).
  None of these consumes ``--trials``: the loop records it and asks the sampler again;
* :func:`constraint` -- the graded constraint Optuna gets (``<= 0`` feasible, ``> 0`` how far over);
* :func:`seen_configs` -- every config the study holds, measured or rejected (space exhaustion);
* :func:`incumbent`, :func:`ranked_measured`, :func:`measured_score`, :func:`distance` -- the best measured config
  (by the lower end of its own throughput interval: the winner's curse), the measured configs best first, and how
  many ordered steps apart two configs are (where the search proposes itself once the sampler stalls);
* :func:`oom_evidence` -- the OOMs that still rule configs out, and the configs that ran;

The budget's rules (which trials count, when a search stops) are :mod:`tuner.rules.budget`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

from optuna.trial import FrozenTrial, TrialState

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import CONSTRAINT_KEY, PHASES, Status, TrialRecord
from tuner.rules.budget import counted
from tuner.space import Candidate, Space

__all__ = [
    "LaunchVerdict",
    "LimitCheck",
    "known_configs",
    "seen_configs",
    "held_configs",
    "ruling_oom",
    "OomEvidence",
    "oom_evidence",
    "measured_score",
    "ranked_measured",
    "inferred_only",
    "distance",
    "incumbent",
    "judge_candidate",
    "constraint",
    "INVALID_CONSTRAINT",
]

_IN_STUDY = (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING)
#: The constraint of a config refused before launch: further over than any OOM (those grade 1..~2.1),
#: so TPE ranks it last among the infeasible trials.
INVALID_CONSTRAINT = 4.0
#: An OOM's constraint is 1 + (phases it did not get through) / len(PHASES); "setup" (model build,
#: sharding) comes before every phase of the step.
_OOM_SETUP = "setup"


@dataclass(frozen=True)
class LimitCheck:
    """What the study's memory model says of a candidate (:mod:`tuner.memory_model`), against the limit."""

    peak_gb: float  # predicted memory objective (GB per GPU)
    limit_gb: float  # the study's penalty_memory_gb: --memory-limit-gb, else the device's memory
    error: float  # the model's stated relative error (the leave-one-out maximum over the trials it was fitted on)
    trials: int  # how many measured trials it was fitted on

    @property
    def margin(self) -> float:
        """How far over the limit, relative (> 0 over, <= 0 under)."""
        return self.peak_gb / self.limit_gb - 1.0

    @property
    def over(self) -> bool:
        """Over the limit by more than the model's error: had the model over-predicted by its whole error,
        the peak would still not fit (``MemoryModel.over_limit``). Within the error it is launched: the
        boundary gets measured."""
        return self.peak_gb / (1.0 + self.error) > self.limit_gb

    def to_dict(self) -> dict:
        return {**asdict(self), "margin": self.margin}


@dataclass(frozen=True)
class LaunchVerdict:
    """The decision on one candidate. ``status`` None means: launch it."""

    status: Optional[Status] = None  # INVALID | DUPLICATE | INFERRED_OOM | PREDICTED_OOM, or None to launch
    reason: Optional[str] = None  # one line, stored as the trial's ``error``
    source: Optional[int] = None  # DUPLICATE: the trial holding the measurement; INFERRED_OOM: the OOM
    config: Optional[dict] = None  # launch: the validated nested config the trial runs (parsed once, here)
    constraint: Optional[float] = None  # not launched and told COMPLETE: its graded constraint (see constraint())
    values: Optional[tuple] = None  # DUPLICATE of a COMPLETE twin: the twin's objective values (else FAIL)
    predicted: Optional[LimitCheck] = None  # the memory model's figures, when the study has one

    @property
    def launch(self) -> bool:
        return self.status is None


# --------------------------------------------------------------------------- the study's configs
def effective_of(t: FrozenTrial, trial_flat: dict) -> Optional[dict]:
    """The flat effective config a trial ran (the trial base + its recorded overrides)."""
    overrides = TrialRecord.from_user_attrs(t.user_attrs).overrides
    return None if not isinstance(overrides, dict) else {**trial_flat, **overrides}


def known_configs(trials: Iterable[FrozenTrial], space: Space, trial_flat: dict) -> dict[tuple, FrozenTrial]:
    """Config identity -> the trial that measured it (a finished one first, else a running one).

    Interrupted trials, duplicates and ``--confirm`` re-runs are not measurements of their own."""
    known: dict[tuple, FrozenTrial] = {}
    for t in trials:
        if not counted(t):
            continue
        eff = effective_of(t, trial_flat)
        if eff is None:
            continue
        ident = space.identity(eff)
        prev = known.get(ident)
        if prev is None or (prev.state == TrialState.RUNNING and t.state != TrialState.RUNNING):
            known[ident] = t
    return known


def seen_configs(trials: Iterable[FrozenTrial], space: Space, trial_flat: dict) -> set[tuple]:
    """Identities of every config the study holds: measured, running, or rejected before launch
    (invalid, inferred OOM). An interrupted trial's config is held by its retry; an over-budget ask
    was never judged; a ``--confirm`` re-run repeats a config already there."""
    return {ident for ident, _ in held_configs(trials, space, trial_flat)}


def held_configs(
    trials: Iterable[FrozenTrial], space: Space, trial_flat: dict
) -> Iterable[tuple[tuple, Optional[Status]]]:
    """(identity, status) of each trial that holds its config in the study (see :func:`seen_configs`)."""
    for t in trials:
        if t.state not in _IN_STUDY:
            continue
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if rec.status in (Status.INTERRUPTED, Status.OVER_BUDGET) or rec.confirm_of is not None:
            continue
        eff = effective_of(t, trial_flat)
        if eff is not None:
            yield space.identity(eff), rec.status


def distance(space: Space, eff_a: dict, eff_b: dict) -> float:
    """How many steps apart two configs of ``space`` are: per knob, the difference of positions in its
    ordered domain (a power of two: of exponents), 1 for two different unordered choices or a knob active
    in one config only, 0 where both leave it inactive."""
    active_a, active_b = space.active_keys(eff_a), space.active_keys(eff_b)
    total = 0.0
    for knob in space.knobs:
        on_a, on_b = knob.key in active_a, knob.key in active_b
        if on_a != on_b:
            total += 1.0
        elif on_a:
            a, b = eff_a[knob.key], eff_b[knob.key]
            if knob.type == "categorical" and knob.exponents is None:
                total += 0.0 if (type(a), a) == (type(b), b) else 1.0
            else:
                try:
                    total += abs(knob.domain().index(a) - knob.domain().index(b))
                except ValueError:  # a value outside the domain (the base config's): as far as a choice
                    total += 0.0 if a == b else 1.0
    return total


def measured_score(rec: TrialRecord) -> Optional[float]:
    """What a measured config is ranked by, in the search and its finalists: the lower end of the trial's own 90%
    throughput interval when it has one (a lower confidence bound), else its median throughput. The maximum of many
    noisy medians is the luckiest sample (the winner's curse); a config must beat the others' figures by more than
    its own measured noise to lead (benchmarks/README.md, "The search on grids it was never tuned on")."""
    if rec.throughput is None:
        return None
    ci = rec.throughput_ci
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and ci[0] is not None and 0 < ci[0] <= rec.throughput:
        return float(ci[0])
    return float(rec.throughput)


def ranked_measured(known: dict[tuple, FrozenTrial]) -> list[FrozenTrial]:
    """The measured feasible trials of ``known``, best first by :func:`measured_score` (ties: lower number)."""
    scored = []
    for t in known.values():
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        score = measured_score(rec) if t.state == TrialState.COMPLETE and rec.status == Status.OK else None
        if score is not None:
            scored.append((-score, t.number, t))
    return [t for _, _, t in sorted(scored, key=lambda x: x[:2])]


def incumbent(known: dict[tuple, FrozenTrial], trial_flat: dict) -> Optional[dict]:
    """The flat effective config of the best measured feasible trial (:func:`ranked_measured`; None before one)."""
    ranked = ranked_measured(known)
    return effective_of(ranked[0], trial_flat) if ranked else None


@dataclass
class OomEvidence:
    """The launched OOMs of a study that still rule configs out, and the configs that ran (:func:`oom_evidence`)."""

    ooms: list  # (trial, its flat config, a host OOM?): each OOM no measurement contradicts
    fitted: list  # the flat configs that ran (ok)

    def rulers(self, eff: dict, space: Space) -> list[FrozenTrial]:
        """The OOMs that rule config ``eff`` out: it is at least as memory-hungry as each on every monotone knob."""
        return [t for t, other, host in self.ooms if space.at_least_as_hungry(eff, other, host=host)]


def oom_evidence(known: dict[tuple, FrozenTrial], space: Space, trial_flat: dict) -> OomEvidence:
    """The OOMs of ``known`` that no measurement contradicts (no config at least as hungry has run since), and
    the configs that ran. Near the cap an OOM is noisy: the same config runs out of memory in one run and fits in
    the next, so an OOM a fitted hungrier config contradicts was the noise of a config at the boundary."""
    ooms, fitted = [], []
    for t in known.values():
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        other = effective_of(t, trial_flat) if t.state == TrialState.COMPLETE else None
        if other is not None and rec.status == Status.OOM:
            ooms.append((t, other, rec.oom_kind == "host"))
        elif other is not None and rec.status == Status.OK:
            fitted.append(other)
    trusted = [
        (t, other, host)
        for t, other, host in ooms
        if not any(space.at_least_as_hungry(ran, other, host=host) for ran in fitted)
    ]
    return OomEvidence(trusted, fitted)


def ruling_oom(
    eff: dict,
    known: dict[tuple, FrozenTrial],
    space: Space,
    trial_flat: dict,
    revisitable: frozenset = frozenset(),
    launch_anyway: frozenset = frozenset(),
) -> Optional[FrozenTrial]:
    """The launched OOM that rules out config ``eff`` without a launch (None: nothing does).

    An OOM rules out every config at least as memory-hungry on every monotone knob (of the memory it ran out of:
    an offload knob moves device and host memory opposite ways). Near the cap an OOM is noisy, though (the same
    config runs out of memory in one run and fits in the next), so one OOM is evidence, not a verdict for ever:

    * an OOM that a measurement contradicts rules out nothing (:func:`oom_evidence`);
    * a config inferred before (``revisitable``: :func:`inferred_only`) that is now the incumbent's neighbour (one
      ordered step from the best measured config, where the search's local steps look) is launched: measured
      once, and if it fits, the OOM that ruled it out is contradicted and rules out nothing more;
    * a config the search proposes itself at the memory boundary (``launch_anyway``: its only evidence is one OOM,
      :mod:`tuner.search.stall`) is launched.
    """
    rulers = oom_evidence(known, space, trial_flat).rulers(eff, space)
    ruling = rulers[0] if rulers else None
    if ruling is not None and space.identity(eff) in launch_anyway:
        return None
    if ruling is not None and space.identity(eff) in revisitable:
        best = incumbent(known, trial_flat)
        if best is not None and distance(space, eff, best) == 1:
            return None
    return ruling


def inferred_only(trials: Iterable[FrozenTrial], space: Space, trial_flat: dict) -> frozenset[tuple]:
    """Identities of the configs the study holds only as inferred OOMs (never launched, never refused otherwise):
    the ones :func:`ruling_oom` may let a local step revisit."""
    inferred, other = set(), set()
    for ident, status in held_configs(trials, space, trial_flat):
        (inferred if status == Status.INFERRED_OOM else other).add(ident)
    return frozenset(inferred - other)


# --------------------------------------------------------------------------- the graded constraint
def constraint(record: TrialRecord, *, limit_gb: float, source: Optional[float] = None) -> Optional[float]:
    """The value told to Optuna as ``CONSTRAINT_KEY`` (<= 0 feasible; > 0 infeasible, larger = further over).

    * ``ok``: ``peak / limit - 1``, at most 0: the trial ran, so it is feasible whatever its peak reads
      (a GPU cap covers only the caching allocator; NVML also sees the CUDA context);
    * ``oom``: ``1 + (phases it did not get through) / len(PHASES)`` -- an OOM in the first phase of
      the step is further over than one in the last, an OOM while building (``setup``) further still,
      one with no phase recorded 1 -- or ``peak / limit - 1`` when that is larger;
    * ``inferred_oom``: ``source``, its OOM's constraint (1 when unknown); ``duplicate``: ``source``,
      its twin's;
    * ``invalid`` (refused before launch): :data:`INVALID_CONSTRAINT`; ``hang``: 1;
    * anything else (crash, interrupted, ...): None, it is told FAIL.

    ``limit_gb``: the study's ``penalty_memory_gb`` (``--memory-limit-gb`` or the device's memory).
    """
    status = record.status
    over = None
    if record.peak_memory_gb and limit_gb and limit_gb > 0:
        over = float(record.peak_memory_gb) / float(limit_gb) - 1.0
    if status == Status.OK:
        return min(over, 0.0) if over is not None else -1.0
    if status == Status.OOM:
        n = len(PHASES)
        if record.oom_phase in PHASES:
            not_reached = n - PHASES.index(record.oom_phase)  # the phase it died in did not get through either
        elif record.oom_phase == _OOM_SETUP:
            not_reached = n + 1
        else:
            not_reached = 0
        grade = 1.0 + not_reached / n
        return max(grade, over) if over is not None else grade
    if status in (Status.INFERRED_OOM, Status.DUPLICATE):
        return float(source) if source is not None else 1.0
    if status == Status.PREDICTED_OOM:  # how far over the model puts it (an OOM grades from 1)
        return float(source) if source is not None else 1.0
    if status == Status.INVALID:
        return INVALID_CONSTRAINT
    if status == Status.HANG:
        return 1.0
    return None


def constraint_of(t: FrozenTrial) -> Optional[float]:
    """The constraint a COMPLETE trial was told (older studies: the binary -1/+1), else None."""
    if t.state != TrialState.COMPLETE:
        return None
    rec = TrialRecord.from_user_attrs(t.user_attrs)
    if rec.constraint is not None:
        return float(rec.constraint)
    value = t.constraints.get(CONSTRAINT_KEY) if t.constraints else None
    return None if value is None else float(value)


# --------------------------------------------------------------------------- one candidate
def judge_candidate(
    cand: Candidate,
    *,
    number: int,
    space: Space,
    trial_base: dict,
    trial_flat: dict,
    known: dict[tuple, FrozenTrial],
    is_confirm: bool = False,
    predict: Optional[Callable[[dict], Optional[LimitCheck]]] = None,
    revisitable: frozenset = frozenset(),
    launch_anyway: frozenset = frozenset(),
) -> LaunchVerdict:
    """Launch ``cand`` (trial ``number``) or record it at zero cost; see the module docstring.

    A ``--confirm`` re-run is checked for validity only: it repeats a measured config on purpose.
    ``predict``: the study's memory model, given the candidate's flat config (None: no model yet).
    ``revisitable``: the configs the study holds only as inferred OOMs (:func:`inferred_only`, :func:`ruling_oom`);
    ``launch_anyway``: the configs the search proposed itself at the memory boundary (:func:`ruling_oom`).
    """
    invalid = INVALID_CONSTRAINT
    if cand.error:
        return LaunchVerdict(Status.INVALID, f"space: {cand.error}", constraint=invalid)
    if cand.violated:
        return LaunchVerdict(Status.INVALID, f"space: constraint not satisfied: {cand.violated}", constraint=invalid)
    try:
        config = config_to_dict(config_from_dict(apply_overrides(trial_base, cand.overrides)))
    except ConfigError as e:
        return LaunchVerdict(Status.INVALID, f"config: {e}", constraint=invalid)
    if is_confirm:
        return LaunchVerdict(config=config)
    prev = known.get(space.identity(cand.effective))
    if prev is not None and prev.number != number:
        rec = TrialRecord.from_user_attrs(prev.user_attrs)
        what = rec.status or prev.state.name.lower()
        # A finished twin answers for it: COMPLETE with the twin's values and constraint, so TPE sees the
        # point again at no cost (a FAIL would be invisible to it). A twin still RUNNING (another slot or
        # worker) has no values yet, and waiting would hold this slot for a whole trial to learn nothing
        # new; TPE's constant liar already counts the running twin, so the duplicate is FAIL, as is the
        # duplicate of a FAIL twin (a crash).
        twin = prev.state == TrialState.COMPLETE and prev.values is not None
        return LaunchVerdict(
            Status.DUPLICATE,
            f"duplicate: the sampler proposed the config of trial {prev.number} ({what}); not run",
            source=prev.number,
            values=tuple(prev.values) if twin else None,
            constraint=constraint_of(prev) if twin else None,
        )
    t = ruling_oom(cand.effective, known, space, trial_flat, revisitable, launch_anyway)
    if t is not None:
        return LaunchVerdict(
            Status.INFERRED_OOM,
            f"inferred OOM: at least as memory-hungry as trial {t.number} (an OOM) on every monotone knob; "
            "not launched",
            source=t.number,
            constraint=constraint(TrialRecord(status=Status.INFERRED_OOM), limit_gb=0.0, source=constraint_of(t)),
        )
    pred = predict(flatten(config)) if predict is not None else None
    if pred is not None and pred.over:
        return LaunchVerdict(
            Status.PREDICTED_OOM,
            f"predicted OOM: the memory model (fitted on {pred.trials} trials, error {pred.error:.0%}) puts its "
            f"peak at {pred.peak_gb:.3g} GB, {pred.margin:+.0%} over the {pred.limit_gb:.3g} GB limit; not launched",
            # graded like an OOM (>= 1), further for a larger predicted overshoot
            constraint=constraint(TrialRecord(status=Status.PREDICTED_OOM), limit_gb=0.0, source=1.0 + pred.margin),
            predicted=pred,
        )
    return LaunchVerdict(config=config, predicted=pred)
