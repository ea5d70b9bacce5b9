"""Headless Chromium for the report's browser test and scripts/screenshots.py: Debian's ``chromium`` package driven
by Playwright through ``executable_path`` (Playwright's own browser download is never used).
scripts/install_test_deps.sh installs it (part ``browser``); where it cannot, :class:`BrowserUnavailable` says why.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: the browser binary to drive, when it is not ``chromium`` on PATH (Debian's package)
CHROMIUM_ENV = "PPOTUNE_CHROMIUM"

#: URL schemes a self-contained page may load: itself, and what it embeds
LOCAL_SCHEMES = ("file:", "data:", "about:")


class BrowserUnavailable(RuntimeError):
    """No headless Chromium here: the message says why and what installs it."""


def install_status() -> str:
    """Why scripts/install_test_deps.sh could not install the browser, or that it was not run."""
    status = REPO / ".test_deps" / "browser.status"
    return status.read_text().strip() if status.exists() else "scripts/install_test_deps.sh was not run"


def chromium_path() -> str:
    """``$PPOTUNE_CHROMIUM``, else Debian's ``chromium`` on PATH."""
    path = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise BrowserUnavailable(f"no chromium on PATH nor ${CHROMIUM_ENV}; install: {install_status()}")
    return path


@contextmanager
def chromium():
    """A headless Chromium (Playwright's ``Browser``), closed on exit."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError as e:
        raise BrowserUnavailable(f"playwright is not importable ({e}): pip install -e '.[dev]'") from None
    path = chromium_path()
    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=path, headless=True)
        except Error as e:
            first = (str(e).strip().splitlines() or ["?"])[0]
            raise BrowserUnavailable(f"{path} did not start under Playwright ({first}); install: {install_status()}")
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class PageLoad:
    """A page opened by :func:`open_offline` and what went wrong while it loaded and rendered."""

    page: object  #: Playwright's ``Page``
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    #: every request to a URL that is not the page or what it embeds (``file:``, ``data:``): blocked, and listed
    network: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Everything above, then every image the browser could not decode and every in-page link to no anchor."""
        return (
            [f"console error: {m}" for m in self.console_errors]
            + [f"failed request: {u}" for u in self.failed_requests]
            + [f"network request: {u}" for u in self.network]
            + [f"image not decoded: {alt}" for alt in self.page.evaluate(_BROKEN_IMAGES)]
            + [f"link to no anchor: {href}" for href in self.page.evaluate(_DANGLING_LINKS)]
        )


_BROKEN_IMAGES = (
    "[...document.images].filter(i => !i.complete || !i.naturalWidth).map(i => i.alt || i.src.slice(0, 80))"
)
_DANGLING_LINKS = (
    "[...document.querySelectorAll('a[href^=\"#\"]')]"
    ".filter(a => a.hash && !document.getElementById(a.hash.slice(1))).map(a => a.getAttribute('href'))"
)


def _on_console(load: PageLoad):
    def record(message) -> None:
        if message.type == "error":
            where = message.location or {}
            load.console_errors.append(f"{message.text} ({where.get('url', '?')}:{where.get('lineNumber', '?')})")

    return record


@contextmanager
def open_offline(browser, page_path: Path, *, width: int = 1280, height: int = 2400):
    """Open ``page_path`` in a fresh browser context with no network: every request whose URL is not ``file:`` or
    ``data:`` is aborted and recorded, as are console errors, uncaught exceptions and failed requests."""
    context = browser.new_context(viewport={"width": width, "height": height}, offline=True)
    page = context.new_page()
    load = PageLoad(page)

    def block(route) -> None:
        load.network.append(route.request.url)
        route.abort("blockedbyclient")

    context.route(lambda url: not url.startswith(LOCAL_SCHEMES), block)
    page.on("console", _on_console(load))
    page.on("pageerror", lambda e: load.console_errors.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: load.failed_requests.append(f"{r.url[:200]} ({r.failure})"))
    page.on("websocket", lambda ws: load.network.append(ws.url))
    try:
        page.goto(Path(page_path).resolve().as_uri(), wait_until="networkidle")  # late requests too
        yield load
    finally:
        context.close()
