"""``ppotune report``: what a study found, as one offline HTML page plus PNG, CSV and Markdown.

Reads the study read-only (docs/contracts.md section 3), so it can run while the search
is still going. Writes into ``--out`` (default: ``report/`` in the study's search output dir):

- ``report.html``  self-contained (inline CSS, base64 PNG images, no links out)
- ``pareto.png``   throughput vs peak memory, every trial, failures on a strip below
- ``importances.png``, ``phases.png``
- ``trials.csv``   one row per trial (:func:`tuner.results.view.trials_frame`)
- ``summary.md``   the same findings as text

The findings are computed in :mod:`~tuner.results.analysis`, drawn by
:mod:`~tuner.results.plots` and written out by :mod:`~tuner.results.html`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from trainer.contracts import (
    DEFAULT_HEADROOM,
    OUT_DIR_FILES,
    ExitCode,
    StorageError,
    StorageSpec,
    parse_storage,
    search_dir_of,
)
from trainer.launch.cliflags import command_error, deprecated
from tuner.results.analysis import build
from tuner.results.fit_files import fit_summary, write_fit_report
from tuner.results.html import report_html, summary_md
from tuner.results.plots import figure_png, plot_importances, plot_pareto, plot_phases
from tuner.results.view import StudyView, add_study_arguments, load, pareto_front, view_from_args
from tuner.study.schema import notes_summary
from tuner.study.selection import selection_of

__all__ = ["REPORT_FILES", "write_report", "write_view_report", "add_arguments", "run"]

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


# --------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    add_study_arguments(parser)
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where to write (a search output dir gets DIR/report/; default: report/ in the study's search output "
        "dir, else ./ppotune_report)",
    )
    parser.add_argument("--to", metavar="DIR", help=argparse.SUPPRESS)  # deprecated: --out
    parser.add_argument(
        "--memory-headroom",
        type=float,
        default=None,
        metavar="F",
        help="fraction of device memory to keep free, drawn on the plot (default: the search's --memory-headroom, "
        f"else {DEFAULT_HEADROOM:.2f})",
    )


def out_dir_of(args, spec: StorageSpec) -> Path:
    """Where the report goes: ``--out`` (a search output dir: its ``report/``), else the study's search dir's
    ``report/``, else ``./ppotune_report``."""
    if args.to:
        deprecated("report", "--to DIR", "--out DIR")
    out = args.to or args.out
    if out:
        return Path(out) / "report" if any((Path(out) / n).exists() for n in (*OUT_DIR_FILES, "trials")) else Path(out)
    home = search_dir_of(spec)
    return home / "report" if home is not None else Path("ppotune_report")


def run(args) -> int:
    try:
        view = view_from_args(args)
    except StorageError as e:
        return command_error("report", str(e))
    headroom = args.memory_headroom if args.memory_headroom is not None else selection_of(view.attrs).headroom
    if not 0.0 <= headroom < 1.0:
        return command_error("report", f"--memory-headroom must be in [0, 1), got {headroom}")
    for note in notes_summary(view.notes):
        print(f"ppotune report: note: {note}", file=sys.stderr)
    if view.algorithm_warning:
        print(f"ppotune report: warning: {view.algorithm_warning}", file=sys.stderr)
    to = out_dir_of(args, view.storage)
    page = write_view_report(view, to, memory_headroom=headroom)
    print(f"{page}  ({len(view.trials)} trials)")
    for name in REPORT_FILES:
        if (to / name).is_file():
            print(f"  {to / name}")
    return ExitCode.OK
