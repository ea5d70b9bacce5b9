"""What a study found, computed from a :class:`~tuner.results.view.StudyView` (no plotting).

- :func:`compute_importances`: which knobs move throughput and peak memory (PED-ANOVA);
- :func:`knob_effects`: which knobs changed nothing measurable ("no effect");
- :func:`search_cost`: trial-seconds by status, and what OOM inference saved;
- :func:`baseline_vs_best`: the base config against export's pick (confirmed figures when it has them);
- :func:`lengths_seen`: the prompt/response length distribution the trials saw;
- :func:`build`: all of the above for one report (:class:`ReportData`).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import warnings
from typing import Optional

import optuna
import pandas as pd

from trainer.contracts import DEFAULT_HEADROOM, DIRECTIONS, Status
from tuner.results.memory_findings import MemoryFindings, memory_findings
from tuner.results.pick import Choice, NoFit, choose
from tuner.results.view import StudyView, measured_feasible, value_or_zero

__all__ = [
    "MIN_TRIALS_FOR_IMPORTANCE",
    "THROUGHPUT_REL_TOL",
    "MEMORY_REL_TOL",
    "MEMORY_ABS_TOL_GB",
    "Importances",
    "compute_importances",
    "Effect",
    "knob_effects",
    "SearchCost",
    "search_cost",
    "BaselineVsBest",
    "baseline_vs_best",
    "LENGTH_KEYS",
    "lengths_seen",
    "merge_lengths",
    "ReportData",
    "build",
]

MIN_TRIALS_FOR_IMPORTANCE = 4
# "No effect" thresholds: a throughput change below max(5%, 2 x the larger step-time CV)
# and a memory change below max(3%, 0.05 GB) is taken for run-to-run noise (docs/decisions.md#no-effect-thresholds).
THROUGHPUT_REL_TOL = 0.05
MEMORY_REL_TOL = 0.03
MEMORY_ABS_TOL_GB = 0.05


# --------------------------------------------------------------------------- importances
@dataclasses.dataclass
class Importances:
    throughput: dict[str, float]
    memory: dict[str, float]
    n_trials: int
    message: str  # why they are missing, or how far to trust them


def compute_importances(view: StudyView, *, min_trials: int = MIN_TRIALS_FOR_IMPORTANCE) -> Importances:
    """Knob importances for throughput and for peak memory (PED-ANOVA, Optuna's default).

    Only COMPLETE feasible trials count: an OOM's penalized values would teach the
    evaluator about the penalty, not about the knobs.
    """
    df = view.trials
    feas = df.loc[measured_feasible(df)] if not df.empty else df
    n = len(feas)
    if n < min_trials:
        return Importances({}, {}, n, f"not enough feasible trials to estimate importances ({n}; need {min_trials})")
    trials = [view.trial(int(k)) for k in feas["number"]]
    # knobs every feasible trial has (conditional knobs are absent from some) and that vary
    common = set.intersection(*(set(t.params) for t in trials))
    varying = sorted(k for k in common if len({repr(t.params[k]) for t in trials}) > 1)
    if not varying:
        return Importances({}, {}, n, "no knob varied across the feasible trials")
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study created in memory" line
    try:
        tmp = optuna.create_study(directions=list(DIRECTIONS))
    finally:
        optuna.logging.set_verbosity(level)
    for t, (_, r) in zip(trials, feas.iterrows()):
        tmp.add_trial(
            optuna.trial.create_trial(
                params={k: t.params[k] for k in varying},
                distributions={k: t.distributions[k] for k in varying},
                values=[float(r["throughput"]), float(r["peak_memory_gb"])],
            )
        )
    # PED-ANOVA compares the top quantile with the rest; with a small study the default
    # 10% is a single trial, so take at least 3.
    q = min(0.5, max(0.1, 3.0 / n))
    evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=q)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            thr = optuna.importance.get_param_importances(
                tmp, params=varying, evaluator=evaluator, target=lambda t: -t.values[0]
            )  # it minimizes
            mem = optuna.importance.get_param_importances(
                tmp, params=varying, evaluator=evaluator, target=lambda t: t.values[1]
            )
    except Exception as e:  # an evaluator limit we did not foresee must not sink the report
        return Importances({}, {}, n, f"importance evaluation failed: {e}")
    msg = f"PED-ANOVA over {n} feasible trials"
    if n < 20:
        msg += " (rough with fewer than ~20)"
    return Importances(dict(thr), dict(mem), n, msg)


# --------------------------------------------------------------------------- knobs with no effect
@dataclasses.dataclass
class Effect:
    knob: str
    verdict: str  # "no effect" | "effect" | "not isolated"
    evidence: str


_NOTE_NO_EFFECT = re.compile(r"^\s*([\w.]+)\s*:\s*(no effect.*)$", re.IGNORECASE)


def knob_effects(view: StudyView) -> list[Effect]:
    """Which knobs changed nothing measurable.

    Evidence, strongest first: pairs of ok trials that differ in exactly one knob (a
    change within noise on both throughput and memory in every such pair -> "no
    effect"); and the trials' own notes ("<key>: no effect on CPU"), which the trainer
    writes when a knob is a no-op on this device.
    """
    df = view.trials
    knobs = view.knobs
    ok = df.loc[measured_feasible(df)] if not df.empty else df
    params = {int(n): view.trial(int(n)).params for n in ok["number"]}
    rows = {int(r["number"]): r for _, r in ok.iterrows()}
    pairs: dict[str, list[tuple[int, int, bool, str]]] = {k: [] for k in knobs}
    nums = sorted(params)
    for i, a in enumerate(nums):
        for b in nums[i + 1 :]:
            pa, pb = params[a], params[b]
            if set(pa) != set(pb):
                continue
            diff = [k for k in pa if pa[k] != pb[k]]
            if len(diff) != 1:
                continue
            ra, rb = rows[a], rows[b]
            cv = max(value_or_zero(ra["throughput_cv"]), value_or_zero(rb["throughput_cv"]))
            thr_tol = max(THROUGHPUT_REL_TOL, 2.0 * cv)
            d_thr = abs(ra["throughput"] - rb["throughput"]) / max(ra["throughput"], rb["throughput"], 1e-12)
            d_mem = abs(ra["peak_memory_gb"] - rb["peak_memory_gb"])
            mem_tol = max(MEMORY_REL_TOL * max(ra["peak_memory_gb"], rb["peak_memory_gb"]), MEMORY_ABS_TOL_GB)
            same = d_thr <= thr_tol and d_mem <= mem_tol
            signed = (rb["throughput"] - ra["throughput"]) / ra["throughput"]
            text = (
                f"#{a} vs #{b} ({pa[diff[0]]} -> {pb[diff[0]]}): throughput {signed:+.1%} "
                f"(noise {thr_tol:.0%}), memory {d_mem:.2f} GB (noise {mem_tol:.2f} GB)"
            )
            pairs[diff[0]].append((a, b, same, text))
    notes: dict[str, str] = {}
    note_trials: dict[str, int] = {}
    for text in df.get("notes", pd.Series(dtype=str)).dropna():
        for note in str(text).split("; "):
            m = _NOTE_NO_EFFECT.match(note)
            if m:
                notes.setdefault(m.group(1), m.group(2))
                note_trials[m.group(1)] = note_trials.get(m.group(1), 0) + 1
    out = []
    for k in sorted(set(knobs) | set(notes)):
        ev = pairs.get(k, [])
        if k in notes:
            extra = f"; {len(ev)} isolated pair(s)" if ev else ""
            searched = "" if k in knobs else " (not a searched knob)"
            out.append(Effect(k, "no effect", f"trial note on {note_trials[k]} trial(s): {notes[k]}{searched}{extra}"))
        elif ev and all(s for *_, s, _ in ev):
            out.append(Effect(k, "no effect", "; ".join(t for *_, t in ev)))
        elif ev:
            out.append(Effect(k, "effect", "; ".join(t for *_, s, t in ev if not s)))
        else:
            out.append(Effect(k, "not isolated", "no two ok trials differ in this knob alone"))
    return out


# --------------------------------------------------------------------------- search cost
@dataclasses.dataclass
class SearchCost:
    trial_s: float  # wall seconds of every trial, summed
    by_status: dict[str, float]  # status -> trial seconds
    inferred: int  # trials skipped as OOMs before launch: inferred from a real OOM, or predicted by the memory model
    saved_s: float  # what running them would have cost (estimate)
    saved_basis: str  # how saved_s was estimated
    wall_s: Optional[float]  # first start to last end
    predicted: int = 0  # of ``inferred``: those the memory model predicted


def search_cost(view: StudyView) -> SearchCost:
    """Trial-seconds spent, by status, and what skipping OOMs before launch saved (inferred and predicted)."""
    df = view.trials
    if df.empty:
        return SearchCost(0.0, {}, 0, 0.0, "", None)
    dur = df["duration_s"].fillna(0.0)
    by_status = {s: float(dur[df["status"] == s].sum()) for s in df["status"].unique()}
    n_predicted = int((df["status"] == Status.PREDICTED_OOM).sum())
    n_inferred = int((df["status"] == Status.INFERRED_OOM).sum()) + n_predicted
    oom_d = df.loc[(df["status"] == Status.OOM) & df["duration_s"].notna(), "duration_s"]
    if len(oom_d):
        per, basis = float(oom_d.mean()), f"mean OOM trial {oom_d.mean():.1f} s"
    else:
        run_d = df.loc[df["status"].isin([Status.OK, Status.HANG]) & df["duration_s"].notna(), "duration_s"]
        per = float(run_d.mean()) if len(run_d) else 0.0
        basis = f"mean trial {per:.1f} s (no real OOM to time)"
    starts = df["datetime_start"].dropna()
    ends = df["datetime_complete"].dropna()
    wall = (ends.max() - starts.min()).total_seconds() if len(starts) and len(ends) else None
    return SearchCost(float(dur.sum()), by_status, n_inferred, per * n_inferred, basis, wall, n_predicted)


# --------------------------------------------------------------------------- baseline vs best
@dataclasses.dataclass
class BaselineVsBest:
    baseline: Optional[pd.Series]  # the baseline trial's row, if any
    best: Optional[pd.Series]  # the chosen trial's row, if any
    thr_ratio: Optional[float] = None  # best / baseline, when the baseline is feasible (single trials)
    mem_ratio: Optional[float] = None
    confirmed: Optional[dict] = (
        None  # the pick's confirmed figures (tuner.rules.finalists.summarize), when it rests on them
    )


def baseline_vs_best(view: StudyView, chosen: Optional[int]) -> BaselineVsBest:
    """The baseline trial against trial ``chosen`` (export's pick)."""
    df = view.trials
    base = df.loc[df["baseline"]] if not df.empty else df
    b = base.iloc[0] if len(base) else None
    best = df.loc[df["number"] == chosen].iloc[0] if chosen is not None else None
    out = BaselineVsBest(b, best)
    if b is not None and best is not None and b["feasible"] and b["throughput"]:
        out.thr_ratio = best["throughput"] / b["throughput"]
        out.mem_ratio = best["peak_memory_gb"] / b["peak_memory_gb"]
    return out


# --------------------------------------------------------------------------- the data the trials saw
LENGTH_KEYS = ("p10", "p50", "p90", "max")


def lengths_seen(view: StudyView, numbers: Optional[list[int]] = None) -> tuple[dict, int]:
    """The token-length distribution the study's trials saw (``TrialRecord.lengths``), and how many
    trials it is from: ``{"prompt": {"p10", "p50", "p90", "max"}, "response": {...}}``, each figure the
    median over the trials (``max``: the largest). ``numbers``: only these trials (default: every ok
    trial). Empty when no trial recorded lengths (a study from before they were recorded)."""
    df = view.trials
    if numbers is None:
        numbers = [int(n) for n in df.loc[df["status"] == Status.OK, "number"]] if not df.empty else []
    seen = [view.record(n).lengths for n in numbers]
    seen = [x for x in seen if isinstance(x, dict) and x]
    return merge_lengths(seen), len(seen)


def merge_lengths(seen: list[dict]) -> dict:
    """Several runs' length percentiles as one: the median of each percentile, the largest ``max``."""
    out: dict = {}
    for part in sorted({p for x in seen for p in x}):
        figs = {}
        for k in LENGTH_KEYS:
            vals = [float(x[part][k]) for x in seen if isinstance(x.get(part), dict) and x[part].get(k) is not None]
            if vals:
                figs[k] = max(vals) if k == "max" else statistics.median(vals)
        if figs:
            out[part] = figs
    return out


# --------------------------------------------------------------------------- one report's findings
@dataclasses.dataclass
class ReportData:
    view: StudyView
    headroom: float
    importances: Importances
    effects: list[Effect]
    cost: SearchCost
    pick: Optional[Choice]  # what ``ppotune export`` would choose, None when nothing fits
    pick_error: Optional[str]  # why nothing fits
    memory: Optional[MemoryFindings] = None  # the memory model, the pick's projection, the worst cases

    @property
    def baseline_vs_best(self) -> BaselineVsBest:
        out = baseline_vs_best(self.view, self.pick.chosen if self.pick is not None else None)
        if self.pick is not None and self.pick.unconfirmed is None:
            out.confirmed = self.pick.confirmed
        return out


def build(view: StudyView, *, headroom: float = DEFAULT_HEADROOM) -> ReportData:
    try:
        pick, err = choose(view, pick="max-throughput", headroom=headroom), None
    except NoFit as e:  # nothing feasible (yet), or nothing under the headroom
        pick, err = None, str(e)
    memory = memory_findings(view, pick.chosen if pick is not None else None)
    return ReportData(
        view, headroom, compute_importances(view), knob_effects(view), search_cost(view), pick, err, memory
    )
