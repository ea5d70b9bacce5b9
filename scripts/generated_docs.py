"""What the doc generators (gen_cli_docs.py, gen_layers_doc.py) share: write a page's new text, or with ``--check``
say how it differs and exit 1."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path


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
