"""``ppotune report``: what a study found, as one offline HTML page plus PNG, CSV and Markdown.

Reads the study read-only (docs/contracts.md §3), so it can run while the search
is still going. Writes into ``--to``:

- ``report.html``  self-contained (inline CSS, base64 PNG images, no links out)
- ``pareto.png``   throughput vs peak memory, every trial, failures on a strip below
- ``importances.png``, ``phases.png``
- ``trials.csv``   one row per trial (:func:`tuner.studyio.trials_frame`)
- ``summary.md``   the same findings as text
"""
from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import html
import io
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import optuna
import pandas as pd
# Figure objects, not pyplot: no global backend or figure registry (Agg renders the PNGs;
# a notebook keeps its own backend).
from matplotlib.figure import Figure

from tuner import studyio
from tuner.studyio import PHASES, StudyError, StudyView, missing, short_knob

__all__ = [
    "write_report",
    "build",
    "ReportData",
    "compute_importances",
    "knob_effects",
    "search_cost",
    "plot_pareto",
    "plot_importances",
    "plot_phases",
    "figure_png",
    "add_arguments",
    "run",
]

DEFAULT_HEADROOM = 0.10
MIN_TRIALS_FOR_IMPORTANCE = 4
# "No effect" thresholds: a throughput change below max(5%, 2 x the larger step-time CV)
# and a memory change below max(3%, 0.05 GB) is indistinguishable from run-to-run noise.
THROUGHPUT_REL_TOL = 0.05
MEMORY_REL_TOL = 0.03
MEMORY_ABS_TOL_GB = 0.05

STATUS_STYLE = {  # status -> (label, colour, marker)
    "ok": ("ok", "#1f77b4", "o"),
    "oom": ("OOM", "#d62728", "X"),
    "inferred_oom": ("inferred OOM (not run)", "#ff9896", "x"),
    "hang": ("hang (timed out)", "#ff7f0e", "v"),
    "crash": ("crash", "#7f7f7f", "s"),
    "invalid": ("invalid config", "#bcbd22", "D"),
    "duplicate": ("duplicate (not run)", "#c7c7c7", "o"),  # the tuner's dedupe: same config as an earlier trial
    "interrupted": ("interrupted (re-queued)", "#9467bd", "o"),  # the tuner stopped or died mid-trial
    "running": ("running", "#17becf", "o"),
}
STRIP_ROWS = ("oom", "inferred_oom", "hang", "crash", "invalid")


# --------------------------------------------------------------------------- analysis
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
    feas = df.loc[studyio.measured_feasible(df)] if not df.empty else df
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
        tmp = optuna.create_study(directions=["maximize", "minimize"])
    finally:
        optuna.logging.set_verbosity(level)
    for t, (_, r) in zip(trials, feas.iterrows()):
        tmp.add_trial(optuna.trial.create_trial(
            params={k: t.params[k] for k in varying},
            distributions={k: t.distributions[k] for k in varying},
            values=[float(r["throughput"]), float(r["peak_memory_gb"])],
        ))
    # PED-ANOVA compares the top quantile with the rest; with a small study the default
    # 10% is a single trial, so take at least 3.
    q = min(0.5, max(0.1, 3.0 / n))
    evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=q)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            thr = optuna.importance.get_param_importances(tmp, params=varying, evaluator=evaluator,
                                                          target=lambda t: -t.values[0])  # it minimizes
            mem = optuna.importance.get_param_importances(tmp, params=varying, evaluator=evaluator,
                                                          target=lambda t: t.values[1])
    except Exception as e:  # an evaluator limit we did not foresee must not sink the report
        return Importances({}, {}, n, f"importance evaluation failed: {e}")
    msg = f"PED-ANOVA over {n} feasible trials"
    if n < 20:
        msg += " (rough with fewer than ~20)"
    return Importances(dict(thr), dict(mem), n, msg)


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
    ok = df.loc[studyio.measured_feasible(df)] if not df.empty else df
    params = {int(n): view.trial(int(n)).params for n in ok["number"]}
    rows = {int(r["number"]): r for _, r in ok.iterrows()}
    pairs: dict[str, list[tuple[int, int, bool, str]]] = {k: [] for k in knobs}
    nums = sorted(params)
    for i, a in enumerate(nums):
        for b in nums[i + 1:]:
            pa, pb = params[a], params[b]
            if set(pa) != set(pb):
                continue
            diff = [k for k in pa if pa[k] != pb[k]]
            if len(diff) != 1:
                continue
            ra, rb = rows[a], rows[b]
            cv = max(_z(ra["throughput_cv"]), _z(rb["throughput_cv"]))
            thr_tol = max(THROUGHPUT_REL_TOL, 2.0 * cv)
            d_thr = abs(ra["throughput"] - rb["throughput"]) / max(ra["throughput"], rb["throughput"], 1e-12)
            d_mem = abs(ra["peak_memory_gb"] - rb["peak_memory_gb"])
            mem_tol = max(MEMORY_REL_TOL * max(ra["peak_memory_gb"], rb["peak_memory_gb"]), MEMORY_ABS_TOL_GB)
            same = d_thr <= thr_tol and d_mem <= mem_tol
            signed = (rb["throughput"] - ra["throughput"]) / ra["throughput"]
            text = (f"#{a} vs #{b} ({pa[diff[0]]} -> {pb[diff[0]]}): throughput {signed:+.1%} "
                    f"(noise {thr_tol:.0%}), memory {d_mem:.2f} GB (noise {mem_tol:.2f} GB)")
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


def search_cost(view: StudyView) -> dict[str, Any]:
    """Trial-seconds spent, by status, and what OOM inference saved."""
    df = view.trials
    if df.empty:
        return {"trial_s": 0.0, "by_status": {}, "inferred": 0, "saved_s": 0.0, "saved_basis": "", "wall_s": None}
    dur = df["duration_s"].fillna(0.0)
    by_status = {s: float(dur[df["status"] == s].sum()) for s in df["status"].unique()}
    n_inferred = int((df["status"] == "inferred_oom").sum())
    oom_d = df.loc[(df["status"] == "oom") & df["duration_s"].notna(), "duration_s"]
    if len(oom_d):
        per, basis = float(oom_d.mean()), f"mean OOM trial {oom_d.mean():.1f} s"
    else:
        run_d = df.loc[df["status"].isin(["ok", "hang"]) & df["duration_s"].notna(), "duration_s"]
        per = float(run_d.mean()) if len(run_d) else 0.0
        basis = f"mean trial {per:.1f} s (no real OOM to time)"
    starts = df["datetime_start"].dropna()
    ends = df["datetime_complete"].dropna()
    wall = (ends.max() - starts.min()).total_seconds() if len(starts) and len(ends) else None
    return {
        "trial_s": float(dur.sum()),
        "by_status": by_status,
        "inferred": n_inferred,
        "saved_s": per * n_inferred,
        "saved_basis": basis,
        "wall_s": wall,
    }


# --------------------------------------------------------------------------- plots
def _memory_x(r: pd.Series) -> tuple[Optional[float], bool]:
    """Where a trial sits on the memory axis: (GB, penalized?). Measured beats penalized."""
    for col in ("peak_memory_gb", "mem.external_peak_gb", "mem.device_used_peak_gb", "mem.reserved_peak_gb", "mem.rss_peak_gb"):
        v = r.get(col)
        if v is not None and not pd.isna(v) and r["status"] != "inferred_oom":
            return float(v), False
    v = r.get("value_memory")
    if v is not None and not pd.isna(v):
        return float(v), True
    return None, False


def plot_pareto(view: StudyView, *, headroom: float = DEFAULT_HEADROOM, chosen: Optional[int] = None):
    """Throughput vs peak memory. Returns a matplotlib Figure (the caller saves or shows it)."""
    df = view.trials
    dev, dev_label = view.device_memory
    dev_label = dev_label.split(" (")[0]  # the caveat is in the page text
    fig = Figure(figsize=(10, 7.2))
    ax, strip = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [4, 1.5], "hspace": 0.16})
    ok = df.loc[studyio.measured_feasible(df)] if not df.empty else df
    xs = list(ok["peak_memory_gb"]) if len(ok) else []
    strip_pts = []  # (row, x, penalized, number)
    unplaced: dict[str, list[int]] = {}
    for _, r in (df.loc[df["status"].isin(STRIP_ROWS)] if not df.empty else df).iterrows():
        x, pen = _memory_x(r)
        if x is None:
            unplaced.setdefault(r["status"], []).append(int(r["number"]))
        else:
            strip_pts.append((r["status"], x, pen, int(r["number"])))
    measured_x = xs + [x for _, x, pen, _ in strip_pts if not pen]
    lo, hi = (min(measured_x), max(measured_x)) if measured_x else (0.0, dev or 1.0)
    # Show the device line when the trials come near it; otherwise zoom on the trials
    # and say where the line is, or every point collapses against the y axis.
    show_device = bool(dev) and hi >= 0.5 * (1 - headroom) * dev
    if show_device or not measured_x:
        xmin, xmax = 0.0, max(hi, dev or 0.0, 1e-3) * 1.08
    else:
        pad = max(hi - lo, 0.05 * hi, 1e-3)
        xmin, xmax = max(0.0, lo - pad), hi + pad

    # feasible trials, front, baseline, pick
    if len(ok):
        front = ok.loc[ok["pareto"]].sort_values("peak_memory_gb")
        rest = ok.loc[~ok["pareto"]]
        ax.scatter(rest["peak_memory_gb"], rest["throughput"], s=36, c="#9ecae1", edgecolors="#3182bd",
                   linewidths=0.6, label="ok (dominated)", zorder=3)
        ax.step(front["peak_memory_gb"], front["throughput"], where="post", color="#08519c", lw=1.4, zorder=2)
        ax.scatter(front["peak_memory_gb"], front["throughput"], s=64, c="#08519c", edgecolors="white",
                   linewidths=0.8, label="Pareto front", zorder=4)
        base = ok.loc[ok["baseline"]]
        if len(base):
            ax.scatter(base["peak_memory_gb"], base["throughput"], s=260, marker="*", facecolors="none",
                       edgecolors="black", linewidths=1.2, label="baseline (base config)", zorder=5)
        if chosen is not None and (ok["number"] == chosen).any():
            c = ok.loc[ok["number"] == chosen].iloc[0]
            ax.scatter([c["peak_memory_gb"]], [c["throughput"]], s=240, facecolors="none", edgecolors="#2ca02c",
                       linewidths=2.2, label=f"export pick #{chosen}", zorder=6)
        label_all = len(ok) <= 60
        dups: dict[int, list[int]] = {}
        for _, r in df.loc[df["duplicate_of"].notna()].iterrows():
            dups.setdefault(int(r["duplicate_of"]), []).append(int(r["number"]))
        for _, r in ok.iterrows():
            if label_all or r["pareto"] or r["baseline"]:
                k = len(dups.get(int(r["number"]), []))
                same = f" (+{k} re-sampled)" if k else ""
                ax.annotate(f"#{int(r['number'])}{same}", (r["peak_memory_gb"], r["throughput"]), xytext=(4, 4),
                            textcoords="offset points", fontsize=7, color="#333333")
        ax.set_ylim(0, ok["throughput"].max() * 1.15)
    else:
        ax.text(0.5, 0.5, "no feasible trial yet", transform=ax.transAxes, ha="center", va="center", color="#888888")
        ax.set_ylim(0, 1)
    ax.set_ylabel("throughput (tokens/s/GPU)")
    ax.set_title(f"study {view.name}: throughput vs peak memory ({len(df)} trials)", fontsize=11)
    ax.grid(True, alpha=0.3)

    # the device line and the headroom line, on both panels
    for a in (ax, strip):
        if show_device:
            a.axvline(dev, color="#d62728", lw=1.6)
            a.axvline((1 - headroom) * dev, color="#d62728", lw=1.0, ls="--")
            a.axvspan((1 - headroom) * dev, xmax, color="#d62728", alpha=0.06)
    if dev and not show_device:
        ax.text(0.99, 0.02, f"off scale \u2192 {dev_label}; keep {headroom:.0%} free: {(1 - headroom) * dev:.1f} GB",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=8, color="#d62728")
    if show_device:
        top = ax.get_ylim()[1]
        ax.text(dev, top * 0.98, f"{dev_label} ", color="#d62728", fontsize=8, ha="right", va="top", rotation=90)
        ax.text((1 - headroom) * dev, top * 0.98, f"keep {headroom:.0%} free: {(1 - headroom) * dev:.1f} GB ",
                color="#d62728", fontsize=8, ha="right", va="top", rotation=90)

    # the strip: failed trials have no real throughput (Optuna holds a penalized 0)
    rows = [s for s in STRIP_ROWS if any(p[0] == s for p in strip_pts) or s in unplaced] or list(STRIP_ROWS[:2])
    ypos = {s: i for i, s in enumerate(reversed(rows))}
    for status in rows:
        label, color, marker = STATUS_STYLE[status]
        pts = [p for p in strip_pts if p[0] == status]
        real = [p for p in pts if not p[2]]
        pen = [p for p in pts if p[2]]
        if real:
            strip.scatter([min(p[1], xmax * 0.995) for p in real], [ypos[status]] * len(real), marker=marker, s=55,
                          c=color, label=f"{label}: measured peak", zorder=3)
        if pen:
            strip.scatter([min(p[1], xmax * 0.995) for p in pen], [ypos[status]] * len(pen), marker=marker, s=55,
                          **({"c": color} if marker in ("x", "+") else {"facecolors": "none", "edgecolors": color}),
                          alpha=0.6, label=f"{label}: penalized value", zorder=3)
        pinned: dict[float, list[int]] = {}  # penalties far off the scale: pinned to the edge, named once
        for _, x, penalized, n in pts:
            if x > xmax * 0.995:
                pinned.setdefault(round(x, 1), []).append(n)
            else:
                strip.annotate(f"#{n}", (x, ypos[status]), xytext=(0, 6), textcoords="offset points",
                               fontsize=7, ha="center", color=color)
        for x, ns in pinned.items():
            names = ", ".join(f"#{n}" for n in ns[:10]) + (" ..." if len(ns) > 10 else "")
            strip.annotate(f"{names} at {x:g} GB \u2192", (xmax * 0.995, ypos[status]), xytext=(-8, 0),
                           textcoords="offset points", fontsize=7, ha="right", va="center", color=color)
        if status in unplaced:
            names = ", ".join(f"#{n}" for n in unplaced[status][:12]) + (" ..." if len(unplaced[status]) > 12 else "")
            strip.text(xmin + (xmax - xmin) * 0.01, ypos[status], f"no measurement: {names}", fontsize=7,
                       va="center", ha="left", color=color)
    if not strip_pts and not unplaced:
        strip.text(0.5, 0.5, "no failed or skipped trial", transform=strip.transAxes, ha="center", va="center",
                   fontsize=9, color="#888888")
    strip.set_yticks(list(ypos.values()))
    strip.set_yticklabels([STATUS_STYLE[s][0] for s in ypos], fontsize=8)
    strip.set_ylim(-0.7, len(rows) - 0.3)
    strip.set_xlim(xmin, xmax)
    strip.set_xlabel("peak memory per GPU (GB)  —  external sampler and in-process peak, whichever is larger")
    strip.grid(True, axis="x", alpha=0.3)
    strip.set_title("no throughput (failed or skipped): placed at measured peak, else at the penalized value",
                    fontsize=8, loc="left", color="#555555")
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = strip.get_legend_handles_labels()
    fig.legend(handles + h2, labels + l2, fontsize=7, loc="upper left", bbox_to_anchor=(0.905, 0.88), framealpha=0.9)
    return fig


def plot_importances(imp: Importances):
    knobs = sorted(set(imp.throughput) | set(imp.memory), key=lambda k: -(imp.throughput.get(k, 0) + imp.memory.get(k, 0)))
    fig = Figure(figsize=(10, max(2.4, 0.42 * len(knobs) + 1.2)))
    axes = fig.subplots(1, 2, sharey=True)
    for a, (title, vals, color) in zip(axes, (("throughput", imp.throughput, "#1f77b4"),
                                              ("peak memory", imp.memory, "#d62728"))):
        a.set_title(f"importance for {title}", fontsize=10)
        if not knobs:
            a.text(0.5, 0.5, imp.message, ha="center", va="center", wrap=True, fontsize=9, color="#666666",
                   transform=a.transAxes)
            a.set_xticks([])
            a.set_yticks([])
            continue
        ys = range(len(knobs))
        a.barh(list(ys), [vals.get(k, 0.0) for k in knobs], color=color)
        a.set_yticks(list(ys))
        a.set_yticklabels([short_knob(k) for k in knobs], fontsize=8)
        a.set_xlim(0, 1)
        a.grid(True, axis="x", alpha=0.3)
    if knobs:
        axes[0].invert_yaxis()  # most important on top (the y axis is shared: invert once)
    fig.suptitle(imp.message, fontsize=8, color="#555555")
    fig.tight_layout()
    return fig


_PHASE_COLORS = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#c7c7c7"]


def plot_phases(view: StudyView, numbers: list[int]):
    """Median step time split by phase, one bar per trial."""
    df = view.trials.set_index("number")
    numbers = [n for n in numbers if n in df.index]
    fig = Figure(figsize=(10, max(2.2, 0.45 * len(numbers) + 1.3)))
    ax = fig.subplots()
    if not numbers:
        ax.text(0.5, 0.5, "no measured trial", ha="center", va="center", transform=ax.transAxes)
        return fig
    left = [0.0] * len(numbers)
    for phase, color in zip(list(PHASES) + ["other"], _PHASE_COLORS):
        vals = []
        for i, n in enumerate(numbers):
            r = df.loc[n]
            if phase == "other":
                known = sum(_z(r.get(f"time.{p}")) for p in PHASES)
                v = max(_z(r["step_s"]) - known, 0.0)
            else:
                v = r.get(f"time.{phase}")
                v = 0.0 if v is None or pd.isna(v) else float(v)
            vals.append(v)
        if any(v > 1e-3 for v in vals):
            ax.barh(range(len(numbers)), vals, left=left, color=color, label=phase, height=0.6)
            left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(numbers)))
    ax.set_yticklabels([f"#{n}" + (" baseline" if df.loc[n, "baseline"] else "") for n in numbers], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median seconds per PPO step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title("step time by phase (Pareto configs and baseline)", fontsize=10)
    fig.tight_layout()
    return fig


def _z(v: Any) -> float:
    """A float, 0.0 where missing."""
    return 0.0 if missing(v) else float(v)


def figure_png(fig: Figure, path: Optional[Path] = None, dpi: int = 110) -> bytes:
    """A figure as PNG bytes (also written to ``path`` if given)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    data = buf.getvalue()
    if path is not None:
        path.write_bytes(data)
    return data


# --------------------------------------------------------------------------- the page
@dataclasses.dataclass
class ReportData:
    view: StudyView
    headroom: float
    importances: Importances
    effects: list[Effect]
    cost: dict
    pick: Any  # tuner.export.Choice or None
    pick_error: Optional[str]


def build(view: StudyView, *, headroom: float = DEFAULT_HEADROOM) -> ReportData:
    from tuner.export import choose

    try:
        pick, err = choose(view, pick="max-throughput", headroom=headroom), None
    except StudyError as e:
        pick, err = None, str(e)
    return ReportData(view, headroom, compute_importances(view), knob_effects(view), search_cost(view), pick, err)


def _f(v: Any, spec: str = ".2f") -> str:
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


def _e(v: Any) -> str:
    return html.escape(str(v))


def _dur(s: Optional[float]) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "–"
    return f"{s / 3600:.2f} h" if s >= 7200 else f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s"


def _baseline_vs_best(data: ReportData) -> dict:
    df = data.view.trials
    base = df.loc[df["baseline"]]
    b = base.iloc[0] if len(base) else None
    best = None
    if data.pick is not None:
        best = df.loc[df["number"] == data.pick.chosen].iloc[0]
    out = {"baseline": b, "best": best, "thr_ratio": None, "mem_ratio": None}
    if b is not None and best is not None and b["feasible"] and b["throughput"]:
        out["thr_ratio"] = best["throughput"] / b["throughput"]
        out["mem_ratio"] = best["peak_memory_gb"] / b["peak_memory_gb"]
    return out


def _knob_value_table(view: StudyView, numbers: list[int]) -> str:
    base_n = [int(n) for n in view.trials.loc[view.trials["baseline"], "number"]]
    cols = list(dict.fromkeys(base_n + numbers))
    params = {n: view.trial(n).params for n in cols}
    knobs = view.knobs
    head = "".join(f"<th>#{n}{' (baseline)' if n in base_n else ''}</th>" for n in cols)
    rows = []
    for k in knobs:
        ref = params[base_n[0]].get(k) if base_n else None
        cells = []
        for n in cols:
            v = params[n].get(k)  # absent: a conditional knob this trial did not use
            cls = ' class="diff"' if base_n and n not in base_n and v != ref else ""
            cells.append(f"<td{cls}>{'–' if v is None else _e(v)}</td>")
        rows.append(f'<tr><th class="knob" title="{_e(k)}">{_e(short_knob(k))}</th>{"".join(cells)}</tr>')
    return f'<table class="t"><tr><th>knob</th>{head}</tr>{"".join(rows)}</table>'


def _pareto_table(view: StudyView, numbers: list[int]) -> str:
    df = view.trials.set_index("number")
    phase_head = "".join(f"<th>{p}</th>" for p in PHASES)
    head = ("<tr><th rowspan=2>trial</th><th rowspan=2>throughput<br>tokens/s/GPU</th><th rowspan=2>CV</th>"
            "<th rowspan=2>peak memory<br>GB (objective)</th><th colspan=2>external sampler</th>"
            "<th colspan=3>in-process</th><th rowspan=2>step s</th>"
            f"<th colspan={len(PHASES)}>median seconds per phase</th></tr>"
            "<tr><th>peak GB</th><th>source</th><th>allocated</th><th>reserved</th><th>RSS</th>"
            f"{phase_head}</tr>")
    rows = []
    for n in numbers:
        r = df.loc[n]
        tag = " ★" if r["baseline"] else ""
        if not missing(r["confirm_of"]):
            tag += f"<br><span class='muted'>confirms #{int(r['confirm_of'])}</span>"
        phases = "".join(f"<td>{_f(r.get(f'time.{p}'), '.3f')}</td>" for p in PHASES)
        rows.append(
            f"<tr><td>#{n}{tag}</td><td>{_f(r['throughput'], '.1f')}</td><td>{_f(r['throughput_cv'], '.1%')}</td>"
            f"<td><b>{_f(r['peak_memory_gb'])}</b></td><td>{_f(r['mem.external_peak_gb'])}</td>"
            f"<td>{_e(r['memory_source'] or '–')}</td><td>{_f(r['mem.allocated_peak_gb'])}</td>"
            f"<td>{_f(r['mem.reserved_peak_gb'])}</td><td>{_f(r['mem.rss_peak_gb'])}</td>"
            f"<td>{_f(r['step_s'], '.3f')}</td>{phases}</tr>"
        )
    return f'<table class="t">{head}{"".join(rows)}</table>'


def _all_trials_table(view: StudyView) -> str:
    df = view.trials
    base_n = [int(n) for n in df.loc[df["baseline"], "number"]]
    base_p = view.trial(base_n[0]).params if base_n else {}
    rows = []
    for _, r in df.iterrows():
        n = int(r["number"])
        p = view.trial(n).params
        diff = ", ".join(f"{short_knob(k)}={v}" for k, v in sorted(p.items()) if base_p.get(k) != v) if n not in base_n else "(base config)"
        label, color, _ = STATUS_STYLE.get(r["status"], (r["status"], "#444444", "o"))
        extra = []
        if not pd.isna(r["inferred_from"]):
            extra.append(f"inferred from #{int(r['inferred_from'])}")
        if not pd.isna(r["confirm_of"]):
            extra.append(f"confirms #{int(r['confirm_of'])}")
        retry = view.trial(n).user_attrs.get("retry_of")
        if retry is not None:
            extra.append(f"re-run of interrupted #{retry}")
        if not pd.isna(r["duplicate_of"]):
            extra.append(f"same config as #{int(r['duplicate_of'])} (not re-run)")
        if r["error"]:
            extra.append((str(r["error"]).strip().splitlines() or [""])[0][:160])
        if r["notes"]:
            extra.append(r["notes"])
        flags = (" ★" if r["baseline"] else "") + (" ◆" if r["pareto"] else "")
        rows.append(
            f'<tr id="t{n}"><td>#{n}{flags}</td><td><span class="st" style="background:{color}">{_e(label)}</span></td>'
            f"<td>{_f(r['throughput'], '.1f')}</td><td>{_f(r['peak_memory_gb'])}</td><td>{_e(r['memory_source'] or '–')}</td>"
            f"<td>{_dur(r['duration_s'])}</td><td class=\"small\">{_e(diff)}</td><td class=\"small\">{_e('; '.join(extra))}</td></tr>"
        )
    return ('<table class="t"><tr><th>trial</th><th>status</th><th>throughput</th><th>peak GB</th><th>mem source</th>'
            f'<th>cost</th><th>knobs (vs baseline)</th><th>notes / error</th></tr>{"".join(rows)}</table>')


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:2px}h2{font-size:17px;margin-top:30px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;font-size:13px}.cards{display:flex;gap:12px;flex-wrap:wrap;margin:14px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:10px 14px;min-width:170px;background:#fafafa}
.card .v{font-size:20px;font-weight:600}.card .k{font-size:12px;color:#666}
table.t{border-collapse:collapse;font-size:12px;margin:8px 0}table.t td,table.t th{border:1px solid #ddd;padding:3px 7px;text-align:right}
table.t th{background:#f3f3f3}table.t th.knob,table.t td.small{text-align:left}td.small{font-size:11px;max-width:420px}
td.diff{background:#fff3cd;font-weight:600}.st{color:#fff;border-radius:3px;padding:1px 6px;font-size:11px}
img{max-width:100%}.warn{background:#fff3cd;border:1px solid #e0c36b;padding:6px 10px;border-radius:4px}
.noeffect{color:#a94442;font-weight:600}.muted{color:#888}code{background:#f4f4f4;padding:0 3px}
"""


def _html(data: ReportData, images: dict[str, bytes]) -> str:
    view = data.view
    df = view.trials
    dev, dev_label = view.device_memory
    attrs = view.attrs
    device = attrs.get("device") or {}
    counts = df["status"].value_counts().to_dict() if not df.empty else {}
    running = int((df["state"] == "RUNNING").sum()) if not df.empty else 0
    front = [int(n) for n in df.loc[df["pareto"], "number"]] if not df.empty else []
    front = sorted(front, key=lambda n: -float(df.loc[df["number"] == n, "throughput"].iloc[0]))
    bvb = _baseline_vs_best(data)
    cost = data.cost
    img = {k: "data:image/png;base64," + base64.b64encode(v).decode() for k, v in images.items()}

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>ppotune report: {_e(view.name)}</title>"
             f"<style>{_CSS}</style></head><body>"]
    parts.append(f"<h1>ppotune report: study <code>{_e(view.name)}</code></h1>")
    parts.append(
        f"<div class='sub'>{len(df)} trials · device {_e(device.get('name') or device.get('kind') or 'unknown')}"
        f" · {_e(dev_label)} · {attrs.get('nproc', '?')} processes · {attrs.get('steps', '?')} steps"
        f" ({attrs.get('warmup', '?')} warm-up) per trial · space {_e(attrs.get('space_path', '?'))}"
        f" · base config {_e(attrs.get('base_config_path', '?'))} · generated "
        f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}</div>"
    )
    if running:
        parts.append(f"<p class='warn'>The study is still running: {running} trial(s) in progress; this is a snapshot.</p>")
    if dev is None:
        parts.append("<p class='warn'>Device memory unknown: no headroom line, and export applies no headroom filter.</p>")

    # cards
    cards = [("trials", f"{len(df)}", " · ".join(f"{n} {STATUS_STYLE.get(s, (s,))[0]}" for s, n in counts.items()))]
    if bvb["best"] is not None:
        best = bvb["best"]
        cards.append(("best under headroom", f"#{int(best['number'])}",
                      f"{best['throughput']:.1f} tokens/s/GPU · {best['peak_memory_gb']:.2f} GB"))
    if bvb["thr_ratio"] is not None:
        cards.append(("best vs baseline", f"{bvb['thr_ratio']:.2f}x", f"throughput; memory {bvb['mem_ratio']:.2f}x"))
    cards.append(("search cost", _dur(cost["trial_s"]), f"trial time; OOM {_dur(cost['by_status'].get('oom', 0.0))}"))
    if cost["inferred"]:
        cards.append(("saved by OOM inference", f"≈{_dur(cost['saved_s'])}", f"{cost['inferred']} trials skipped"))
    parts.append("<div class='cards'>" + "".join(
        f"<div class='card'><div class='k'>{_e(k)}</div><div class='v'>{_e(v)}</div><div class='k'>{_e(s)}</div></div>"
        for k, v, s in cards) + "</div>")

    # pareto
    parts.append("<h2>Pareto front: throughput vs peak memory</h2>")
    parts.append(f"<img alt='Pareto plot' src='{img['pareto']}'>")
    parts.append(
        "<p class='sub'>Every trial is plotted. Up: faster; left: smaller. Dark points are the Pareto front of "
        "feasible trials. The red line is the memory a config must fit (the cap the search ran under, else the "
        f"device's), the dashed line keeps {data.headroom:.0%} of it free. Failed trials have no real throughput "
        "(Optuna records a penalized 0), so they sit on the strip below: at the peak the memory sampler saw when "
        "there is one, else at their penalized memory value (hollow), else listed as 'no measurement'.</p>")

    # baseline vs best
    parts.append("<h2>Baseline vs best</h2>")
    b, best = bvb["baseline"], bvb["best"]
    if data.pick_error:
        parts.append(f"<p class='warn'>{_e(data.pick_error)}</p>")
    if b is None:
        parts.append("<p class='muted'>No baseline trial (user_attr baseline) in the study.</p>")
    elif best is not None:
        if bvb["thr_ratio"] is not None:
            parts.append(
                f"<p>The fastest config keeping {data.headroom:.0%} of memory free, trial #{int(best['number'])}, runs at "
                f"<b>{best['throughput']:.1f}</b> tokens/s/GPU against the base config's {b['throughput']:.1f} "
                f"(trial #{int(b['number'])}): <b>{bvb['thr_ratio']:.2f}x</b> throughput at "
                f"{bvb['mem_ratio']:.2f}x the peak memory ({best['peak_memory_gb']:.2f} vs {b['peak_memory_gb']:.2f} GB).</p>")
        else:
            parts.append(f"<p>The base config (trial #{int(b['number'])}) ended <b>{_e(b['status'])}</b>; "
                         f"the fastest config that fits is trial #{int(best['number'])} at {best['throughput']:.1f} tokens/s/GPU.</p>")

    # pareto configs
    parts.append("<h2>Pareto configs</h2>")
    if front:
        parts.append("<p class='sub'>Peak memory by source: the objective is the larger of the tuner's external sampler "
                     "(NVML on GPU: includes NCCL buffers and the CUDA context; psutil RSS of the process tree on CPU) "
                     "and the trial's own in-process peaks (torch allocator allocated/reserved, or RSS). ★ baseline.</p>")
        parts.append(_pareto_table(view, front))
        parts.append("<p class='sub'>Knob values (highlighted where they differ from the baseline):</p>")
        parts.append(_knob_value_table(view, front))
        parts.append(f"<img alt='phases' src='{img['phases']}'>")
    else:
        parts.append("<p class='muted'>No feasible trial yet.</p>")

    # importances
    parts.append("<h2>Which knobs matter</h2>")
    imp = data.importances
    parts.append(f"<p class='sub'>{_e(imp.message)}. Importance is computed on feasible trials only, separately "
                 "for throughput and for peak memory.</p>")
    parts.append(f"<img alt='importances' src='{img['importances']}'>")
    if imp.throughput:
        rows = "".join(
            f"<tr><th class='knob' title='{_e(k)}'>{_e(short_knob(k))}</th><td>{imp.throughput.get(k, 0):.2f}</td>"
            f"<td>{imp.memory.get(k, 0):.2f}</td></tr>"
            for k in sorted(imp.throughput, key=lambda k: -imp.throughput[k]))
        parts.append(f"<table class='t'><tr><th>knob</th><th>throughput</th><th>memory</th></tr>{rows}</table>")
    eff_rows = "".join(
        f"<tr><th class='knob' title='{_e(e.knob)}'>{_e(short_knob(e.knob))}</th>"
        f"<td class='small'><span class='{'noeffect' if e.verdict == 'no effect' else 'muted' if e.verdict == 'not isolated' else ''}'>"
        f"{_e(e.verdict)}</span></td><td class='small'>{_e(e.evidence)}</td></tr>" for e in data.effects)
    parts.append("<h2>Knobs that changed nothing measurable</h2>")
    parts.append("<p class='sub'>'no effect': every pair of ok trials differing in this knob alone moved throughput "
                 f"by less than max({THROUGHPUT_REL_TOL:.0%}, 2×CV) and memory by less than "
                 f"max({MEMORY_REL_TOL:.0%}, {MEMORY_ABS_TOL_GB} GB), or the trainer noted the knob is a no-op here. "
                 "Drop such knobs from the space: they only cost trials.</p>")
    parts.append(f"<table class='t'><tr><th>knob</th><th>verdict</th><th>evidence</th></tr>{eff_rows}</table>")

    # cost
    parts.append("<h2>What the search cost</h2>")
    by = cost["by_status"]
    cost_rows = "".join(f"<tr><th class='knob'>{_e(STATUS_STYLE.get(s, (s,))[0])}</th><td>{counts.get(s, 0)}</td>"
                        f"<td>{_dur(v)}</td></tr>" for s, v in sorted(by.items(), key=lambda kv: -kv[1]))
    parts.append(f"<table class='t'><tr><th>status</th><th>trials</th><th>trial time</th></tr>{cost_rows}"
                 f"<tr><th class='knob'>total</th><td>{len(df)}</td><td><b>{_dur(cost['trial_s'])}</b></td></tr></table>")
    parts.append(f"<p>Wall clock {_dur(cost['wall_s'])}. OOM inference skipped {cost['inferred']} trial(s), saving "
                 f"≈{_dur(cost['saved_s'])} ({_e(cost['saved_basis'])} × {cost['inferred']}).</p>")

    # every trial
    parts.append("<h2>All trials</h2>")
    parts.append("<p class='sub'>★ baseline · ◆ Pareto front. Knobs are shown where they differ from the baseline.</p>")
    parts.append(_all_trials_table(view))
    parts.append(f"<p class='sub'>Storage: <code>{_e(view.storage)}</code>. Open it live with "
                 f"<code>optuna-dashboard {_e(view.storage)}</code>.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _summary_md(data: ReportData) -> str:
    view = data.view
    df = view.trials
    dev, dev_label = view.device_memory
    counts = df["status"].value_counts().to_dict() if not df.empty else {}
    bvb = _baseline_vs_best(data)
    out = [f"# ppotune report: study `{view.name}`", "",
           f"- trials: {len(df)} ({', '.join(f'{n} {s}' for s, n in counts.items())})",
           f"- memory: {dev_label}; headroom {data.headroom:.0%}"]
    if bvb["best"] is not None:
        best = bvb["best"]
        out.append(f"- best under headroom: trial #{int(best['number'])}, {best['throughput']:.1f} tokens/s/GPU, "
                   f"peak {best['peak_memory_gb']:.2f} GB")
    if bvb["thr_ratio"] is not None:
        out.append(f"- vs baseline #{int(bvb['baseline']['number'])}: {bvb['thr_ratio']:.2f}x throughput, "
                   f"{bvb['mem_ratio']:.2f}x peak memory")
    if data.pick_error:
        out.append(f"- export: {data.pick_error}")
    c = data.cost
    out.append(f"- cost: {_dur(c['trial_s'])} of trials (OOM {_dur(c['by_status'].get('oom', 0.0))}, "
               f"hang {_dur(c['by_status'].get('hang', 0.0))}); {c['inferred']} inferred OOM(s) saved ≈{_dur(c['saved_s'])}")
    out += ["", "## Pareto front", "", "| trial | throughput (tokens/s/GPU) | peak memory (GB) | source | step (s) |",
            "|---|---|---|---|---|"]
    for _, r in df.loc[df["pareto"]].sort_values("throughput", ascending=False).iterrows() if not df.empty else []:
        out.append(f"| #{int(r['number'])}{' (baseline)' if r['baseline'] else ''} | {r['throughput']:.1f} | "
                   f"{r['peak_memory_gb']:.2f} | {r['memory_source'] or '–'} | {_f(r['step_s'], '.3f')} |")
    imp = data.importances
    out += ["", "## Knob importances", "", imp.message + "."]
    if imp.throughput:
        out += ["", "| knob | throughput | memory |", "|---|---|---|"]
        out += [f"| `{k}` | {imp.throughput.get(k, 0):.2f} | {imp.memory.get(k, 0):.2f} |"
                for k in sorted(imp.throughput, key=lambda k: -imp.throughput[k])]
    no = [e for e in data.effects if e.verdict == "no effect"]
    out += ["", "## No measurable effect", ""]
    out += [f"- `{e.knob}`: {e.evidence}" for e in no] or ["- none found"]
    out += ["", "Plots: pareto.png, importances.png, phases.png. Every trial: trials.csv. The page: report.html.", ""]
    return "\n".join(out)


def write_report(storage_url: str, study_name: Optional[str], out_dir: str | Path, *,
                 memory_headroom: float = DEFAULT_HEADROOM) -> Path:
    """Write report.html, pareto.png, importances.png, phases.png, trials.csv and summary.md.

    ``storage_url``: an Optuna storage URL, ``journal:PATH``, or a search out dir.
    ``out_dir``: where to write; a ``ppotune search`` output dir (it holds study.db,
    study.log or trials/) gets the files in ``out_dir/report``, where
    ``ppotune report --out DIR`` puts them. Returns the path of report.html. Never
    writes to the storage. (``ppotune search --report`` calls this.)
    """
    spec = studyio.resolve_storage(storage=storage_url)
    study = studyio.load_study(spec, study_name)
    view = StudyView(study=study, trials=studyio.trials_frame(study), storage=spec)
    out = Path(out_dir)
    if any((out / n).exists() for n in ("study.db", "study.log", "trials")):
        out = out / "report"
    return write_view_report(view, out, memory_headroom=memory_headroom)


def write_view_report(view: StudyView, out_dir: str | Path, *, memory_headroom: float = DEFAULT_HEADROOM) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = build(view, headroom=memory_headroom)
    df = view.trials
    chosen = data.pick.chosen if data.pick is not None else None
    front = [int(n) for n in df.loc[df["pareto"], "number"]] if not df.empty else []
    front = sorted(front, key=lambda n: -float(df.loc[df["number"] == n, "throughput"].iloc[0]))
    base = [int(n) for n in df.loc[df["baseline"] & df["feasible"], "number"]] if not df.empty else []
    images = {
        "pareto": figure_png(plot_pareto(view, headroom=memory_headroom, chosen=chosen), out / "pareto.png"),
        "importances": figure_png(plot_importances(data.importances), out / "importances.png"),
        "phases": figure_png(plot_phases(view, list(dict.fromkeys(front + base))), out / "phases.png"),
    }
    df.to_csv(out / "trials.csv", index=False)
    (out / "summary.md").write_text(_summary_md(data))
    page = out / "report.html"
    page.write_text(_html(data, images), encoding="utf-8")
    return page


# --------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    studyio.add_study_arguments(parser)
    parser.add_argument("--to", metavar="DIR", help="where to write (default: DIR/report with --out, else ./ppotune_report)")
    parser.add_argument("--memory-headroom", type=float, default=DEFAULT_HEADROOM, metavar="F",
                        help="fraction of device memory to keep free, drawn on the plot (default 0.10)")


def run(args) -> int:
    if not 0.0 <= args.memory_headroom < 1.0:
        print(f"ppotune report: --memory-headroom must be in [0, 1), got {args.memory_headroom}", file=sys.stderr)
        return 2
    try:
        view = studyio.view_from_args(args)
    except StudyError as e:
        print(f"ppotune report: {e}", file=sys.stderr)
        return 2
    to = Path(args.to) if args.to else (Path(args.out) / "report" if args.out else Path("ppotune_report"))
    page = write_view_report(view, to, memory_headroom=args.memory_headroom)
    print(f"{page}  ({len(view.trials)} trials)")
    for name in ("pareto.png", "importances.png", "phases.png", "trials.csv", "summary.md"):
        print(f"  {to / name}")
    return 0
