"""``ppotune validate``'s verdict (pure, over the study's figures and the measured rounds): does the exported config
hold up? The rule and why it is that rule: :mod:`tuner.commands.validate`'s docstring and
docs/decisions.md#validate-pass-rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainer.contracts import Status, StorageError
from tuner.results.analysis import MEMORY_ABS_TOL_GB
from tuner.rules.finalists import CONFIRMATION_ATTR, entry_of, log_interval, paired_ratios

__all__ = [
    "RATIO_TOL",
    "MEMORY_TOL",
    "LENGTH_TOL",
    "StudyFigures",
    "ValidationVerdict",
    "verdict",
    "measured_verdict",
    "length_warnings",
    "study_figures",
]

RATIO_TOL = 0.05  # the measured ratio within ±5% of the study's
MEMORY_TOL = 0.05  # the measured peak at most 5% over the study's
LENGTH_TOL = 0.20  # a p50 or p90 token length off by more than this: the data differs


@dataclass(frozen=True)
class StudyFigures:
    """What the study says about the exported config."""

    trial: int  # the study's trial of CONFIG
    baseline: int
    ratio: Optional[float]  # throughput / the baseline's
    ratio_ci: Optional[tuple[float, float]]
    peak_memory_gb: Optional[float]
    confirmed: bool  # from the confirmation (else two single trials)
    memory_source: Optional[str]


@dataclass
class ValidationVerdict:
    passed: bool
    lines: list[str] = field(default_factory=list)  # one per check, each saying PASS/FAIL/not compared and why


def _ci(ci: Optional[tuple[float, float]]) -> str:
    return f"90% interval {ci[0]:.2f}–{ci[1]:.2f}" if ci else "no interval"


def verdict(
    *,
    ratio: Optional[float],
    ratio_ci: Optional[tuple[float, float]],
    study: StudyFigures,
    peak_memory_gb: Optional[float],
    memory_comparable: bool = True,
    failed_runs: int = 0,
    memory_floor_gb: float = 0.0,
) -> ValidationVerdict:
    """PASS when the throughput ratio agrees with the study's and memory is not over it (module docstring)."""
    out = ValidationVerdict(passed=True)
    if failed_runs:
        out.passed = False
        out.lines.append(f"FAIL  {failed_runs} run(s) of the config did not end ok")
    if ratio is None:
        out.passed = False
        out.lines.append("FAIL  ratio: no round measured both the config and the baseline")
    elif study.ratio is None:
        out.passed = False
        out.lines.append(f"FAIL  ratio: measured {ratio:.2f}x, but the study has no ratio for trial #{study.trial}")
    else:
        off = ratio / study.ratio - 1.0
        overlap = (
            ratio_ci is not None
            and (study.ratio_ci or (study.ratio, study.ratio))[1] >= ratio_ci[0]
            and ratio_ci[1] >= (study.ratio_ci or (study.ratio, study.ratio))[0]
        )
        ok = abs(off) <= RATIO_TOL or overlap
        why = (
            f"within ±{RATIO_TOL:.0%}"
            if abs(off) <= RATIO_TOL
            else "the intervals overlap (within noise)"
            if overlap
            else f"off by more than ±{RATIO_TOL:.0%} and the intervals do not overlap"
        )
        kind = "confirmed" if study.confirmed else "single trials, unconfirmed"
        out.passed &= ok
        out.lines.append(
            f"{'PASS' if ok else 'FAIL'}  ratio to the baseline: measured {ratio:.2f}x ({_ci(ratio_ci)}) vs the "
            f"study's {study.ratio:.2f}x ({_ci(study.ratio_ci)}; {kind}): {off:+.1%}, {why}"
        )
    if peak_memory_gb is None or study.peak_memory_gb is None:
        out.lines.append("n/a   peak memory: not measured on one side")
    elif not memory_comparable:
        out.lines.append(
            f"n/a   peak memory: measured {peak_memory_gb:.3f} GB vs the study's {study.peak_memory_gb:.3f} GB, "
            f"but measured differently (study: {study.memory_source}): not compared"
        )
    else:
        allowed = study.peak_memory_gb + max(MEMORY_TOL * study.peak_memory_gb, memory_floor_gb)
        ok = peak_memory_gb <= allowed + 1e-12
        out.passed &= ok
        out.lines.append(
            f"{'PASS' if ok else 'FAIL'}  peak memory: measured {peak_memory_gb:.3f} GB vs the study's "
            f"{study.peak_memory_gb:.3f} GB ({peak_memory_gb / study.peak_memory_gb - 1:+.1%}; allowed up to "
            f"{allowed:.3f} GB)"
        )
    return out


def length_warnings(study: dict, seen: dict, *, tol: float = LENGTH_TOL) -> list[str]:
    """Where the token lengths these runs saw differ from the study's: p50 or p90 off by more than ``tol``.

    Both are ``{"prompt": {"p10", "p50", "p90", "max"}, "response": {...}}``; a part or a figure missing
    on either side is not compared."""
    out = []
    for part in ("prompt", "response"):
        a, b = study.get(part) or {}, seen.get(part) or {}
        for k in ("p50", "p90"):
            if a.get(k) and b.get(k) is not None and abs(b[k] / a[k] - 1.0) > tol:
                out.append(
                    f"{part} length {k}: {b[k]:.0f} tokens here vs {a[k]:.0f} in the study ({b[k] / a[k] - 1:+.0%})"
                )
    return out


def study_figures(view, trial: int) -> StudyFigures:
    """The study's ratio, interval and peak for ``trial`` (confirmed when the confirmation holds it); StorageError
    when the study has no measured baseline."""
    df = view.trials
    base = df.loc[df["baseline"] & (df["status"] == Status.OK) & df["confirm_of"].isna()]
    if base.empty:
        raise StorageError(f"study {view.name!r} has no measured baseline trial to compare with")
    b = int(base.iloc[0]["number"])
    conf = view.attrs.get(CONFIRMATION_ATTR)
    e = entry_of(conf, trial)
    rec = view.record(trial)
    if e is not None and conf.get("baseline") == b and e.get("ratio") is not None:
        ci = tuple(e["ratio_ci"]) if e.get("ratio_ci") else None
        return StudyFigures(trial, b, e["ratio"], ci, e.get("peak_memory_gb"), True, rec.memory_source)
    row = df.loc[df["number"] == trial].iloc[0]
    b_thr = base.iloc[0]["throughput"]
    ratio = float(row["throughput"] / b_thr) if b_thr else None
    return StudyFigures(trial, b, ratio, None, float(row["peak_memory_gb"]), False, rec.memory_source)


def measured_verdict(runs: dict, records: dict, study: StudyFigures) -> tuple[ValidationVerdict, dict]:
    """The verdict on the runs, and what they measured (validate.json's ``measured``, less the lengths)."""
    ratios = paired_ratios(runs["config"], runs["baseline"])
    ratio, ratio_ci = log_interval(ratios)
    peaks = [x.peak_memory_gb for x in runs["config"] if x.peak_memory_gb is not None]
    sources = {x.memory_source for x in records["config"] if x.memory_source}
    comparable = study.memory_source is None or sources <= {study.memory_source}
    v = verdict(
        ratio=ratio,
        ratio_ci=ratio_ci,
        study=study,
        peak_memory_gb=max(peaks) if peaks else None,
        memory_comparable=comparable,
        failed_runs=sum(1 for x in runs["config"] if not x.ok),
        memory_floor_gb=MEMORY_ABS_TOL_GB,
    )
    measured = {
        "ratio": ratio,
        "ratio_ci": list(ratio_ci) if ratio_ci else None,
        "ratios": ratios,
        "peak_memory_gb": max(peaks) if peaks else None,
        "runs": {label: [x.__dict__ for x in xs] for label, xs in runs.items()},
    }
    return v, measured
