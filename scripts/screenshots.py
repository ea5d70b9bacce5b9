"""Regenerate docs/img's screenshots from the demo, in the browser the report's test uses (tests/browser.py: Debian's
chromium driven by Playwright).

    python scripts/screenshots.py                    # runs the demo search in a temporary dir, then shoots its report
    python scripts/screenshots.py --from ppotune_out # shoots the report of a demo already run

The demo is the ``ppotune search`` of the README's first set-up command, read from the README so that the picture is
of the command a reader runs. It launches trials: on a shared machine run this under the heavy lock (CONTRIBUTING).
A page with a console error, a failed request or a request out is not shot: the script exits 1 saying what.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from browser import BrowserUnavailable, chromium, open_offline  # noqa: E402

#: docs/img file -> (viewport width, height in CSS pixels): the top of report.html as a first look at a search
SHOTS = {"report_screenshot.png": (1280, 2400)}


def demo_search_args(readme: str) -> list[str]:
    """The arguments after ``ppotune`` of the first ``ppotune search`` in the README's first bash block."""
    block = readme.split("```bash", 1)[-1].split("```", 1)[0]
    for line in block.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words = list(lex)
        for start in (i for i, w in enumerate(words) if w == "ppotune" and words[i + 1 : i + 2] == ["search"]):
            end = next((j for j in range(start, len(words)) if words[j] in ("&&", "||", ";", "|")), len(words))
            return words[start + 1 : end]
    raise SystemExit("screenshots: the README's first bash block runs no `ppotune search`")


def run_demo(out: Path) -> None:
    """The README's demo search with its output in ``out`` (its ``--out`` replaced), from the repository root."""
    args = demo_search_args((REPO / "README.md").read_text())
    if "--out" in args:
        del args[args.index("--out") : args.index("--out") + 2]
    if "--report" not in args:
        args.append("--report")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    print("screenshots: ppotune", shlex.join([*args, "--out", str(out)]), flush=True)
    subprocess.run([sys.executable, "-m", "tuner.cli", *args, "--out", str(out)], cwd=REPO, env=env, check=True)


def shoot(report: Path, to: Path) -> int:
    """Each of :data:`SHOTS` of ``report`` (report.html) into ``to``; 1 if the page loaded with a problem."""
    with chromium() as browser:
        for name, (width, height) in SHOTS.items():
            with open_offline(browser, report, width=width, height=height) as load:
                problems = load.problems()
                if problems:
                    print(f"screenshots: {report}: not shot:", *problems, sep="\n  ", file=sys.stderr)
                    return 1
                load.page.screenshot(path=str(to / name), clip={"x": 0, "y": 0, "width": width, "height": height})
            print(f"screenshots: {to / name}  ({(to / name).stat().st_size // 1024} KiB, {browser.version})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", metavar="DIR", help="a demo search's output dir already run")
    parser.add_argument("--to", metavar="DIR", default=str(REPO / "docs" / "img"), help="default: docs/img")
    args = parser.parse_args(argv)
    try:
        if args.source:
            return shoot(Path(args.source) / "report" / "report.html", Path(args.to))
        with tempfile.TemporaryDirectory(prefix="ppotune_demo_") as tmp:
            run_demo(Path(tmp) / "ppotune_out")
            return shoot(Path(tmp) / "ppotune_out" / "report" / "report.html", Path(args.to))
    except BrowserUnavailable as e:
        print(f"screenshots: no headless Chromium: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
