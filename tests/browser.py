"""Headless Debian chromium for tests: open a page, record every request and console error.

Reused by every test that looks at rendered HTML (widgets, the course site):

    from browser import open_page
    with open_page(html_path) as view:
        view.page.wait_for_selector(...)
        ...
    view.assert_offline(); view.assert_no_errors()

A widget test first makes its page with `widget_page(folder, cell, ...)`: the cells run in a real
kernel, the widget state is saved as JupyterLab saves it, and the notebook is exported to static HTML.

Playwright drives the system chromium (`make browser` installs it); Playwright's own browser
download is never used. Requests that would leave the machine are recorded and aborted, so a
page that needs the network fails the test instead of hanging or silently passing.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

CHROMIUM_ENV = "COURSE_CHROMIUM"
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")  # nothing here touches a network
NETWORK = re.compile(r"^(https?|wss?|ftp)://")


def chromium_path() -> str:
    """The chromium binary, or a test failure that says how to install it (never a skip)."""
    path = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail(f"chromium not found (looked for {path}): run `make browser`", pytrace=False)
    return path


@dataclass
class PageView:
    """An open page plus everything it asked for and complained about."""

    page: object  # playwright.sync_api.Page
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # console.error and uncaught exceptions

    def assert_offline(self) -> None:
        outside = [u for u in self.requests if not u.startswith(LOCAL_SCHEMES)]
        assert not outside, f"page requested {len(outside)} non-local URLs: {outside[:5]}"

    def assert_no_errors(self) -> None:
        assert not self.errors, f"console errors: {self.errors[:5]}"


@contextmanager
def open_page(path: str | os.PathLike, *, width: int = 1100, height: int = 800) -> Iterator[PageView]:
    """Open a local HTML file in headless chromium and yield a PageView; closes it afterwards."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright Python package is missing: run `make setup`", pytrace=False)
    executable = chromium_path()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            context.route(NETWORK, lambda route: route.abort())
            page = context.new_page()
            view = PageView(page)
            page.on("request", lambda r: view.requests.append(r.url))
            page.on("console", lambda m: view.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: view.errors.append(f"uncaught: {e}"))
            page.goto(Path(path).resolve().as_uri())
            yield view
        finally:
            browser.close()


def is_blank(png: str | os.PathLike) -> bool:
    """True if a screenshot is (nearly) one flat colour, i.e. nothing was drawn."""
    from PIL import Image, ImageStat

    with Image.open(png) as img:
        spread = ImageStat.Stat(img.convert("L")).stddev[0]
    return spread < 2.0


def widget_page(folder: str | os.PathLike, *cells) -> Path:
    """Run `cells` (code strings, or nbformat cells) as one notebook in a fresh kernel, keep its widget
    state, and export it to `folder`/page.html with `course.static_html`; returns that path."""
    import nbformat
    from nbclient import NotebookClient

    from course.static_html import export_html

    chromium_path()  # fail fast, before the kernel starts, if chromium is missing
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) if isinstance(c, str) else c for c in cells])
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(folder)}}).execute()
    assert "widgets" in nb.metadata, "nbclient saved no widget state"
    return export_html(nb, Path(folder) / "page.html")
