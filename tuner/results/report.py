"""What a study found, as one offline HTML page plus PNG, CSV and Markdown (``ppotune report``:
:mod:`tuner.commands.report`).

Reads the study read-only (docs/contracts.md section 3), so it can run while the search
is still going. Writes into its out dir:

- ``report.html``  self-contained (inline CSS, base64 PNG images, no links out)
- ``pareto.png``   throughput vs peak memory, every trial, failures on a strip below
- ``importances.png``, ``phases.png``
- ``trials.csv``   one row per trial (:func:`tuner.results.view.trials_frame`)
- ``summary.md``   the same findings as text

The findings are computed in :mod:`~tuner.results.analysis`, drawn by
:mod:`~tuner.results.plots` and written out by :mod:`~tuner.results.html`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainer.contracts import (
    DEFAULT_HEADROOM,
    OUT_DIR_FILES,
    StorageSpec,
    parse_storage,
)
from tuner.results.analysis import build
from tuner.results.fit_files import fit_summary, write_fit_report
from tuner.results.html import report_html, summary_md
from tuner.results.plots import figure_png, plot_importances, plot_pareto, plot_phases
from tuner.results.view import StudyView, load, pareto_front

__all__ = ["REPORT_FILES", "write_report", "write_view_report"]

#: what :func:`write_view_report` writes, besides report.html
REPORT_FILES = ("pareto.png", "importances.png", "phases.png", "trials.csv", "summary.md")


def write_report(
    storage: str | StorageSpec,
    study_name: Optional[str],
    out_dir: str | Path,
    *,
    memory_headroom: float = DEFAULT_HEADROOM,
) -> Path:
    """Write report.html, pareto.png, importances.png, phases.png, trials.csv and summary.md.

    ``storage``: a :class:`StorageSpec`, or any ``--storage`` spelling (an Optuna URL,
    ``journal:PATH``, a search out dir). ``out_dir``: where to write; a ``ppotune search``
    output dir (it holds study.db, study.log or trials/) gets the files in ``out_dir/report``,
    where ``ppotune report --out DIR`` puts them. Returns the path of report.html. Never
    writes to the storage. (``ppotune search --report`` calls this.)
    """
    spec = storage if isinstance(storage, StorageSpec) else parse_storage(storage)
    view = load(storage=spec, study_name=study_name)
    out = Path(out_dir)
    if any((out / n).exists() for n in (*OUT_DIR_FILES, "trials")):
        out = out / "report"
    return write_view_report(view, out, memory_headroom=memory_headroom)


def write_view_report(view: StudyView, out_dir: str | Path, *, memory_headroom: float = DEFAULT_HEADROOM) -> Path:
    """:func:`write_report` for a study already read; returns the path of report.html."""
    out = Path(out_dir)
    fit = fit_summary(view)
    if fit is not None:  # a ppotune fit's study: its table and its probes, no Pareto front (a probe's speed is moot)
        return write_fit_report(view, fit, out)
    out.mkdir(parents=True, exist_ok=True)
    data = build(view, headroom=memory_headroom)
    df = view.trials
    chosen = data.pick.chosen if data.pick is not None else None
    base = [int(n) for n in df.loc[df["baseline"] & df["feasible"], "number"]] if not df.empty else []
    images = {
        "pareto": figure_png(plot_pareto(view, headroom=memory_headroom, chosen=chosen), out / "pareto.png"),
        "importances": figure_png(plot_importances(data.importances), out / "importances.png"),
        "phases": figure_png(plot_phases(view, list(dict.fromkeys(pareto_front(df) + base))), out / "phases.png"),
    }
    df.to_csv(out / "trials.csv", index=False)
    (out / "summary.md").write_text(summary_md(data))
    page = out / "report.html"
    page.write_text(report_html(data, images), encoding="utf-8")
    return page
