"""report.html in a real browser: headless Chromium (Debian's package driven by Playwright, tests/browser.py) opens
the session's real search's report with no network and finds no console error, no failed request, no request
leaving the page, and every plot and table drawn. Skips, saying why, where no Chromium could be installed."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import pytest

from browser import BrowserUnavailable, chromium, open_offline
from tuner.results.view import load as load_view
from tuner.rules.finalists import CONFIRMATION_ATTR

#: each section of a search's report whose plot or tables it always draws: heading -> (plot alts, tables at least).
#: The memory section is there because the real search probes its picks at worst case (--probe's default); the
#: confirmation's whenever its study holds one (--confirm 1 re-runs the finalists unless the baseline dominated them)
SECTIONS = {
    "Pareto front: throughput vs peak memory": (["Pareto plot"], 0),
    "Baseline vs best": ([], 0),
    "Finalists confirmed side by side": ([], 1),
    "Pareto configs": (["phases"], 2),
    "Sequence lengths the trials saw": ([], 1),
    "Memory: the model, the production world, the worst case": ([], 1),
    "Which knobs matter": (["importances"], 0),
    "Knobs that changed nothing measurable": ([], 1),
    "What the search cost": ([], 1),
    "All trials": ([], 1),
}

#: the PNG beside report.html that each embedded plot is
PLOT_FILES = {"Pareto plot": "pareto.png", "phases": "phases.png", "importances": "importances.png"}

#: per h2 section: its heading, its tables (rows, drawn size) and images (alt, decoded and drawn size)
_LAYOUT = """() => [...document.querySelectorAll('h2')].map(h => {
  const tables = [], images = [];
  for (let el = h.nextElementSibling; el && el.tagName !== 'H2'; el = el.nextElementSibling) {
    for (const t of el.matches('table') ? [el] : el.querySelectorAll('table')) {
      const box = t.getBoundingClientRect();
      const ids = [...t.rows].map(r => r.id).filter(Boolean);
      tables.push({rows: t.rows.length, width: box.width, height: box.height, ids});
    }
    for (const i of el.matches('img') ? [el] : el.querySelectorAll('img')) {
      const box = i.getBoundingClientRect();
      images.push({alt: i.alt, natural: [i.naturalWidth, i.naturalHeight], drawn: [box.width, box.height]});
    }
  }
  return {heading: h.textContent, tables, images};
})"""


@pytest.fixture(scope="module")
def headless():
    try:
        with chromium() as browser:
            yield browser
    except BrowserUnavailable as e:
        pytest.skip(f"no headless Chromium for this test: {e}")


def png_size(path: Path) -> list[int]:
    """[width, height] from a PNG's header."""
    return list(struct.unpack(">II", path.read_bytes()[16:24]))


def test_the_page_checks_catch_what_a_broken_page_does(headless, tmp_path):
    """The checks the report must pass fail where they should: a request out, a missing file, a console error,
    an uncaught exception, an image that does not decode, a link to no anchor."""
    page = tmp_path / "broken.html"
    page.write_text(
        "<!DOCTYPE html><html><body><img alt='remote' src='https://example.invalid/a.png'>"
        "<img alt='missing' src='missing.png'><img alt='garbled' src='data:image/png;base64,AAAA'>"
        "<a href='#nowhere'>x</a><script>console.error('boom'); throw new Error('uncaught one')</script>"
        "</body></html>"
    )
    with open_offline(headless, page) as load:
        problems = "\n".join(load.problems())
    for expected in (
        "network request: https://example.invalid/a.png",
        "failed request: https://example.invalid/a.png",
        "failed request: " + (tmp_path / "missing.png").as_uri(),
        "console error: boom",
        "console error: uncaught: uncaught one",
        "image not decoded: garbled",
        "link to no anchor: #nowhere",
    ):
        assert expected in problems, f"{expected!r} not caught:\n{problems}"


@pytest.mark.slow
def test_real_search_report_in_a_browser(real_search, headless):
    report = real_search / "report"
    with open_offline(headless, report / "report.html") as load:
        assert load.problems() == []
        sections = {s["heading"]: s for s in load.page.evaluate(_LAYOUT)}
        cards = load.page.locator(".card").count()
    assert cards >= 3  # trials, best under headroom, search cost at least
    expected = dict(SECTIONS)
    if not load_view(storage=str(real_search)).attrs.get(CONFIRMATION_ATTR):  # the baseline dominated: none ran
        expected.pop("Finalists confirmed side by side")
    assert [h for h in sections if h in SECTIONS] == list(expected), f"sections: {list(sections)}"
    for heading, (plots, min_tables) in expected.items():
        section = sections[heading]
        assert [i["alt"] for i in section["images"]] == plots, heading
        for img in section["images"]:  # the PNG written beside the page, decoded and drawn at a readable size
            assert img["natural"] == png_size(report / PLOT_FILES[img["alt"]]), img
            assert img["drawn"][0] >= 400 and img["drawn"][1] >= 200, img
        assert len(section["tables"]) >= min_tables, heading
    for section in sections.values():  # every table on the page, those above and any other: drawn, with rows
        for table in section["tables"]:
            assert table["rows"] >= 2 and table["width"] > 0 and table["height"] > 0, (section["heading"], table)
    with open(report / "trials.csv", newline="") as f:
        numbers = [int(r["number"]) for r in csv.DictReader(f)]
    (trials,) = sections["All trials"]["tables"]
    assert trials["rows"] == 1 + len(numbers)  # a header, then one row per trial, the trial's anchor
    assert sorted(trials["ids"]) == sorted(f"t{n}" for n in numbers)
