"""What the doc generators (gen_cli_docs.py, gen_layers_doc.py, gen_verl_knob_table.py) share: the generated part
of a page between its two markers, and the command that writes the page's new text or, with ``--check``, says how it
differs and exits 1."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import Callable, Optional


def rewrite(path: Path, text: str, new: str, *, check: bool, source: str, command: str) -> int:
    """``check``: 0 when ``text`` (the page now) is ``new``, else the diff and 1; else write ``new`` if it differs."""
    name = f"{path.parent.name}/{path.name}"
    if check:
        if new != text:
            print("\n".join(difflib.unified_diff(text.splitlines(), new.splitlines(), name, source, lineterm="")))
            print(f"{name} is out of date: run {command}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new)
        print(f"{name}: rewritten from {source}")
    return 0


def replace_marked(text: str, begin: str, end: str, block: str, *, page: Path) -> str:
    """``text`` with its part from the marker ``begin`` to the marker ``end`` (both included) replaced by ``block``."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{page}: the markers {begin!r} ... {end!r} are missing")
    return text[:start] + block + text[stop + len(end) :]


def main(
    argv: Optional[list[str]],
    *,
    page: Path,
    updated: Callable[[str], str],
    description: str,
    source: str,
    command: str,
) -> int:
    """A generator's command line: ``--check`` or write ``page`` as ``updated`` makes it from its text now."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if the page is out of date")
    args = parser.parse_args(argv)
    text = page.read_text()
    return rewrite(page, text, updated(text), check=args.check, source=source, command=command)
