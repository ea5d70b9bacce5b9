"""The report's figures: Pareto front, importances, step time by phase.

Each function returns a matplotlib :class:`~matplotlib.figure.Figure`; :func:`figure_png`
turns one into PNG bytes. Figure objects, not pyplot: no global backend or figure registry
(Agg renders the PNGs; a notebook keeps its own backend).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Optional

import pandas as pd
from matplotlib.figure import Figure

from trainer.contracts import DEFAULT_HEADROOM, PHASES, Status, short_knob
from tuner.results.analysis import Importances
from tuner.results.view import TIME_PREFIX, StudyView, measured_feasible, value_or_zero
from tuner.rules.finalists import CONFIRMATION_ATTR

__all__ = ["STATUS_STYLE", "plot_pareto", "plot_importances", "plot_phases", "figure_png"]

#: status -> (label, colour, marker), in display order; "running" is a trial with no status yet
STATUS_STYLE = {
    Status.OK: ("ok", "#1f77b4", "o"),
    Status.OOM: ("OOM", "#d62728", "X"),
    Status.INFERRED_OOM: ("inferred OOM (not run)", "#ff9896", "x"),
    Status.PREDICTED_OOM: ("predicted OOM (not run)", "#f7b6d2", "x"),  # the memory model, beyond its error
    Status.HANG: ("hang (timed out)", "#ff7f0e", "v"),
    Status.CRASH: ("crash", "#7f7f7f", "s"),
    Status.INVALID: ("invalid config", "#bcbd22", "D"),
    Status.DUPLICATE: ("duplicate (not run)", "#c7c7c7", "o"),  # the tuner's dedupe: same config as an earlier trial
    Status.INTERRUPTED: ("interrupted (re-queued)", "#9467bd", "o"),  # the tuner stopped or died mid-trial
    Status.OVER_BUDGET: ("over budget (not run)", "#dbdb8d", "o"),  # asked in a race for the last --trials slot
    "running": ("running", "#17becf", "o"),
}
#: the statuses on the strip under the Pareto plot: no throughput, maybe a memory peak
STRIP_ROWS = (Status.OOM, Status.INFERRED_OOM, Status.PREDICTED_OOM, Status.HANG, Status.CRASH, Status.INVALID)


def _memory_x(r: pd.Series) -> tuple[Optional[float], bool]:
    """Where a trial sits on the memory axis: (GB, penalized?). Measured beats penalized."""
    for col in (
        "peak_memory_gb",
        "mem.external_peak_gb",
        "mem.device_used_peak_gb",
        "mem.reserved_peak_gb",
        "mem.rss_peak_gb",
    ):
        v = r.get(col)
        if v is not None and not pd.isna(v) and r["status"] not in (Status.INFERRED_OOM, Status.PREDICTED_OOM):
            return float(v), False
    v = r.get("value_memory")
    if v is not None and not pd.isna(v):
        return float(v), True
    return None, False


def plot_pareto(view: StudyView, *, headroom: float = DEFAULT_HEADROOM, chosen: Optional[int] = None) -> Figure:
    """Throughput vs peak memory. Returns a matplotlib Figure (the caller saves or shows it)."""
    df = view.trials
    dev, dev_label = view.device_memory
    dev_label = dev_label.split(" (")[0]  # the caveat is in the page text
    fig = Figure(figsize=(10, 7.2))
    ax, strip = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [4, 1.5], "hspace": 0.16})
    ok = df.loc[measured_feasible(df)] if not df.empty else df
    conf = view.attrs.get(CONFIRMATION_ATTR) or {}
    strip_pts, unplaced = _strip_points(df)
    show_device, xmin, xmax = _memory_axis(ok, conf, strip_pts, dev, headroom)

    _draw_feasible(ax, df, ok, conf, chosen)
    ax.set_ylabel("throughput (tokens/s/GPU)")
    ax.set_title(f"study {view.name}: throughput vs peak memory ({len(df)} trials)", fontsize=11)
    ax.grid(True, alpha=0.3)
    _draw_device_lines(ax, strip, dev, dev_label, headroom, show_device=show_device, xmax=xmax)
    _draw_strip(strip, strip_pts, unplaced, xmin, xmax)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = strip.get_legend_handles_labels()
    fig.legend(handles + h2, labels + l2, fontsize=7, loc="upper left", bbox_to_anchor=(0.905, 0.88), framealpha=0.9)
    return fig


def _strip_points(df: pd.DataFrame) -> tuple[list, dict[str, list[int]]]:
    """The trials with no throughput: ([(status, x, penalized, number)], {status: numbers with no x})."""
    strip_pts = []  # (row, x, penalized, number)
    unplaced: dict[str, list[int]] = {}
    for _, r in (df.loc[df["status"].isin(STRIP_ROWS)] if not df.empty else df).iterrows():
        x, pen = _memory_x(r)
        if x is None:
            unplaced.setdefault(r["status"], []).append(int(r["number"]))
        else:
            strip_pts.append((r["status"], x, pen, int(r["number"])))
    return strip_pts, unplaced


def _memory_axis(
    ok: pd.DataFrame, conf: dict, strip_pts: list, dev: Optional[float], headroom: float
) -> tuple[bool, float, float]:
    """(whether the device line is drawn, the memory axis's xmin, xmax) over every measured peak."""
    xs = list(ok["peak_memory_gb"]) if len(ok) else []
    xs += [e["peak_memory_gb"] for e in conf.get("finalists") or [] if e.get("peak_memory_gb") and len(ok)]
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
    return show_device, xmin, xmax


def _draw_feasible(ax, df: pd.DataFrame, ok: pd.DataFrame, conf: dict, chosen: Optional[int]) -> None:
    """The upper panel: feasible trials, the front, their intervals, the baseline, the pick, the labels."""
    if not len(ok):
        ax.text(0.5, 0.5, "no feasible trial yet", transform=ax.transAxes, ha="center", va="center", color="#888888")
        ax.set_ylim(0, 1)
        return
    _draw_front(ax, ok)
    top = _error_bars(ax, ok, conf)
    _draw_baseline_and_pick(ax, ok, chosen)
    _label_points(ax, df, ok)
    ax.set_ylim(0, max(ok["throughput"].max(), top) * 1.15)


def _draw_front(ax, ok: pd.DataFrame) -> None:
    front = ok.loc[ok["pareto"]].sort_values("peak_memory_gb")
    rest = ok.loc[~ok["pareto"]]
    ax.scatter(
        rest["peak_memory_gb"],
        rest["throughput"],
        s=36,
        c="#9ecae1",
        edgecolors="#3182bd",
        linewidths=0.6,
        label="ok (dominated)",
        zorder=3,
    )
    ax.step(front["peak_memory_gb"], front["throughput"], where="post", color="#08519c", lw=1.4, zorder=2)
    ax.scatter(
        front["peak_memory_gb"],
        front["throughput"],
        s=64,
        c="#08519c",
        edgecolors="white",
        linewidths=0.8,
        label="Pareto front",
        zorder=4,
    )


def _draw_baseline_and_pick(ax, ok: pd.DataFrame, chosen: Optional[int]) -> None:
    base = ok.loc[ok["baseline"]]
    if len(base):
        ax.scatter(
            base["peak_memory_gb"],
            base["throughput"],
            s=260,
            marker="*",
            facecolors="none",
            edgecolors="black",
            linewidths=1.2,
            label="baseline (base config)",
            zorder=5,
        )
    if chosen is not None and (ok["number"] == chosen).any():
        c = ok.loc[ok["number"] == chosen].iloc[0]
        ax.scatter(
            [c["peak_memory_gb"]],
            [c["throughput"]],
            s=240,
            facecolors="none",
            edgecolors="#2ca02c",
            linewidths=2.2,
            label=f"export pick #{chosen}",
            zorder=6,
        )


def _label_points(ax, df: pd.DataFrame, ok: pd.DataFrame) -> None:
    """Each trial's number (only the front's and the baseline's past 60 trials), with how many times the
    search sampled the same config again."""
    label_all = len(ok) <= 60
    dups: dict[int, list[int]] = {}
    for _, r in df.loc[df["duplicate_of"].notna()].iterrows():
        dups.setdefault(int(r["duplicate_of"]), []).append(int(r["number"]))
    for _, r in ok.iterrows():
        if label_all or r["pareto"] or r["baseline"]:
            k = len(dups.get(int(r["number"]), []))
            same = f" (+{k} re-sampled)" if k else ""
            ax.annotate(
                f"#{int(r['number'])}{same}",
                (r["peak_memory_gb"], r["throughput"]),
                xytext=(4, 4),
                textcoords="offset points",
                fontsize=7,
                color="#333333",
            )


def _draw_device_lines(
    ax, strip, dev: Optional[float], dev_label: str, headroom: float, *, show_device: bool, xmax: float
) -> None:
    """The device line and the headroom line, on both panels; off scale, a note where they are."""
    for a in (ax, strip):
        if show_device:
            a.axvline(dev, color="#d62728", lw=1.6)
            a.axvline((1 - headroom) * dev, color="#d62728", lw=1.0, ls="--")
            a.axvspan((1 - headroom) * dev, xmax, color="#d62728", alpha=0.06)
    if dev and not show_device:
        ax.text(
            0.99,
            0.02,
            f"off scale \u2192 {dev_label}; keep {headroom:.0%} free: {(1 - headroom) * dev:.1f} GB",
            transform=ax.transAxes,
            ha="right",
            va="bottom",
            fontsize=8,
            color="#d62728",
        )
    if show_device:
        top = ax.get_ylim()[1]
        ax.text(dev, top * 0.98, f"{dev_label} ", color="#d62728", fontsize=8, ha="right", va="top", rotation=90)
        ax.text(
            (1 - headroom) * dev,
            top * 0.98,
            f"keep {headroom:.0%} free: {(1 - headroom) * dev:.1f} GB ",
            color="#d62728",
            fontsize=8,
            ha="right",
            va="top",
            rotation=90,
        )


def _draw_strip(strip, strip_pts: list, unplaced: dict[str, list[int]], xmin: float, xmax: float) -> None:
    """The lower panel: failed trials have no real throughput (Optuna holds a penalized 0), one row per status."""
    rows = [s for s in STRIP_ROWS if any(p[0] == s for p in strip_pts) or s in unplaced] or list(STRIP_ROWS[:2])
    ypos = {s: i for i, s in enumerate(reversed(rows))}
    for status in rows:
        pts = [p for p in strip_pts if p[0] == status]
        _strip_scatter(strip, status, pts, ypos[status], xmax)
        _strip_labels(strip, status, pts, unplaced.get(status), ypos[status], xmin, xmax)
    if not strip_pts and not unplaced:
        strip.text(
            0.5,
            0.5,
            "no failed or skipped trial",
            transform=strip.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="#888888",
        )
    strip.set_yticks(list(ypos.values()))
    strip.set_yticklabels([STATUS_STYLE[s][0] for s in ypos], fontsize=8)
    strip.set_ylim(-0.7, len(rows) - 0.3)
    strip.set_xlim(xmin, xmax)
    strip.set_xlabel("peak memory per GPU (GB)  —  external sampler and in-process peak, whichever is larger")
    strip.grid(True, axis="x", alpha=0.3)
    strip.set_title(
        "no throughput (failed or skipped): placed at measured peak, else at the penalized value",
        fontsize=8,
        loc="left",
        color="#555555",
    )


def _strip_scatter(strip, status: str, pts: list, y: float, xmax: float) -> None:
    """One status's points: filled at a measured peak, hollow at the penalized value."""
    label, color, marker = STATUS_STYLE[status]
    real = [p for p in pts if not p[2]]
    pen = [p for p in pts if p[2]]
    if real:
        strip.scatter(
            [min(p[1], xmax * 0.995) for p in real],
            [y] * len(real),
            marker=marker,
            s=55,
            c=color,
            label=f"{label}: measured peak",
            zorder=3,
        )
    if pen:
        strip.scatter(
            [min(p[1], xmax * 0.995) for p in pen],
            [y] * len(pen),
            marker=marker,
            s=55,
            **({"c": color} if marker in ("x", "+") else {"facecolors": "none", "edgecolors": color}),
            alpha=0.6,
            label=f"{label}: penalized value",
            zorder=3,
        )


def _strip_labels(
    strip, status: str, pts: list, unplaced: Optional[list[int]], y: float, xmin: float, xmax: float
) -> None:
    """One status's trial numbers: beside each point, at the edge for penalties off the scale, and a list of
    the trials with no memory figure at all."""
    color = STATUS_STYLE[status][1]
    pinned: dict[float, list[int]] = {}  # penalties far off the scale: pinned to the edge, named once
    for _, x, penalized, n in pts:
        if x > xmax * 0.995:
            pinned.setdefault(round(x, 1), []).append(n)
        else:
            strip.annotate(
                f"#{n}",
                (x, y),
                xytext=(0, 6),
                textcoords="offset points",
                fontsize=7,
                ha="center",
                color=color,
            )
    for x, ns in pinned.items():
        names = ", ".join(f"#{n}" for n in ns[:10]) + (" ..." if len(ns) > 10 else "")
        strip.annotate(
            f"{names} at {x:g} GB \u2192",
            (xmax * 0.995, y),
            xytext=(-8, 0),
            textcoords="offset points",
            fontsize=7,
            ha="right",
            va="center",
            color=color,
        )
    if unplaced is not None:
        names = ", ".join(f"#{n}" for n in unplaced[:12]) + (" ..." if len(unplaced) > 12 else "")
        strip.text(
            xmin + (xmax - xmin) * 0.01,
            y,
            f"no measurement: {names}",
            fontsize=7,
            va="center",
            ha="left",
            color=color,
        )


def _error_bars(ax, ok: pd.DataFrame, conf: Optional[dict]) -> float:
    """Each trial's 90% throughput interval as an error bar, and the confirmed finalists (median of their
    re-runs, its interval, at the largest peak the re-runs saw). Returns the highest value drawn."""
    top = 0.0
    has = ok.loc[ok["throughput_ci_low"].notna() & ok["throughput_ci_high"].notna()]
    if len(has):
        lo = (has["throughput"] - has["throughput_ci_low"]).clip(lower=0)
        hi = (has["throughput_ci_high"] - has["throughput"]).clip(lower=0)
        ax.errorbar(
            has["peak_memory_gb"],
            has["throughput"],
            yerr=[lo, hi],
            fmt="none",
            ecolor="#6baed6",
            elinewidth=0.9,
            capsize=2.5,
            zorder=2,
            label="90% interval of a trial",
        )
        top = float(has["throughput_ci_high"].max())
    entries = [e for e in (conf or {}).get("finalists") or [] if e.get("throughput") and e.get("peak_memory_gb")]
    for i, e in enumerate(entries):
        ci = e.get("throughput_ci") or [e["throughput"], e["throughput"]]
        ax.errorbar(
            [e["peak_memory_gb"]],
            [e["throughput"]],
            yerr=[[max(e["throughput"] - ci[0], 0.0)], [max(ci[1] - e["throughput"], 0.0)]],
            fmt="D",
            ms=6,
            color="#6a3d9a",
            ecolor="#6a3d9a",
            capsize=3,
            zorder=5,
            label="confirmed: median of the re-runs, 90% interval" if i == 0 else None,
        )
        ratio = f" {e['ratio']:.2f}x" if e.get("ratio") is not None else ""
        ax.annotate(
            f"#{e['number']} confirmed{ratio}",
            (e["peak_memory_gb"], e["throughput"]),
            xytext=(6, -10),
            textcoords="offset points",
            fontsize=7,
            color="#6a3d9a",
        )
        top = max(top, float(ci[1]))
    return top


def plot_importances(imp: Importances) -> Figure:
    knobs = sorted(
        set(imp.throughput) | set(imp.memory), key=lambda k: -(imp.throughput.get(k, 0) + imp.memory.get(k, 0))
    )
    fig = Figure(figsize=(10, max(2.4, 0.42 * len(knobs) + 1.2)))
    axes = fig.subplots(1, 2, sharey=True)
    for a, (title, vals, color) in zip(
        axes, (("throughput", imp.throughput, "#1f77b4"), ("peak memory", imp.memory, "#d62728"))
    ):
        a.set_title(f"importance for {title}", fontsize=10)
        if not knobs:
            a.text(
                0.5,
                0.5,
                imp.message,
                ha="center",
                va="center",
                wrap=True,
                fontsize=9,
                color="#666666",
                transform=a.transAxes,
            )
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


def plot_phases(view: StudyView, numbers: list[int]) -> Figure:
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
                known = sum(value_or_zero(r.get(f"{TIME_PREFIX}{p}")) for p in PHASES)
                v = max(value_or_zero(r["step_s"]) - known, 0.0)
            else:
                v = value_or_zero(r.get(f"{TIME_PREFIX}{phase}"))
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


def figure_png(fig: Figure, path: Optional[Path] = None, dpi: int = 110) -> bytes:
    """A figure as PNG bytes (also written to ``path`` if given)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    data = buf.getvalue()
    if path is not None:
        path.write_bytes(data)
    return data
