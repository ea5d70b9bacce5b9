"""``ppotune report``: the study's report (:mod:`tuner.results.report`) written where the user asks.

Writes into ``--out`` (default: ``report/`` in the study's search output dir, else ``./ppotune_report``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.contracts import DEFAULT_HEADROOM, OUT_DIR_FILES, ExitCode, StorageError, StorageSpec, search_dir_of
from tuner.commands.flags import command_error, deprecated
from tuner.results.report import REPORT_FILES, write_view_report
from tuner.results.view import add_study_arguments, view_from_args
from tuner.study.schema import notes_summary
from tuner.study.selection import selection_of

__all__ = ["add_arguments", "out_dir_of", "run"]


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
